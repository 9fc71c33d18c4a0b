//! The norm family on the GPU (`kernels/norm.cu`): layer norm, RMS norm and Qwen3's q/k norm,
//! forward and backward, as the CPU's `ops/norm.rs`.
//!
//! - [`Op::LayerNorm`]: `layernorm_forward_<S>`, one warp per row ([`rows_of_warps`]).
//! - [`Op::RmsNorm`]: `rmsnorm_forward_<S>`, likewise, with the gain's offset (`offset + w`)
//!   and the residual added to the output (its address, or 0 for none).
//! - [`Op::LayerNormBackward`]: `layernorm_backward_input_<S>` (dinp +=, one warp per row),
//!   then, unless the op is frozen, `layernorm_backward_partials_<S>` into the scratch's
//!   `partials` (`[2, P, C]` f32, rows in chunks of [`NORM_CHUNK_ROWS`]) and
//!   `norm_reduce_partials_<S>` twice: into dw from `partials`, into db from `partials + P·C`.
//! - [`Op::RmsNormBackward`]: `rmsnorm_backward_input_<S>` (the gain's offset), then, unless
//!   frozen, `rmsnorm_backward_partials_<S>` (`[P, C]`) and `norm_reduce_partials_<S>` into dw
//!   (the weight's gradient takes no offset).
//! - [`Op::QkNorm`]: `qk_norm_forward_<S>`, one warp per (row, head), with the offset.
//! - [`Op::QkNormBackward`]: unless frozen, first `qk_norm_backward_partials_<S>` (`[P, 2·hd]`,
//!   read from the output's gradient before it is overwritten) and `norm_reduce_partials_<S>`
//!   into dw; then `qk_norm_backward_input_<S>` in place (with the offset), one warp per (row,
//!   q/k head).
//!
//! N is the op's rows at the step's sequence length (`rows.with_seq(ctx.seq)`: generation's
//! shorter prefix); nothing runs when N or C is 0 (the CPU then changes nothing).

use super::super::gpu::GpuDevice;
use super::super::launch::{BLOCK, grid_stride, int, launch_kernel, rows_of_warps};
use super::super::sizing::{NORM_CHUNK_ROWS, norm_chunks};
use crate::backend::StepCtx;
use crate::ir::schedule::{Op, OpEntry};
use anyhow::{Result, bail};
use cudarc::driver::LaunchConfig;

/// Warps per block of the one-warp-per-row kernels (blocks of 256 threads).
pub(super) const ROW_WARPS: u32 = 8;

