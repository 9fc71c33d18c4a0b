//! The adapter family on the GPU, as the CPU's `ops/adapter.rs` and `lora.rs`: a LoRA
//! adapter's four thin GEMMs on cuBLASLt ([`super::super::gemm`]) around the elementwise
//! kernels of `kernels/lora.cu`, with the step's dropout mask (the CPU's, bit for bit:
//! [`mask`]).
//!
//! `a` `[r, IC]` and `b` `[OC, r]` are the adapters' f32 (master) weights; inp, out, h and the
//! gradients are the storage type T; `dh` and the dropout workspace `ws` `[N, IC]` are f32.
//! cuBLASLt multiplies operands of one type (f32 × f32 → f32; T × T → T or f32), so in a
//! bf16/f16 plan an f32 operand beside a T one is rounded to T first (`f32_to_storage_<S>`,
//! into the weight tile: `sizing::lora_tile`), and an f32 × f32 product that belongs in a T
//! buffer goes to f32 scratch and is added in with one rounding. In an fp32 plan every GEMM
//! reads and writes the buffers in place.
//!
//! `LoraForward`:
//! 1. with dropout (training): `lora_dropout_<S>` xd = mask ⊙ inp / (1 − p) into `ws`; GEMM
//!    `[N, r] = xd @ aᵀ` (f32, the f32 a in place) into h (fp32) or the tile (bf16/f16, then
//!    `lora_narrow_scale_<S>`: h = T(T(acc)·scale), the CPU's rounding then scaling).
//!    Without: GEMM `h = inp @ aᵀ` (a as T in the tile), stored as T.
//! 2. `lora_scale_<S>` h ·= scale (not after `lora_narrow_scale`, which scaled).
//! 3. GEMM `out[:, col..col + OC] += h @ bᵀ` (b as T; D = C = out + col, ld = ldo, beta 1).
//!
//! `LoraBackward` (dy = dout + col, rows ldo apart):
//! 1. GEMM `db[OC, r] += dyᵀ @ h` (T, beta 1).
//! 2. GEMM `dh[N, r] (f32) = dy @ b` (b as T), then `lora_scale_f32` dh ·= scale.
//! 3. with dropout: `lora_dropout_<S>` xd again (the same mask) into `ws`; GEMM `da += dhᵀ @
//!    xd` (f32 × f32: into da in an fp32 plan; else into the tile and `lora_add_cols_<S>`
//!    adds it into da, one rounding); GEMM `ws = dh @ a` (f32, the f32 a in place, over xd);
//!    `lora_add_masked_<S>` dinp += mask ⊙ ws / (1 − p).
//!    Without dropout: in a bf16/f16 plan dh rounded to T into the tile (`f32_to_storage_<S>`;
//!    the CPU's AVX512_BF16 path rounds it the same way); GEMM `da += dhᵀ @ inp`; GEMM `dinp
//!    += dh @ a` (a as T), both beta 1.

use super::super::gemm::{Gemm, Operand, Ty, int};
use super::super::gpu::GpuDevice;
use super::super::launch::{grid_stride, launch_error};
use super::super::sizing::lora_tile;
use crate::backend::StepCtx;
use crate::ir::schedule::{LoraDropout, Op, OpEntry, Rows};
use anyhow::{Result, bail};
use cudarc::driver::PushKernelArg;

/// An adapter's dropout mask as the kernels take it (`kernels/lora.cu`'s header): the CPU's
/// `lora::Dropout`, whose hash the kernels compute per element.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mask {
    pub key: u64,
    pub below: u64,
    pub keep_scale: f32,
    pub first: u64,
}

/// The mask of probability `p` for the step's `seed`, the adapter `salt` and a call whose
/// first element is element `first` of the whole batch: the CPU's own (`lora::Dropout`).
pub fn mask(p: f32, seed: u64, salt: u64, first: u64) -> Mask {
    let (key, below, keep_scale, first) =
        crate::backend::cpu::lora::Dropout::new(p, seed, salt, first).parts();
    Mask {
        key,
        below,
        keep_scale,
        first,
    }
}

