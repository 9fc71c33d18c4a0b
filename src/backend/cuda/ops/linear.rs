//! The linear family on the GPU, as the CPU's `ops/linear.rs` and `matmul.rs`: [`Op::Matmul`]
//! and [`Op::MatmulBackward`] on cuBLASLt ([`super::super::gemm`]), and [`Op::AddBias`]
//! (`add_bias_<S>`, `kernels/bias.cu`).
//!
//! - `Matmul`: the weight as the GEMM reads it (the f32 master in an fp32 plan; else its
//!   storage-type copy in the weight tile, or a quantized base decoded there), then one GEMM
//!   `out[N, OC] = (residual, as cuBLASLt's C with beta 1, when given) + inp[N, IC] @ W`, the
//!   bias by the GEMM's epilogue (or `add_bias_<S>` after, see `gemm.rs`).
//! - `MatmulBackward`: `dinp[N, IC] = dout @ Wᵀ` (overwritten: beta 0); then, unless the op is
//!   frozen or its weight quantized, `dW += inpᵀ @ dout` (`[OC, IC]` for `OutIn`: `doutᵀ @
//!   inp`) into the T gradient with beta 1, and `db += Σ_rows dout`: `col_sum_partials_<S>`
//!   (`kernels/convert.cu`, rows in chunks of [`partial_rows`]) into the scratch's partials,
//!   then `norm_reduce_partials_<S>` (`kernels/norm.cu`) adds each column's partials in
//!   order to db, rounded once (deterministic, no atomics).

use super::super::gemm::{Gemm, Operand, Ty, int};
use super::super::gpu::GpuDevice;
use super::super::launch::{BLOCK, grid_stride, launch_error};
use super::super::sizing::{REDUCE_BLOCKS, linear_tile};
use crate::backend::StepCtx;
use crate::dtype::DType;
use crate::ir::schedule::{Op, OpEntry, WeightLayout};
use anyhow::{Result, bail};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ops::Range;

/// How a GEMM reads part `part_len` of W's cut dimension (logically `[IC, OC]`: OC in the
/// forward, IC in the backward's Wᵀ) from the weight tile: (whether the stored weight's rows
/// are the cut dimension, the operand's leading dimension, stored transposed).
pub fn operand_layout(
    layout: WeightLayout,
    (ic, oc): (usize, usize),
    part_len: usize,
    backward: bool,
) -> (bool, usize, bool) {
    let (_, cols) = stored_shape(layout, ic, oc);
    match (layout == WeightLayout::OutIn) != backward {
        true => (true, cols, true),
        false => (false, part_len, false),
    }
}

/// W's stored shape `[rows, cols]`.
pub fn stored_shape(layout: WeightLayout, ic: usize, oc: usize) -> (usize, usize) {
    match layout {
        WeightLayout::InOut => (ic, oc),
        WeightLayout::OutIn => (oc, ic),
    }
}

/// `0..len` cut into consecutive ranges of `chunk` (the last may be shorter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunks {
    len: usize,
    chunk: usize,
}

impl Chunks {
    /// How many ranges.
    pub fn count(&self) -> usize {
        self.len.div_ceil(self.chunk)
    }

    /// The ranges, in order (nothing allocated: this runs for every linear op of a step).
    pub fn ranges(self) -> impl Iterator<Item = Range<usize>> {
        let Chunks { len, chunk } = self;
        (0..len)
            .step_by(chunk)
            .map(move |s| s..(s + chunk).min(len))
    }
}

/// Rows per partial sum of the bias gradient over `n` rows: at least 64, and few enough
/// chunks (at most [`REDUCE_BLOCKS`]) for the scratch's partials. A function of `n` alone,
/// so the sums are the same on every run.
pub fn partial_rows(n: usize) -> usize {
    n.div_ceil(REDUCE_BLOCKS as usize).max(64)
}