impl GpuDevice {
    /// Runs `e`, an op of the norm family.
    pub(in crate::backend::cuda) fn run_norm(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        match &e.op {
            Op::LayerNorm {
                inp,
                out,
                mean,
                rstd,
                w,
                b,
                rows,
                c,
                eps,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                if n == 0 || c == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("layernorm_forward")?;
                let (out, mean, rstd, inp) = (
                    self.ptr(*out)?,
                    self.ptr(*mean)?,
                    self.ptr(*rstd)?,
                    self.ptr(*inp)?,
                );
                let (w, b) = (self.f32_param_ptr(e, w)?, self.f32_param_ptr(e, b)?);
                let (ni, ci, eps) = (int(e, "N", n)?, int(e, "C", c)?, *eps);
                // SAFETY: layernorm_forward_<S>(T* out, float* mean, float* rstd, const T* inp,
                // const float* w, const float* b, int N, int C, float eps): out, inp [N, C] of
                // T, mean, rstd [N] f32, w, b [C] f32 (the ranges' first elements).
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    row_warps(n),
                    [&out, &mean, &rstd, &inp, &w, &b, &ni, &ci, &eps]
                )
            }
            Op::RmsNorm {
                inp,
                out,
                residual,
                rstd,
                w,
                offset,
                rows,
                c,
                eps,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                if n == 0 || c == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("rmsnorm_forward")?;
                let (out, rstd, inp) = (self.ptr(*out)?, self.ptr(*rstd)?, self.ptr(*inp)?);
                let residual = self.ptr_or_null(*residual)?;
                let w = self.f32_param_ptr(e, w)?;
                let (ni, ci, eps, offset) = (int(e, "N", n)?, int(e, "C", c)?, *eps, *offset);
                // SAFETY: rmsnorm_forward_<S>(T* out, float* rstd, const T* inp, const T*
                // residual, const float* w, float offset, int N, int C, float eps): out, inp
                // [N, C] T, residual [N, C] T or 0 (a buffer apart from out: the plan's never
                // overlap), rstd [N] f32, w [C] f32 (the range's first element).
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    row_warps(n),
                    [&out, &rstd, &inp, &residual, &w, &offset, &ni, &ci, &eps]
                )
            }
            Op::LayerNormBackward {
                dinp,
                dout,
                inp,
                mean,
                rstd,
                w,
                b,
                rows,
                c,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                if n == 0 || c == 0 {
                    return Ok(());
                }
                let (ni, ci) = (int(e, "N", n)?, int(e, "C", c)?);
                let (dinp, dout, inp, mean, rstd) = (
                    self.ptr(*dinp)?,
                    self.ptr(*dout)?,
                    self.ptr(*inp)?,
                    self.ptr(*mean)?,
                    self.ptr(*rstd)?,
                );
                let wp = self.f32_param_ptr(e, w)?;
                let (name, f) = self.entry("layernorm_backward_input")?;
                // SAFETY: layernorm_backward_input_<S>(T* dinp, const T* dout, const T* inp,
                // const float* w, const float* mean, const float* rstd, int N, int C): dinp,
                // dout, inp [N, C] T (dinp +=), w [C] f32, mean, rstd [N] f32.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    row_warps(n),
                    [&dinp, &dout, &inp, &wp, &mean, &rstd, &ni, &ci]
                )?;
                if e.frozen {
                    return Ok(());
                }
                let chunks = NormChunks::of(n, c, 2);
                let partials = self.partials(e, chunks.bytes)?;
                let (pi, ri) = (int(e, "P", chunks.p)?, NORM_CHUNK_ROWS as i32);
                let (name, f) = self.entry("layernorm_backward_partials")?;
                // SAFETY: layernorm_backward_partials_<S>(float* partials, const T* dout,
                // const T* inp, const float* mean, const float* rstd, int N, int C, int R):
                // partials f32 [2, P, C] (the region holds `chunks.bytes`), the rest as above.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    chunks.partials_grid(),
                    [&partials, &dout, &inp, &mean, &rstd, &ni, &ci, &ri]
                )?;
                let (dw, db) = (self.grad_ptr(e, w)?, self.grad_ptr(e, b)?);
                let db_partials = partials + chunks.second_offset();
                self.reduce_partials(e, dw, partials, pi, ci, c)?;
                self.reduce_partials(e, db, db_partials, pi, ci, c)
            }
            Op::RmsNormBackward {
                dinp,
                dout,
                inp,
                rstd,
                w,
                offset,
                rows,
                c,
            } => {
                let (n, c) = (rows.with_seq(ctx.seq).n(), *c);
                if n == 0 || c == 0 {
                    return Ok(());
                }
                let (ni, ci) = (int(e, "N", n)?, int(e, "C", c)?);
                let (dinp, dout, inp, rstd) = (
                    self.ptr(*dinp)?,
                    self.ptr(*dout)?,
                    self.ptr(*inp)?,
                    self.ptr(*rstd)?,
                );
                let (wp, offset) = (self.f32_param_ptr(e, w)?, *offset);
                let (name, f) = self.entry("rmsnorm_backward_input")?;
                // SAFETY: rmsnorm_backward_input_<S>(T* dinp, const T* dout, const T* inp,
                // const float* w, float offset, const float* rstd, int N, int C): dinp, dout,
                // inp [N, C] T (dinp +=), w [C] f32, rstd [N] f32.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    row_warps(n),
                    [&dinp, &dout, &inp, &wp, &offset, &rstd, &ni, &ci]
                )?;
                if e.frozen {
                    return Ok(());
                }
                let chunks = NormChunks::of(n, c, 1);
                let partials = self.partials(e, chunks.bytes)?;
                let (pi, ri) = (int(e, "P", chunks.p)?, NORM_CHUNK_ROWS as i32);
                let (name, f) = self.entry("rmsnorm_backward_partials")?;
                // SAFETY: rmsnorm_backward_partials_<S>(float* partials, const T* dout, const
                // T* inp, const float* rstd, int N, int C, int R): partials f32 [P, C] (the
                // region holds `chunks.bytes`), the rest as above.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    chunks.partials_grid(),
                    [&partials, &dout, &inp, &rstd, &ni, &ci, &ri]
                )?;
                let dw = self.grad_ptr(e, w)?;
                self.reduce_partials(e, dw, partials, pi, ci, c)
            }
            Op::QkNorm {
                inp,
                out,
                rstd,
                w,
                offset,
                rows,
                nh,
                nkv,
                hd,
                eps,
            } => {
                let n = rows.with_seq(ctx.seq).n();
                if n == 0 || *hd == 0 {
                    return Ok(());
                }
                let (name, f) = self.entry("qk_norm_forward")?;
                let (out, rstd, inp) = (self.ptr(*out)?, self.ptr(*rstd)?, self.ptr(*inp)?);
                let w = self.f32_param_ptr(e, w)?;
                let (ni, nhi, nkvi, hdi) = (
                    int(e, "N", n)?,
                    int(e, "NH", *nh)?,
                    int(e, "NKV", *nkv)?,
                    int(e, "HD", *hd)?,
                );
                let (eps, offset) = (*eps, *offset);
                // SAFETY: qk_norm_forward_<S>(T* out, float* rstd, const T* inp, const float* w,
                // float offset, int N, int NH, int NKV, int HD, float eps): out, inp
                // [N, (NH + 2·NKV)·HD] T, rstd [N, NH + NKV] f32, w [2, HD] f32 (the range's
                // first element).
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    row_warps(n * (nh + 2 * nkv)),
                    [&out, &rstd, &inp, &w, &offset, &ni, &nhi, &nkvi, &hdi, &eps]
                )
            }
            Op::QkNormBackward {
                d,
                inp,
                rstd,
                w,
                offset,
                rows,
                nh,
                nkv,
                hd,
            } => {
                let n = rows.with_seq(ctx.seq).n();
                if n == 0 || *hd == 0 {
                    return Ok(());
                }
                let (d, inp, rstd) = (self.ptr(*d)?, self.ptr(*inp)?, self.ptr(*rstd)?);
                let (ni, nhi, nkvi, hdi) = (
                    int(e, "N", n)?,
                    int(e, "NH", *nh)?,
                    int(e, "NKV", *nkv)?,
                    int(e, "HD", *hd)?,
                );
                if !e.frozen {
                    // The weight gradient first: it reads d before the input gradient
                    // overwrites it.
                    let chunks = NormChunks::of(n, 2 * hd, 1);
                    let partials = self.partials(e, chunks.bytes)?;
                    let (pi, ri) = (int(e, "P", chunks.p)?, NORM_CHUNK_ROWS as i32);
                    let ci = int(e, "C", 2 * hd)?;
                    let (name, f) = self.entry("qk_norm_backward_partials")?;
                    // SAFETY: qk_norm_backward_partials_<S>(float* partials, const T* d,
                    // const T* inp, const float* rstd, int N, int NH, int NKV, int HD, int R):
                    // partials f32 [P, 2·HD] (the region holds `chunks.bytes`), d, inp
                    // [N, QKV] T, rstd [N, NH + NKV] f32.
                    launch_kernel!(
                        self,
                        e,
                        name,
                        f,
                        chunks.partials_grid(),
                        [&partials, &d, &inp, &rstd, &ni, &nhi, &nkvi, &hdi, &ri]
                    )?;
                    let dw = self.grad_ptr(e, w)?;
                    self.reduce_partials(e, dw, partials, pi, ci, 2 * hd)?;
                }
                let (wp, offset) = (self.f32_param_ptr(e, w)?, *offset);
                let (name, f) = self.entry("qk_norm_backward_input")?;
                // SAFETY: qk_norm_backward_input_<S>(T* d, const T* inp, const float* w,
                // float offset, const float* rstd, int N, int NH, int NKV, int HD): d (in
                // place), inp [N, QKV] T, w [2, HD] f32, rstd [N, NH + NKV] f32.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    row_warps(n * (nh + nkv)),
                    [&d, &inp, &wp, &offset, &rstd, &ni, &nhi, &nkvi, &hdi]
                )
            }
            _ => bail!("internal error: {} is not a norm op", e.name),
        }
    }

    /// The scratch's `partials` region, checked to hold `bytes` (its sizing,
    /// `Scratch::for_ops`, is the op's largest shape).
    fn partials(&self, e: &OpEntry, bytes: u64) -> Result<u64> {
        let (ptr, have) = self.scratch().partials;
        if ptr == 0 || have < bytes {
            bail!(
                "internal error: {}: the backend's scratch has {have} bytes of reduction \
                 partials, the op needs {bytes}",
                e.name
            );
        }
        Ok(ptr)
    }

    /// `grad[c] += Σ_p partials[p, c]` (norm_reduce_partials_<S>) over `c` columns.
    fn reduce_partials(
        &self,
        e: &OpEntry,
        grad: u64,
        partials: u64,
        p: i32,
        ci: i32,
        c: usize,
    ) -> Result<()> {
        let (name, f) = self.entry("norm_reduce_partials")?;
        // SAFETY: norm_reduce_partials_<S>(T* grad, const float* partials, int P, int C): grad
        // T [C] +=, partials f32 [P, C].
        launch_kernel!(
            self,
            e,
            name,
            f,
            grid_stride(c as u64),
            [&grad, &partials, &p, &ci]
        )
    }
}