/// An adapter's mask for this step and its workspace, in a training step (none otherwise:
/// evaluation and generation use the whole input). The op's rows are `(ctx.first_micro +
/// micro)·N..` of the step's batch (N the plan's rows), whose elements the mask is drawn by.
/// A tensor rank's columns of a cut input (`LoraDropout::cols`) are refused: the GPU runs no
/// tensor ranks, and its kernels hash whole rows.
pub fn step_mask(
    d: &Option<LoraDropout>,
    rows: Rows,
    ic: usize,
    ctx: &StepCtx,
) -> Result<Option<Mask>> {
    let Some(d) = d.as_ref().filter(|_| ctx.training) else {
        return Ok(None);
    };
    if d.is_cut(ic) {
        bail!(
            "--lora-dropout on a tensor rank's part of a layer's input (--tp): the CUDA device \
             runs no tensor ranks; use --tp 1 or --device cpu"
        );
    }
    let first = ((ctx.first_micro + d.micro) * rows.n() * ic) as u64;
    Ok(Some(mask(d.p, ctx.dropout_seed, d.adapter as u64, first)))
}

impl GpuDevice {
    /// Runs `e`, an op of the adapter family.
    pub(in crate::backend::cuda) fn run_adapter(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        let t = self.storage_ty();
        let es = t.bytes();
        let mixed = t != Ty::F32;
        match &e.op {
            Op::LoraForward {
                inp,
                out,
                h,
                a,
                b,
                rows,
                ic,
                oc,
                r,
                col,
                ldo,
                scale,
                dropout,
            } => {
                let (n, ic, oc, r) = (rows.with_seq(ctx.seq).n(), *ic, *oc, *r);
                if n == 0 || r == 0 {
                    return Ok(());
                }
                let (at, _) = lora_tile(rows.n(), ic, oc, r);
                let (inp, h) = (self.ptr(*inp)?, self.ptr(*h)?);
                let nr = (n * r) as u64;
                match (step_mask(dropout, *rows, ic, ctx)?, dropout) {
                    (Some(m), Some(d)) => {
                        // h = scale · (mask ⊙ inp / (1 − p)) @ aᵀ.
                        let ws = self.ptr(d.ws)?;
                        self.dropout(e, "lora_dropout", inp, ws, (n * ic) as u64, &m)?;
                        let acc = if mixed { self.tile(e, 0, nr * 4)? } else { h };
                        self.gemm(
                            e,
                            &Gemm::new(
                                n,
                                r,
                                ic,
                                Operand::new(ws, Ty::F32, ic),
                                Operand::new(self.param_ptr(e, a)?, Ty::F32, ic).t(),
                                Operand::new(acc, Ty::F32, r),
                            ),
                        )?;
                        if mixed {
                            self.narrow_scale(e, acc, h, nr, *scale)?;
                        } else {
                            self.scale(e, &format!("lora_scale_{}", t.suffix()), h, nr, *scale)?;
                        }
                    }
                    _ => {
                        // h = scale · inp @ aᵀ.
                        let (ap, aty) = self.weight(e, a, (r, ic), at)?;
                        self.gemm(
                            e,
                            &Gemm::new(
                                n,
                                r,
                                ic,
                                Operand::new(inp, t, ic),
                                Operand::new(ap, aty, ic).t(),
                                Operand::new(h, t, r),
                            ),
                        )?;
                        self.scale(e, &format!("lora_scale_{}", t.suffix()), h, nr, *scale)?;
                    }
                }
                // out[:, col..col + OC] += h[N, r] @ bᵀ.
                let (bp, bty) = self.weight(e, b, (oc, r), at)?;
                let out = self.ptr(*out)? + *col as u64 * es;
                self.gemm(
                    e,
                    &Gemm::new(
                        n,
                        oc,
                        r,
                        Operand::new(h, t, r),
                        Operand::new(bp, bty, r).t(),
                        Operand::new(out, t, *ldo),
                    )
                    .accumulate(),
                )
            }
            Op::LoraBackward {
                dinp,
                dout,
                inp,
                h,
                dh,
                a,
                b,
                rows,
                ic,
                oc,
                r,
                col,
                ldo,
                scale,
                dropout,
            } => {
                let (n, ic, oc, r) = (rows.with_seq(ctx.seq).n(), *ic, *oc, *r);
                if n == 0 || r == 0 {
                    return Ok(());
                }
                let (at, _) = lora_tile(rows.n(), ic, oc, r);
                let (da, db) = (self.grad_ptr(e, a)?, self.grad_ptr(e, b)?);
                let (dinp, inp, h, dh) = (
                    self.ptr(*dinp)?,
                    self.ptr(*inp)?,
                    self.ptr(*h)?,
                    self.ptr(*dh)?,
                );
                let dy = self.ptr(*dout)? + *col as u64 * es;
                let nr = (n * r) as u64;
                // db[OC, r] += dyᵀ[OC, N] @ h[N, r].
                self.gemm(
                    e,
                    &Gemm::new(
                        oc,
                        r,
                        n,
                        Operand::new(dy, t, *ldo).t(),
                        Operand::new(h, t, r),
                        Operand::new(db, t, r),
                    )
                    .accumulate(),
                )?;
                // dh[N, r] = scale · dy[N, OC] @ b[OC, r] (f32).
                let (bp, bty) = self.weight(e, b, (oc, r), at)?;
                self.gemm(
                    e,
                    &Gemm::new(
                        n,
                        r,
                        oc,
                        Operand::new(dy, t, *ldo),
                        Operand::new(bp, bty, r),
                        Operand::new(dh, Ty::F32, r),
                    ),
                )?;
                self.scale(e, "lora_scale_f32", dh, nr, *scale)?;
                match (step_mask(dropout, *rows, ic, ctx)?, dropout) {
                    (Some(m), Some(d)) => {
                        let ws = self.ptr(d.ws)?;
                        let nic = (n * ic) as u64;
                        self.dropout(e, "lora_dropout", inp, ws, nic, &m)?;
                        // da[r, IC] += dhᵀ[r, N] @ xd[N, IC] (f32 × f32).
                        let acc = if mixed {
                            self.tile(e, at, (r * ic) as u64 * 4)?
                        } else {
                            da
                        };
                        let g = Gemm::new(
                            r,
                            ic,
                            n,
                            Operand::new(dh, Ty::F32, r).t(),
                            Operand::new(ws, Ty::F32, ic),
                            Operand::new(acc, Ty::F32, ic),
                        );
                        if mixed {
                            self.gemm(e, &g)?;
                            self.add_cols(e, da, acc, (r, ic))?;
                        } else {
                            self.gemm(e, &g.accumulate())?;
                        }
                        // ws[N, IC] = dh[N, r] @ a[r, IC] (f32, over xd), then dinp += mask ⊙
                        // ws / (1 − p).
                        self.gemm(
                            e,
                            &Gemm::new(
                                n,
                                ic,
                                r,
                                Operand::new(dh, Ty::F32, r),
                                Operand::new(self.param_ptr(e, a)?, Ty::F32, ic),
                                Operand::new(ws, Ty::F32, ic),
                            ),
                        )?;
                        self.dropout(e, "lora_add_masked", dinp, ws, nic, &m)
                    }
                    _ => {
                        // dh as the GEMMs' T operand (in place in an fp32 plan).
                        let (dhp, dht) = if mixed {
                            let copy = self.tile(e, 0, nr * es)?;
                            self.narrow(e, dh, copy, nr)?;
                            (copy, t)
                        } else {
                            (dh, Ty::F32)
                        };
                        // da[r, IC] += dhᵀ[r, N] @ inp[N, IC].
                        self.gemm(
                            e,
                            &Gemm::new(
                                r,
                                ic,
                                n,
                                Operand::new(dhp, dht, r).t(),
                                Operand::new(inp, t, ic),
                                Operand::new(da, t, ic),
                            )
                            .accumulate(),
                        )?;
                        // dinp[N, IC] += dh[N, r] @ a[r, IC].
                        let (ap, aty) = self.weight(e, a, (r, ic), at)?;
                        self.gemm(
                            e,
                            &Gemm::new(
                                n,
                                ic,
                                r,
                                Operand::new(dhp, dht, r),
                                Operand::new(ap, aty, ic),
                                Operand::new(dinp, t, ic),
                            )
                            .accumulate(),
                        )
                    }
                }
            }
            _ => bail!("internal error: {} is not an adapter op", e.name),
        }
    }