impl GpuDevice {
    /// Runs `e`, an op of the linear family.
    pub(in crate::backend::cuda) fn run_linear(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        let t = self.storage_ty();
        match &e.op {
            Op::Matmul {
                inp,
                out,
                residual,
                w,
                b,
                layout,
                rows,
                ic,
                oc,
            } => {
                let (n, ic, oc) = (rows.with_seq(ctx.seq).n(), *ic, *oc);
                if n == 0 || oc == 0 {
                    return Ok(());
                }
                let (inp, out) = (self.ptr(*inp)?, self.ptr(*out)?);
                let residual = residual.map(|r| self.ptr(r)).transpose()?;
                let bias = b.as_ref().map(|b| self.param_ptr(e, b)).transpose()?;
                let chunks = self.linear_chunks(e, ic, oc, false);
                for cols in chunks.ranges() {
                    // out[:, cols] = (residual[:, cols] +) inp @ W[:, cols].
                    let (wp, wt, ldw, trans) =
                        self.linear_operand(e, w, *layout, (ic, oc), &cols, false)?;
                    let at = (cols.start * t.bytes() as usize) as u64;
                    let mut g = Gemm::new(
                        n,
                        cols.len(),
                        ic,
                        Operand::new(inp, t, ic),
                        Operand {
                            ptr: wp,
                            ty: wt,
                            ld: ldw,
                            trans,
                        },
                        Operand::new(out + at, t, oc),
                    );
                    if let Some(r) = residual {
                        g = g.plus(r + at);
                    }
                    // One chunk: the bias by the epilogue; several: added once after.
                    self.gemm(e, &g.bias(bias.filter(|_| chunks.count() == 1)))?;
                }
                match bias {
                    Some(bias) if chunks.count() > 1 => self.add_bias(e, out, t, bias, (n, oc, oc)),
                    _ => Ok(()),
                }
            }
            Op::AddBias { out, b, rows, oc } => {
                let n = rows.with_seq(ctx.seq).n();
                if n == 0 || *oc == 0 {
                    return Ok(());
                }
                let bias = self.param_ptr(e, b)?;
                self.add_bias(e, self.ptr(*out)?, t, bias, (n, *oc, *oc))
            }
            Op::MatmulBackward {
                dinp,
                dout,
                inp,
                w,
                b,
                layout,
                rows,
                ic,
                oc,
            } => {
                let (n, ic, oc) = (rows.with_seq(ctx.seq).n(), *ic, *oc);
                if n == 0 || ic == 0 || oc == 0 {
                    return Ok(());
                }
                let (dinp, dout, inp) = (self.ptr(*dinp)?, self.ptr(*dout)?, self.ptr(*inp)?);
                for rows in self.linear_chunks(e, ic, oc, true).ranges() {
                    // dinp[:, rows] = dout[N, OC] @ W[rows, :]ᵀ.
                    let (wp, wt, ldw, trans) =
                        self.linear_operand(e, w, *layout, (ic, oc), &rows, true)?;
                    let at = (rows.start * t.bytes() as usize) as u64;
                    self.gemm(
                        e,
                        &Gemm::new(
                            n,
                            rows.len(),
                            oc,
                            Operand::new(dout, t, oc),
                            Operand {
                                ptr: wp,
                                ty: wt,
                                ld: ldw,
                                trans,
                            },
                            Operand::new(dinp + at, t, ic),
                        ),
                    )?;
                }
                let quantized = matches!(self.param_dtype(e), Some(DType::Ggml(_)));
                if e.frozen || quantized {
                    return Ok(());
                }
                let dw = self.grad_ptr(e, w)?;
                let g = match layout {
                    // dW[IC, OC] += inpᵀ @ dout.
                    WeightLayout::InOut => Gemm::new(
                        ic,
                        oc,
                        n,
                        Operand::new(inp, t, ic).t(),
                        Operand::new(dout, t, oc),
                        Operand::new(dw, t, oc),
                    ),
                    // dW[OC, IC] += doutᵀ @ inp.
                    WeightLayout::OutIn => Gemm::new(
                        oc,
                        ic,
                        n,
                        Operand::new(dout, t, oc).t(),
                        Operand::new(inp, t, ic),
                        Operand::new(dw, t, ic),
                    ),
                };
                self.gemm(e, &g.accumulate())?;
                if let Some(b) = b {
                    let db = self.grad_ptr(e, b)?;
                    self.bias_grad(e, db, dout, n, oc)?;
                }
                Ok(())
            }
            _ => bail!("internal error: {} is not a linear op", e.name),
        }
    }

