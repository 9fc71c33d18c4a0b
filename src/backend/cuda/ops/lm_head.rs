//! The LM head family on the GPU, as the CPU's `ops/lm_head.rs`: [`Op::LmHeadLoss`] chunked
//! over rows (`rows_per_chunk`, so only `logits [rows, V]` f32 exists at a time) and
//! generation's [`Op::LmHeadLast`], GEMMs on cuBLASLt ([`super::super::gemm`]) around
//! `xent_fused` (`kernels/xent.cu`).
//!
//! The head's weight `[V, C]` as the GEMMs read it: the f32 master in place in an fp32 plan;
//! else its storage-type copy, or a quantized head decoded, in the weight tile, a chunk of
//! vocabulary rows at a time (`sizing::lm_head_tile`: [`sizing::lm_head_vocab_rows`] rows,
//! at most `sizing::WEIGHT_CHUNK_BYTES`), so the tile never holds the whole of a large
//! vocabulary's head ([`HeadWeight`]). A chunk is decoded only when the tile holds another:
//! a head of one chunk once per op; of K chunks 2K − 1 times per row chunk (the forward
//! walks the chunks up, the backward down from the one the forward left). The logits are
//! still whole rows `[r, V]`: each chunk's GEMM writes its column block, so the softmax and
//! the loss see the full vocabulary, as on the CPU, and `xent_fused` is unchanged.
//!
//! `LmHeadLoss`, per chunk of r rows:
//! 1. per vocabulary chunk `[v0, v0 + vr)`: GEMM `logits[r, v0..v0 + vr] (f32) = x[r, C] @
//!    W[v0..v0 + vr]ᵀ` (T × T → f32; f32 × f32 in fp32 plans; ld V);
//! 2. `xent_fused` (grid r, block 1024) over the whole rows: each row's loss and, when
//!    training with `dinp`, the logits overwritten in place by `d(loss·scale)/dlogits`, `scale
//!    = loss_scale / max(loss_tokens, 1)` computed in f32 as the CPU does;
//! 3. when training: the f32 dlogits are T × T GEMMs' operand in a bf16/f16 plan, so they are
//!    first rounded to T (`f32_to_storage_<S>`, the whole chunk at once) into the weight tile
//!    after the weight chunk (the CPU's AVX512_BF16 path rounds them the same way as it packs
//!    them; in an fp32 plan the GEMMs read the f32 logits in place). Then per vocabulary
//!    chunk, last first: GEMM `dinp[r, C] (+)= dlogits[:, v0..v0 + vr] @ W[v0..v0 + vr]`
//!    (the first overwrites, the others add with beta 1), and unless the head is frozen (or
//!    quantized) GEMM `dW[v0..v0 + vr, C] += dlogits[:, v0..v0 + vr]ᵀ @ x` (beta 1, into the
//!    T gradient; each element's sum is over the r rows, as with one chunk). With several
//!    vocabulary chunks in a bf16/f16 plan, `dinp`'s sum is kept in f32 in the tile (after
//!    the dlogits copy) and rounded to T once at the end, so `dinp` is rounded once per
//!    element as with one GEMM; in an fp32 plan the chunks add into `dinp` itself.
//!    The chunks, and so the order of `dinp`'s sums, depend on the shape alone: the results
//!    are deterministic (cuBLASLt's GEMMs use no atomics).
//!
//! `LmHeadLast`: per vocabulary chunk, GEMM `logits[1, v0..v0 + vr] (f32) = x[N−1, :] @
//! W[v0..v0 + vr]ᵀ`, N the generated prefix's.
//!
//! [`sizing::lm_head_vocab_rows`]: super::super::sizing::lm_head_vocab_rows

use super::super::gemm::{Gemm, Operand, Ty, int};
use super::super::gpu::GpuDevice;
use super::super::launch::launch_error;
use super::super::sizing::lm_head_tile;
use crate::backend::StepCtx;
use crate::dtype::DType;
use crate::ir::schedule::{Op, OpEntry};
use anyhow::{Result, bail};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ops::Range;

/// Threads of an `xent_fused` block (any multiple of 32 up to 1024 gives the same bits).
const XENT_THREADS: u32 = 1024;

/// The chunks `(start, rows)` of `n` rows, `per` rows at a time (the CPU's loop).
pub fn chunks(n: usize, per: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = per.max(1);
    (0..n).step_by(per).map(move |s| (s, per.min(n - s)))
}

