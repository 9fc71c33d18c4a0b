//! The Rope ops' frequency tables on the GPU ([`RopeTables`]): a plan's `Op::Rope` carries
//! its `inv_freq` as host values, so the device copies every distinct table once, when it
//! starts ([`prepare_rope`]: one small allocation, freed with the device), and the attention
//! family finds an op's copy by its bits. Nothing is allocated during steps.

use crate::ir::Program;
use crate::ir::schedule::{Op, OpEntry};
use anyhow::{Result, anyhow};
use cudarc::driver::{result as dr, sys as ds};

/// The distinct `inv_freq` tables of `ops`' Rope ops (compared bit for bit), in order of
/// first use, each with its element offset in their concatenation; and the concatenation.
pub fn rope_layout(ops: &[OpEntry]) -> (Vec<(Vec<f32>, usize)>, Vec<f32>) {
    let mut tables: Vec<(Vec<f32>, usize)> = Vec::new();
    let mut all = Vec::new();
    for e in ops {
        if let Op::Rope { inv_freq, .. } = &e.op
            && !tables.iter().any(|(t, _)| same_bits(t, inv_freq))
        {
            tables.push((inv_freq.clone(), all.len()));
            all.extend_from_slice(inv_freq);
        }
    }
    (tables, all)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The device copies of a program's Rope `inv_freq` tables: one allocation made when the
/// device starts ([`prepare_rope`]; nothing is allocated during steps), freed on drop.
#[derive(Debug, Default)]
pub struct RopeTables {
    /// The allocation (0: none, the program has no Rope op).
    ptr: ds::CUdeviceptr,
    /// Each distinct table and its element offset in the allocation.
    tables: Vec<(Vec<f32>, usize)>,
}

impl RopeTables {
    /// The device address of the copy of `inv_freq`.
    pub fn find(&self, inv_freq: &[f32]) -> Option<u64> {
        self.tables
            .iter()
            .find(|(t, _)| same_bits(t, inv_freq))
            .map(|&(_, at)| self.ptr + (at * 4) as u64)
    }
}

impl Drop for RopeTables {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by `malloc_sync` in `prepare_rope`; the device's stream is
            // synchronized before its fields drop (`GpuDevice`'s `Drop`).
            let _ = unsafe { dr::free_sync(self.ptr) };
        }
    }
}

/// Copies every distinct `inv_freq` table of `program`'s Rope ops to device memory (one
/// small allocation, a few KiB at most, outside the plan's tiers), with the device's context
/// current. To be called once by `GpuDevice::new`, which keeps the result.
pub fn prepare_rope(program: &Program) -> Result<RopeTables> {
    let (tables, all) = rope_layout(&program.schedule.ops);
    if all.is_empty() {
        return Ok(RopeTables::default());
    }
    let bytes = all.len() * 4;
    // SAFETY: a fresh allocation of `bytes`, filled right away and freed by `RopeTables`.
    let ptr = unsafe { dr::malloc_sync(bytes) }
        .map_err(|e| anyhow!("allocating the rotary tables ({bytes} bytes) on the GPU: {e:?}"))?;
    let out = RopeTables { ptr, tables };
    // SAFETY: `ptr` holds `bytes` = the bytes of `all`.
    unsafe { dr::memcpy_htod_sync(ptr, &all) }
        .map_err(|e| anyhow!("copying the rotary tables to the GPU: {e:?}"))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::BufId;
    use crate::ir::schedule::{Phase, Rows};

    fn rope_op(inv_freq: Vec<f32>, inverse: bool) -> OpEntry {
        OpEntry {
            name: "rope".into(),
            phase: Phase::Forward,
            op: Op::Rope {
                x: BufId(0),
                positions: None,
                rows: Rows { b: 1, t: 4 },
                width: 8,
                rotated: 8,
                hd: 8,
                inv_freq,
                scale: 1.0,
                inverse,
            },
            flops: 0,
            params: None,
            grads: None,
            micro: 0,
            frozen: false,
        }
    }

    #[test]
    fn rope_tables_are_stored_once_each() {
        let a = vec![1.0, 0.1, 0.01, 0.001];
        let b = vec![1.0, 0.2, 0.04, 0.008];
        let ops = [
            rope_op(a.clone(), false),
            rope_op(a.clone(), false),
            rope_op(b.clone(), false),
            rope_op(a.clone(), true),
        ];
        let (tables, all) = rope_layout(&ops);
        assert_eq!(tables, vec![(a.clone(), 0), (b.clone(), 4)]);
        assert_eq!(all, [a.clone(), b.clone()].concat());
        let t = RopeTables {
            ptr: 0x1000,
            tables,
        };
        assert_eq!(t.find(&a), Some(0x1000));
        assert_eq!(t.find(&b), Some(0x1010));
        assert_eq!(t.find(&[1.0, 0.1, 0.01, -0.001]), None);
        assert_eq!(t.find(&a[..2]), None);
        // Not a real allocation: nothing to free.
        std::mem::forget(t);
        assert!(rope_layout(&[]).1.is_empty());
    }
}