    /// The chunks a linear op's GEMMs cut the weight (logically `[IC, OC]`) into: of its OC
    /// output columns in the forward, of its IC input rows in the backward
    /// ([`linear_tile`]); one, the whole, where the GEMM reads the weight in place.
    fn linear_chunks(&self, e: &OpEntry, ic: usize, oc: usize, backward: bool) -> Chunks {
        let len = if backward { ic } else { oc };
        let chunk = match self.weight_in_place(e) {
            true => len,
            false => linear_tile(ic, oc, self.storage_ty().bytes(), backward).0,
        };
        Chunks {
            len,
            chunk: chunk.max(1),
        }
    }

    /// The part `part` of the cut dimension of W (logically `[IC, OC]`) as a GEMM's right
    /// operand: in the forward W's columns `part` (`[IC, part]`), in the backward Wᵀ's
    /// (`[OC, part]`, `part` of the IC rows). Returns (address, type, leading dimension,
    /// stored transposed), at the weight tile's start. Where the stored weight's rows are the
    /// cut dimension (`[OC, IC]` forward, `[IC, OC]` backward) they are read transposed,
    /// `ld` its row; else its columns `part` are read as they are (`ld` = their count).
    #[allow(clippy::too_many_arguments)]
    fn linear_operand(
        &self,
        e: &OpEntry,
        w: &Range<usize>,
        layout: WeightLayout,
        (ic, oc): (usize, usize),
        part: &Range<usize>,
        backward: bool,
    ) -> Result<(u64, Ty, usize, bool)> {
        if matches!(self.param_dtype(e), Some(DType::Ggml(_))) && layout != WeightLayout::OutIn {
            bail!("internal error: {}: a quantized base is [out, in]", e.name);
        }
        let (rows, cols) = stored_shape(layout, ic, oc);
        let (cut_rows, ld, trans) = operand_layout(layout, (ic, oc), part.len(), backward);
        let (p, ty) = match cut_rows {
            true => self.weight_rows(e, w, (rows, cols), part.clone(), 0)?,
            false => self.weight_block(e, w, (rows, cols), (0..rows, part.clone()), 0)?,
        };
        Ok((p, ty, ld, trans))
    }