/// The LM head's weight `[V, C]` as its GEMMs read it, a chunk of vocabulary rows at a time:
/// the whole in place (an f32 master in an fp32 plan: one chunk, nothing decoded), else
/// `vocab_rows` rows at a time converted or decoded at the start of the weight tile. It
/// remembers which chunk the tile holds, so a chunk is decoded only when the tile holds
/// another (within one op: other ops overwrite the tile).
struct HeadWeight<'a> {
    dev: &'a GpuDevice,
    e: &'a OpEntry,
    w: &'a Range<usize>,
    /// `(V, C)`.
    shape: (usize, usize),
    /// The vocabulary chunks `(first row, rows)`, in order.
    chunks: Vec<(usize, usize)>,
    /// The chunk the tile holds (its first row), its address and element type.
    held: Option<(usize, u64, Ty)>,
}

impl<'a> HeadWeight<'a> {
    fn new(
        dev: &'a GpuDevice,
        e: &'a OpEntry,
        w: &'a Range<usize>,
        (v, c): (usize, usize),
        vocab_rows: usize,
    ) -> HeadWeight<'a> {
        let per = if dev.weight_in_place(e) {
            v
        } else {
            vocab_rows
        };
        HeadWeight {
            dev,
            e,
            w,
            shape: (v, c),
            chunks: chunks(v, per).collect(),
            held: None,
        }
    }

    /// Rows `[v0, v0 + rows)` (a chunk of [`HeadWeight::chunks`]), `[rows, C]` from the
    /// returned address.
    fn rows(&mut self, (v0, rows): (usize, usize)) -> Result<(u64, Ty)> {
        match self.held {
            Some((at, p, ty)) if at == v0 => Ok((p, ty)),
            _ => {
                let (p, ty) = self
                    .dev
                    .weight_rows(self.e, self.w, self.shape, v0..v0 + rows, 0)?;
                self.held = Some((v0, p, ty));
                Ok((p, ty))
            }
        }
    }
}