    /// `lora_dropout_<S>(x, xd, n, key, below, keep_scale, first)` or
    /// `lora_add_masked_<S>(dx, t, n, ...)`: the first pointer T, the second f32, `n` each.
    fn dropout(&self, e: &OpEntry, stem: &str, x: u64, y: u64, n: u64, m: &Mask) -> Result<()> {
        let name = format!("{stem}_{}", self.storage_ty().suffix());
        let f = self.plain_kernel(&name)?;
        let count = n as i64;
        // SAFETY: both kernels take (T*, float*, long long n, u64 key, u64 below, float
        // keep_scale, u64 first); both buffers hold n elements.
        unsafe {
            self.launch(f)
                .arg(&x)
                .arg(&y)
                .arg(&count)
                .arg(&m.key)
                .arg(&m.below)
                .arg(&m.keep_scale)
                .arg(&m.first)
                .launch(grid_stride(n))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, &name, err))
    }

    /// `x[i] ·= scale` in place over `n` (`lora_scale_<S>` named in full: `lora_scale_f32`
    /// for the f32 dh).
    fn scale(&self, e: &OpEntry, name: &str, x: u64, n: u64, scale: f32) -> Result<()> {
        let f = self.plain_kernel(name)?;
        let count = n as i64;
        // SAFETY: `lora_scale_<S>(T* x, long long n, float scale)`, x holding n.
        unsafe {
            self.launch(f)
                .arg(&x)
                .arg(&count)
                .arg(&scale)
                .launch(grid_stride(n))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, name, err))
    }

    /// `h = T(T(acc) · scale)` over `n` (`lora_narrow_scale_<S>`).
    fn narrow_scale(&self, e: &OpEntry, acc: u64, h: u64, n: u64, scale: f32) -> Result<()> {
        let name = format!("lora_narrow_scale_{}", self.storage_ty().suffix());
        let f = self.plain_kernel(&name)?;
        let count = n as i64;
        // SAFETY: `lora_narrow_scale_<S>(const float* acc, T* h, long long n, float scale)`.
        unsafe {
            self.launch(f)
                .arg(&acc)
                .arg(&h)
                .arg(&count)
                .arg(&scale)
                .launch(grid_stride(n))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, &name, err))
    }

    /// `dst[rows, cols] (T) += src[rows, cols] (f32)`, both contiguous (`lora_add_cols_<S>`).
    fn add_cols(
        &self,
        e: &OpEntry,
        dst: u64,
        src: u64,
        (rows, cols): (usize, usize),
    ) -> Result<()> {
        let name = format!("lora_add_cols_{}", self.storage_ty().suffix());
        let f = self.plain_kernel(&name)?;
        let (rows_i, cols_i) = (int(e, rows)?, int(e, cols)?);
        // SAFETY: `lora_add_cols_<S>(T* dst, int ld_dst, const float* src, int ld_src, int
        // rows, int cols)`: both rows·cols, ld = cols.
        unsafe {
            self.launch(f)
                .arg(&dst)
                .arg(&cols_i)
                .arg(&src)
                .arg(&cols_i)
                .arg(&rows_i)
                .arg(&cols_i)
                .launch(grid_stride((rows * cols) as u64))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, &name, err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::lora::Dropout;

    /// The mask is the CPU's: the same fields, the kept elements scaled by 1 / (1 − p).
    #[test]
    fn masks_are_the_cpus_bit_for_bit() {
        for &(p, seed, salt, first) in &[
            (0.1f32, 0u64, 0u64, 0u64),
            (0.05, 12345, 3, 4096),
            (0.5, u64::MAX, 17, 1 << 40),
            (0.9, 0xDEAD_BEEF, 1, 77),
        ] {
            let cpu = Dropout::new(p, seed, salt, first);
            let gpu = mask(p, seed, salt, first);
            assert_eq!((gpu.key, gpu.below, gpu.keep_scale, gpu.first), cpu.parts());
            assert_eq!(gpu.keep_scale, 1.0 / (1.0 - p));
            assert_eq!(gpu.first, first);
        }
    }

    #[test]
    fn masks_are_drawn_in_training_only_at_the_rows_place_in_the_batch() {
        let rows = Rows { b: 2, t: 3 };
        let d = Some(LoraDropout {
            p: 0.25,
            adapter: 4,
            micro: 1,
            ws: crate::ir::BufId(0),
            cols: (5, 0),
        });
        let mut ctx = StepCtx {
            seq: None,
            training: true,
            loss_scale: 1.0,
            update: None,
            dropout_seed: 9,
            first_micro: 2,
            loss_tokens: 1,
        };
        let m = step_mask(&d, rows, 5, &ctx).unwrap().unwrap();
        assert_eq!(m.first, 3 * 6 * 5);
        assert_eq!(m, mask(0.25, 9, 4, 90));
        ctx.training = false;
        assert!(step_mask(&d, rows, 5, &ctx).unwrap().is_none());
        assert!(
            step_mask(&None, rows, 5, &{
                StepCtx {
                    training: true,
                    ..ctx
                }
            })
            .unwrap()
            .is_none()
        );
    }
}
