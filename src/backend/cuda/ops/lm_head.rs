//! The LM head family on the GPU, as the CPU's `ops/lm_head.rs`: [`Op::LmHeadLoss`] chunked
//! over rows (`rows_per_chunk`, so only `logits [rows, V]` f32 exists at a time) and
//! generation's [`Op::LmHeadLast`], GEMMs on cuBLASLt ([`super::super::gemm`]) around
//! `xent_fused` (`kernels/xent.cu`).
//!
//! `LmHeadLoss`: the head's weight `[V, C]` as the GEMMs read it, once per op (the f32 master
//! in place in an fp32 plan; its storage-type copy, or a quantized head decoded, at the start
//! of the weight tile). Then per chunk of r rows:
//! 1. GEMM `logits[r, V] (f32) = x[r, C] @ Wᵀ` (T × T → f32; f32 × f32 in fp32 plans);
//! 2. `xent_fused` (grid r, block 1024): each row's loss and, when training with `dinp`, the
//!    logits overwritten in place by `d(loss·scale)/dlogits`, `scale = loss_scale /
//!    max(loss_tokens, 1)` computed in f32 as the CPU does;
//! 3. when training: the f32 dlogits are T × T GEMMs' operand in a bf16/f16 plan, so they are
//!    first rounded to T (`f32_to_storage_<S>`) into the weight tile after the weight
//!    (`sizing::lm_head_tile`; the CPU's AVX512_BF16 path rounds them the same way as it
//!    packs them; in an fp32 plan the GEMMs read the f32 logits in place). GEMM `dinp[r, C] =
//!    dlogits @ W` (overwritten), and unless the head is frozen (or quantized) GEMM
//!    `dW[V, C] += dlogitsᵀ @ x` (beta 1, into the T gradient).
//!
//! `LmHeadLast`: one GEMM, `logits[1, V] (f32) = x[N−1, :] @ Wᵀ`, N the generated prefix's.

use super::super::gemm::{Gemm, Operand, Ty, int};
use super::super::gpu::GpuDevice;
use super::super::launch::launch_error;
use super::super::sizing::lm_head_tile;
use crate::backend::StepCtx;
use crate::dtype::DType;
use crate::ir::schedule::{Op, OpEntry};
use anyhow::{Result, bail};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Threads of an `xent_fused` block (any multiple of 32 up to 1024 gives the same bits).
const XENT_THREADS: u32 = 1024;

/// The chunks `(start, rows)` of `n` rows, `per` rows at a time (the CPU's loop).
pub fn chunks(n: usize, per: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = per.max(1);
    (0..n).step_by(per).map(move |s| (s, per.min(n - s)))
}

impl GpuDevice {
    /// Runs `e`, an op of the LM head family.
    pub(in crate::backend::cuda) fn run_lm_head(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        let t = self.storage_ty();
        let es = t.bytes();
        match &e.op {
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
            } => {
                let (n, c, v) = (rows.with_seq(ctx.seq).n(), *c, *v);
                if n == 0 {
                    return Ok(());
                }
                let train = match dinp {
                    Some(d) if ctx.training => Some(self.ptr(*d)?),
                    _ => None,
                };
                let mixed = t != Ty::F32;
                let (dl_at, _) = lm_head_tile(
                    c,
                    v,
                    *rows_per_chunk,
                    self.storage,
                    mixed && train.is_some(),
                );
                let (wp, wt) = self.weight(e, w, (v, c), 0)?;
                let dl_copy = match train {
                    Some(_) if mixed => {
                        Some(self.tile(e, dl_at, (*rows_per_chunk * v) as u64 * es)?)
                    }
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
                for (start, r) in chunks(n, *rows_per_chunk) {
                    let xr = x + (start * c) as u64 * es;
                    // logits[r, V] = xr[r, C] @ Wᵀ.
                    self.gemm(
                        e,
                        &Gemm::new(
                            r,
                            v,
                            c,
                            Operand::new(xr, t, c),
                            Operand::new(wp, wt, c).t(),
                            Operand::new(lg, Ty::F32, v),
                        ),
                    )?;
                    self.xent(
                        e,
                        lg,
                        tg + start as u64 * 4,
                        ls + start as u64 * 4,
                        (r, v),
                        scale,
                        train.is_some(),
                    )?;
                    let Some(dx) = train else { continue };
                    let (dl, dlt) = match dl_copy {
                        Some(copy) => {
                            self.narrow(e, lg, copy, (r * v) as u64)?;
                            (copy, t)
                        }
                        None => (lg, Ty::F32),
                    };
                    // dx[r, C] = dlogits[r, V] @ W[V, C].
                    self.gemm(
                        e,
                        &Gemm::new(
                            r,
                            c,
                            v,
                            Operand::new(dl, dlt, v),
                            Operand::new(wp, wt, c),
                            Operand::new(dx + (start * c) as u64 * es, t, c),
                        ),
                    )?;
                    // dW[V, C] += dlogitsᵀ[V, r] @ xr[r, C] (a frozen head takes no gradient).
                    if let Some(dw) = dw {
                        self.gemm(
                            e,
                            &Gemm::new(
                                v,
                                c,
                                r,
                                Operand::new(dl, dlt, v).t(),
                                Operand::new(xr, t, c),
                                Operand::new(dw, t, c),
                            )
                            .accumulate(),
                        )?;
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
                let (wp, wt) = self.weight(e, w, (v, c), 0)?;
                let x = self.ptr(*inp)? + ((n - 1) * c) as u64 * es;
                // logits[1, V] = x[1, C] @ Wᵀ.
                self.gemm(
                    e,
                    &Gemm::new(
                        1,
                        v,
                        c,
                        Operand::new(x, t, c),
                        Operand::new(wp, wt, c).t(),
                        Operand::new(self.ptr(*logits)?, Ty::F32, v),
                    ),
                )
            }
            _ => bail!("internal error: {} is not an LM head op", e.name),
        }
    }

    /// `xent_fused` over one chunk of `rows` logits rows of `v`: losses, and with `grad` the
    /// gradient in place.
    #[allow(clippy::too_many_arguments)]
    fn xent(
        &self,
        e: &OpEntry,
        logits: u64,
        targets: u64,
        losses: u64,
        (rows, v): (usize, usize),
        scale: f32,
        grad: bool,
    ) -> Result<()> {
        let f = self.plain_kernel("xent_fused")?;
        let (rows_i, v_i, grad_i) = (int(e, rows)?, int(e, v)?, grad as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (XENT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `xent_fused(float* logits, const unsigned* targets, float* losses, int rows,
        // int V, float scale, int grad)`: logits hold rows·V f32, targets and losses rows each
        // (pointers offset to the chunk's first row).
        unsafe {
            self.launch(f)
                .arg(&logits)
                .arg(&targets)
                .arg(&losses)
                .arg(&rows_i)
                .arg(&v_i)
                .arg(&scale)
                .arg(&grad_i)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, "xent_fused", err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_rows_as_the_cpu_loop() {
        let got: Vec<_> = chunks(10, 4).collect();
        assert_eq!(got, [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(chunks(3, 8).collect::<Vec<_>>(), [(0, 3)]);
        assert_eq!(chunks(0, 8).count(), 0);
    }
}