impl GpuDevice {
    /// Runs `e`, an op of the LM head family.
    pub(in crate::backend::cuda) fn run_lm_head(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        let t = self.storage_ty();
        let es = t.bytes();
        match &e.op {
            Op::LmHeadStats { .. } | Op::LmHeadLoss { vocab: Some(_), .. } => bail!(
                "internal error: {}: a part of the vocabulary (tensor parallelism), which the \
                 CUDA backend does not run (one process, no collectives)",
                e.name
            ),
            Op::LmHeadLoss {
                teacher: Some(_), ..
            } => bail!(
                "{}: distillation (train --distill-from) runs on the CPU only for now; use \
                 --device cpu",
                e.name
            ),
            Op::LmHeadLoss {
                row_stats: Some(_), ..
            }
            | Op::LmHeadWeightGrad { .. } => bail!(
                "{}: --update in-backward runs on the CPU only for now; use --update end with \
                 --device cuda",
                e.name
            ),
            Op::LmHeadLoss {
                inp,
                targets,
                losses,
                logits,
                dinp,
                w,
                rows,
                c,
                v,
                rows_per_chunk,
                vocab: None,
                teacher: None,
                row_stats: None,
            } => {
                let (n, c, v, per) = (rows.with_seq(ctx.seq).n(), *c, *v, *rows_per_chunk);
                if n == 0 {
                    return Ok(());
                }
                let train = match dinp {
                    Some(d) if ctx.training => Some(self.ptr(*d)?),
                    _ => None,
                };
                let mixed = t != Ty::F32;
                let tile = lm_head_tile(c, v, per, self.storage, mixed && train.is_some());
                let mut head = HeadWeight::new(self, e, w, (v, c), tile.vocab_rows);
                let vocab = head.chunks.clone();
                let dl_copy = match (train, tile.dlogits) {
                    (Some(_), Some(at)) => Some(self.tile(e, at, (per * v) as u64 * es)?),
                    _ => None,
                };
                // dinp's f32 sum over several vocabulary chunks (bf16/f16 plans).
                let dinp_sum = match (train, tile.dinp_sum) {
                    (Some(_), Some(at)) if vocab.len() > 1 => {
                        Some(self.tile(e, at, (per * c) as u64 * 4)?)
                    }
                    (Some(_), None) if vocab.len() > 1 && mixed => bail!(
                        "internal error: {}: no f32 sum of dinp in the weight tile",
                        e.name
                    ),
                    _ => None,
                };
                let quantized = matches!(self.param_dtype(e), Some(DType::Ggml(_)));
                let dw = match train {
                    Some(_) if !e.frozen && !quantized => Some(self.grad_ptr(e, w)?),
                    _ => None,
                };
                let (x, tg, ls, lg) = (
                    self.ptr(*inp)?,
                    self.ptr(*targets)?,
                    self.ptr(*losses)?,
                    self.ptr(*logits)?,
                );
                // d(loss·loss_scale)/dlogits: the mean over the step's trained targets.
                let scale = ctx.loss_scale / ctx.loss_tokens.max(1) as f32;
                // The logits buffer's rows padded to `ld` (fewer rows a chunk), so every GEMM
                // operand row is aligned.
                let (per, ld) = padded_rows(per, v);
                for (start, r) in chunks(n, per) {
                    let xr = x + (start * c) as u64 * es;
                    // logits[r, v0..v0 + vr] = xr[r, C] @ W[v0..v0 + vr]ᵀ, chunk by chunk.
                    for &(v0, vr) in &vocab {
                        let (wp, wt) = head.rows((v0, vr))?;
                        self.gemm(
                            e,
                            &Gemm::new(
                                r,
                                vr,
                                c,
                                Operand::new(xr, t, c),
                                Operand::new(wp, wt, c).t(),
                                Operand::new(lg + v0 as u64 * 4, Ty::F32, ld),
                            ),
                        )?;
                    }
                    self.xent(
                        e,
                        lg,
                        tg + start as u64 * 4,
                        ls + start as u64 * 4,
                        (r, v, ld),
                        scale,
                        train.is_some(),
                    )?;
                    let Some(dx) = train else { continue };
                    let (dl, dlt) = match dl_copy {
                        Some(copy) => {
                            self.narrow(e, lg, copy, (r * ld) as u64)?;
                            (copy, t)
                        }
                        None => (lg, Ty::F32),
                    };
                    let dxr = dx + (start * c) as u64 * es;
                    let (sum, sum_ty) = match dinp_sum {
                        Some(p) => (p, Ty::F32),
                        None => (dxr, t),
                    };
                    // Last chunk first: the tile still holds it from the forward.
                    for (i, &(v0, vr)) in vocab.iter().enumerate().rev() {
                        let (wp, wt) = head.rows((v0, vr))?;
                        let dlk = dl + v0 as u64 * dlt.bytes();
                        // dx[r, C] (+)= dlogits[r, v0..v0 + vr] @ W[v0..v0 + vr, C].
                        let g = Gemm::new(
                            r,
                            c,
                            vr,
                            Operand::new(dlk, dlt, ld),
                            Operand::new(wp, wt, c),
                            Operand::new(sum, sum_ty, c),
                        );
                        let first = i + 1 == vocab.len();
                        self.gemm(e, &if first { g } else { g.accumulate() })?;
                        // dW[v0..v0 + vr, C] += dlogitsᵀ[vr, r] @ xr[r, C] (a frozen head
                        // takes no gradient).
                        if let Some(dw) = dw {
                            self.gemm(
                                e,
                                &Gemm::new(
                                    vr,
                                    c,
                                    r,
                                    Operand::new(dlk, dlt, ld).t(),
                                    Operand::new(xr, t, c),
                                    Operand::new(dw + (v0 * c) as u64 * es, t, c),
                                )
                                .accumulate(),
                            )?;
                        }
                    }
                    if dinp_sum.is_some() {
                        // dinp rounded to T once.
                        self.narrow(e, sum, dxr, (r * c) as u64)?;
                    }
                }
                Ok(())
            }
            Op::LmHeadLast {
                inp,
                logits,
                w,
                rows,
                c,
                v,
            } => {
                let (n, c, v) = (rows.with_seq(ctx.seq).n(), *c, *v);
                if n == 0 {
                    bail!("internal error: {}: no row to take the logits of", e.name);
                }
                let tile = lm_head_tile(c, v, 1, self.storage, false);
                let mut head = HeadWeight::new(self, e, w, (v, c), tile.vocab_rows);
                let x = self.ptr(*inp)? + ((n - 1) * c) as u64 * es;
                let lg = self.ptr(*logits)?;
                for (v0, vr) in head.chunks.clone() {
                    let (wp, wt) = head.rows((v0, vr))?;
                    // logits[1, v0..v0 + vr] = x[1, C] @ W[v0..v0 + vr]ᵀ.
                    self.gemm(
                        e,
                        &Gemm::new(
                            1,
                            vr,
                            c,
                            Operand::new(x, t, c),
                            Operand::new(wp, wt, c).t(),
                            Operand::new(lg + v0 as u64 * 4, Ty::F32, v),
                        ),
                    )?;
                }
                Ok(())
            }
            _ => bail!("internal error: {} is not an LM head op", e.name),
        }
    }