    /// `db[OC] += Σ_rows dout[N, OC]` (T): per-chunk f32 column sums into the scratch's
    /// partials, then each column's partials added in order and rounded once.
    fn bias_grad(&self, e: &OpEntry, db: u64, dout: u64, n: usize, oc: usize) -> Result<()> {
        let r = partial_rows(n);
        let p = n.div_ceil(r);
        let (partials, bytes) = self.scratch().partials;
        if partials == 0 || (p * oc * 4) as u64 > bytes {
            bail!(
                "internal error: {}: the reduction partials hold {bytes} bytes, {} needed",
                e.name,
                p * oc * 4
            );
        }
        let (n_i, oc_i, r_i, p_i) = (int(e, n)?, int(e, oc)?, int(e, r)?, int(e, p)?);
        let name = format!("col_sum_partials_{}", self.storage_ty().suffix());
        let f = self.plain_kernel(&name)?;
        let cfg = LaunchConfig {
            grid_dim: (oc.div_ceil(BLOCK as usize) as u32, p.min(65535) as u32, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `col_sum_partials_<S>(float* partials, const T* x, int N, int C, int R)`:
        // the partials hold P·OC f32 (checked), dout N·OC T.
        unsafe {
            self.launch(f)
                .arg(&partials)
                .arg(&dout)
                .arg(&n_i)
                .arg(&oc_i)
                .arg(&r_i)
                .launch(cfg)
        }
        .map_err(|err| launch_error(e, &name, err))?;
        let name = format!("norm_reduce_partials_{}", self.storage_ty().suffix());
        let f = self.plain_kernel(&name)?;
        // SAFETY: `norm_reduce_partials_<S>(T* grad, const float* partials, int P, int C)`:
        // db holds OC T.
        unsafe {
            self.launch(f)
                .arg(&db)
                .arg(&partials)
                .arg(&p_i)
                .arg(&oc_i)
                .launch(grid_stride(oc as u64))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, &name, err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// W (logically `[IC, OC]`) as a GEMM's right operand `[IC, OC]`: its leading dimension and
    /// whether it is stored transposed (the CPU's `Layout::as_b`).
    fn w_as_b(layout: WeightLayout, ic: usize, oc: usize) -> (usize, bool) {
        match layout {
            WeightLayout::InOut => (oc, false),
            WeightLayout::OutIn => (ic, true),
        }
    }

    /// Wᵀ as a GEMM's right operand `[OC, IC]` (the CPU's `Layout::transposed_as_b`).
    fn wt_as_b(layout: WeightLayout, ic: usize, oc: usize) -> (usize, bool) {
        match layout {
            WeightLayout::InOut => (oc, true),
            WeightLayout::OutIn => (ic, false),
        }
    }

    #[test]
    fn weight_operands_follow_the_cpu_layouts() {
        // Conv1D [IC, OC]: W as is; Wᵀ read transposed.
        assert_eq!(w_as_b(WeightLayout::InOut, 3, 5), (5, false));
        assert_eq!(wt_as_b(WeightLayout::InOut, 3, 5), (5, true));
        assert_eq!(stored_shape(WeightLayout::InOut, 3, 5), (3, 5));
        // nn.Linear [OC, IC]: W read transposed; Wᵀ as is.
        assert_eq!(w_as_b(WeightLayout::OutIn, 3, 5), (3, true));
        assert_eq!(wt_as_b(WeightLayout::OutIn, 3, 5), (3, false));
        assert_eq!(stored_shape(WeightLayout::OutIn, 3, 5), (5, 3));
        // The whole weight read through the tile is the same operand; a part of the cut
        // dimension keeps the row (transposed reads) or is its own row (a column block).
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            let (_, ld, trans) = operand_layout(layout, (3, 5), 5, false);
            assert_eq!((ld, trans), w_as_b(layout, 3, 5), "{layout:?}");
            let (_, ld, trans) = operand_layout(layout, (3, 5), 3, true);
            assert_eq!((ld, trans), wt_as_b(layout, 3, 5), "{layout:?}");
        }
        assert_eq!(
            operand_layout(WeightLayout::OutIn, (3, 5), 2, false),
            (true, 3, true)
        );
        assert_eq!(
            operand_layout(WeightLayout::OutIn, (3, 5), 2, true),
            (false, 2, false)
        );
        assert_eq!(
            operand_layout(WeightLayout::InOut, (3, 5), 2, false),
            (false, 2, false)
        );
        assert_eq!(
            operand_layout(WeightLayout::InOut, (3, 5), 2, true),
            (true, 5, true)
        );
    }

    #[test]
    fn chunks_cover_the_range_in_order() {
        let ranges = |len, chunk| Chunks { len, chunk }.ranges().collect::<Vec<_>>();
        assert_eq!(ranges(28672, 16384), [0..16384, 16384..28672]);
        assert_eq!(ranges(8448, 7936), [0..7936, 7936..8448]);
        assert_eq!(ranges(3072, 3072), vec![0..3072usize]);
        assert_eq!(
            Chunks {
                len: 8448,
                chunk: 7936
            }
            .count(),
            2
        );
        assert_eq!(
            Chunks {
                len: 3072,
                chunk: 3072
            }
            .count(),
            1
        );
    }

    #[test]
    fn bias_partials_fit_the_scratch() {
        for n in [1, 63, 64, 65, 1000, 16384, 16385, 1 << 20, 3_000_001] {
            let r = partial_rows(n);
            assert!(r >= 64);
            assert!(n.div_ceil(r) <= REDUCE_BLOCKS as usize, "{n}");
        }
        assert_eq!(partial_rows(1000), 64);
    }
}