/// One warp per row over `n` rows, [`ROW_WARPS`] warps a block.
fn row_warps(n: usize) -> LaunchConfig {
    rows_of_warps(n as u64, ROW_WARPS)
}

/// The chunking of a norm's parameter gradients over N rows and C columns: P chunks of
/// [`NORM_CHUNK_ROWS`] rows, each one f32 partial row of C per parameter vector (`vectors`:
/// 2 for a layer norm's w and b, 1 for an RMS norm's w).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct NormChunks {
    p: usize,
    c: usize,
    /// Bytes of the partials: vectors × P × C f32.
    bytes: u64,
}

impl NormChunks {
    fn of(n: usize, c: usize, vectors: u64) -> NormChunks {
        let p = norm_chunks(n as u64) as usize;
        NormChunks {
            p,
            c,
            bytes: vectors * p as u64 * c as u64 * 4,
        }
    }

    /// Byte offset of the second vector's partials (a layer norm's db: `partials + P·C`).
    fn second_offset(&self) -> u64 {
        self.p as u64 * self.c as u64 * 4
    }

    /// The `*_backward_partials` launch: blocks of 256 columns, (ceil(C / 256),
    /// min(P, 65535)) (both ways grid-strided by the kernel).
    fn partials_grid(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                (self.c as u64).div_ceil(BLOCK as u64).clamp(1, 65535) as u32,
                (self.p as u64).clamp(1, 65535) as u32,
                1,
            ),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_chunks_follow_the_shape_alone() {
        // GPT-2 small: B·T = 4·1024 rows of 768.
        let k = NormChunks::of(4096, 768, 2);
        assert_eq!(k.p, 64);
        assert_eq!(k.bytes, 2 * 64 * 768 * 4);
        assert_eq!(k.second_offset(), 64 * 768 * 4);
        let g = k.partials_grid();
        assert_eq!(g.grid_dim, (3, 64, 1));
        assert_eq!(g.block_dim, (256, 1, 1));
        // A partial last chunk, and one row.
        assert_eq!(NormChunks::of(65, 10, 1).p, 2);
        assert_eq!(NormChunks::of(1, 10, 1).p, 1);
        assert_eq!(NormChunks::of(1, 10, 1).bytes, 40);
        // More chunks than a grid's y: the kernel strides.
        let big = NormChunks::of(64 * 70000, 4096, 1);
        assert_eq!(big.p, 70000);
        assert_eq!(big.partials_grid().grid_dim, (16, 65535, 1));
    }

    #[test]
    fn rows_are_one_warp_each() {
        let g = row_warps(1000);
        assert_eq!(g.block_dim.0, 32 * ROW_WARPS);
        assert_eq!(g.grid_dim.0, 125);
        assert_eq!(row_warps(1).grid_dim.0, 1);
    }
}