    /// `xent_fused` over one chunk of `rows` logits rows of `v` values, `ld` floats apart:
    /// losses, and with `grad` the gradient in place.
    #[allow(clippy::too_many_arguments)]
    fn xent(
        &self,
        e: &OpEntry,
        logits: u64,
        targets: u64,
        losses: u64,
        (rows, v, ld): (usize, usize, usize),
        scale: f32,
        grad: bool,
    ) -> Result<()> {
        let f = self.plain_kernel("xent_fused")?;
        let (rows_i, v_i, ld_i, grad_i) = (int(e, rows)?, int(e, v)?, int(e, ld)?, grad as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (XENT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `xent_fused(float* logits, const unsigned* targets, float* losses, int rows,
        // int V, int ld, float scale, int grad)`: logits hold rows·ld f32 (ld >= V), targets
        // and losses rows each (pointers offset to the chunk's first row).
        unsafe {
            self.launch(f)
                .arg(&logits)
                .arg(&targets)
                .arg(&losses)
                .arg(&rows_i)
                .arg(&v_i)
                .arg(&ld_i)
                .arg(&scale)
                .arg(&grad_i)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, "xent_fused", err))
    }
}

/// Floats a logits row is padded to: 256 bytes, so each row of the f32 logits and of their
/// storage-type copy starts where cuBLASLt's fastest algorithms read (GPT-2's 50257 unpadded
/// put every other row 4 bytes off: the head ran at 68 TFLOP/s on an H200, its linear layers'
/// GEMMs at 160–540, and padding took it from 56 to 31 ms a step).
const LOGITS_LD_QUANTUM: usize = 64;

/// Rows of a chunk and their stride (floats) in a logits buffer planned for `per` rows of
/// `v`: rows padded to [`LOGITS_LD_QUANTUM`] when one padded row fits, as many as fit; else
/// `per` rows of `v` (a one-row buffer: generation, or a tiny plan).
fn padded_rows(per: usize, v: usize) -> (usize, usize) {
    let ld = v.next_multiple_of(LOGITS_LD_QUANTUM);
    match per * v / ld {
        0 => (per, v),
        rows => (rows, ld),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Padded rows stay within the planned buffer, at least one a chunk.
    #[test]
    fn padded_logits_rows_fit_the_planned_buffer() {
        for (per, v) in [
            (333, 50257),
            (1, 50257),
            (4, 13),
            (1, 13),
            (7, 64),
            (128, 128256),
        ] {
            let (rows, ld) = padded_rows(per, v);
            assert!(rows >= 1 && rows <= per && ld >= v, "{per} x {v}");
            assert!(rows * ld <= per * v, "{per} x {v}");
            assert!(ld == v || ld % LOGITS_LD_QUANTUM == 0, "{per} x {v}");
        }
        assert_eq!(padded_rows(333, 50257), (332, 50304));
        assert_eq!(padded_rows(1, 50257), (1, 50257));
    }

    #[test]
    fn chunks_cover_the_rows_as_the_cpu_loop() {
        let got: Vec<_> = chunks(10, 4).collect();
        assert_eq!(got, [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(3, 8).collect::<Vec<_>>(), [(0, 3)]);
        assert_eq!(chunks(0, 8).count(), 0);
    }

    /// The vocabulary chunks the head walks cover V in order, as many as the tile was sized
    /// for, each within the tile's weight part (before the dlogits copy), each column block
    /// of the logits and of their bf16 copy 512-byte aligned.
    #[test]
    fn vocabulary_chunks_cover_the_head_within_the_tile() {
        for (c, v, per) in [
            (4096, 128256, 128),
            (768, 50257, 333),
            (8, 13, 4),
            (576, 49152, 7),
        ] {
            let tile = lm_head_tile(c, v, per, DType::Bf16, true);
            let vocab: Vec<_> = chunks(v, tile.vocab_rows).collect();
            assert_eq!(vocab.len(), tile.chunks, "V {v}");
            let mut next = 0;
            for &(v0, vr) in &vocab {
                assert_eq!(v0, next);
                next += vr;
                assert!((vr * c * 2) as u64 <= tile.dlogits.unwrap());
                if vocab.len() > 1 {
                    assert_eq!(v0 * 2 % 512, 0);
                }
            }
            assert_eq!(next, v);
            assert_eq!(tile.dinp_sum.is_some(), vocab.len() > 1, "V {v}");
        }
    }
}
