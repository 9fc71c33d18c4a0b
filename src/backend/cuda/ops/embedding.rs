//! The embedding family on the GPU (`kernels/embedding.cu`, and `kernels/dequant.cu` for a
//! quantized table), as the CPU's `ops/embedding.rs`:
//!
//! - [`Op::Encoder`], f32 tables: `encoder_forward_<S>(out, tokens, positions or 0, wte, wpe
//!   or 0, N, T, C, V, scale)`, grid-stride over the N·C outputs. A table bound to a quantized
//!   base (ggml blocks: a LoRA plan's `--base-quant`, no `wpe`): as the CPU decodes each row as
//!   it gathers it, `dequant_gather_<type>_<S>(wte, C, tokens, N, V, scale, out)`
//!   (`kernels/dequant.cu`; the decoded values times the scale rounded to T once, as the CPU's
//!   `T::from_f32(x * scale)`).
//! - [`Op::EncoderBackward`] (nothing when frozen): for dwte, keyed by the tokens,
//!   `encoder_link_rows(link, keys, N, T)`, `encoder_mark_rows(link, N)`,
//!   `encoder_backward_accumulate_<S>(dwte, dout, keys, link, N, T, C, V, scale)`; then with
//!   `wpe` the same three keyed by the positions (or row % T: keys 0), into dwpe with T table
//!   rows and scale 1. `link` is the scratch's u32 `[2·N]` region ([`Scratch::link`]).
//!
//! `scale` is the op's (Gemma's √C, 1 elsewhere): it multiplies the token rows, never the
//! positions.
//!
//! N and T are the op's rows at the step's sequence length (`rows.with_seq(ctx.seq)`);
//! nothing runs when N or C is 0.
//!
//! [`Scratch::link`]: super::super::sizing::Scratch::link

use super::super::gpu::GpuDevice;
use super::super::launch::{BLOCK, grid_stride};
use super::super::launch::{int, launch_kernel};
use crate::backend::StepCtx;
use crate::dtype::{DType, GgmlType};
use crate::ir::BufId;
use crate::ir::schedule::{Op, OpEntry};
use anyhow::{Result, bail};
use cudarc::driver::LaunchConfig;

impl GpuDevice {
    /// Runs `e`, an op of the embedding family.
    pub(in crate::backend::cuda) fn run_embedding(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        match &e.op {
            Op::Encoder { first_token, .. } | Op::EncoderBackward { first_token, .. }
                if *first_token != 0 =>
            {
                bail!(
                    "internal error: {}: a part of the vocabulary (tensor parallelism), which \
                     the CUDA backend does not run (one process, no collectives)",
                    e.name
                )
            }
            Op::Encoder {
                tokens,
                positions,
                out,
                wte,
                wpe,
                rows,
                c,
                scale,
                ..
            } => {
                let (r, c) = (rows.with_seq(ctx.seq), *c);
                let n = r.n();
                if n == 0 || c == 0 {
                    return Ok(());
                }
                let v = wte.len() / c;
                match self.param_dtype(e) {
                    Some(DType::F32) => {}
                    Some(DType::Ggml(ty)) => {
                        if wpe.is_some() {
                            bail!("internal error: {}: a quantized base with wpe", e.name);
                        }
                        let (tokens, out) = (*tokens, *out);
                        return self.gather_quantized(e, ty, tokens, out, wte, (n, c), *scale);
                    }
                    Some(d) => bail!(
                        "internal error: {}: its table is bound to {d} values, not f32 or \
                         ggml blocks",
                        e.name
                    ),
                    None => bail!("internal error: {} has no parameter binding", e.name),
                }
                let (name, f) = self.entry("encoder_forward")?;
                let (out, tokens) = (self.ptr(*out)?, self.ptr(*tokens)?);
                let positions = self.ptr_or_null(*positions)?;
                let wte = self.param_ptr(e, wte)?;
                let wpe = match wpe {
                    Some(r) => self.param_ptr(e, r)?,
                    None => 0,
                };
                let (ni, ti, ci, vi) = (
                    int(e, "N", n)?,
                    int(e, "T", r.t)?,
                    int(e, "C", c)?,
                    int(e, "V", v)?,
                );
                let scale = *scale;
                // SAFETY: encoder_forward_<S>(T* out, const unsigned* tokens, const unsigned*
                // positions, const float* wte, const float* wpe, int N, int T, int C, int V,
                // float scale): out [N, C] T, tokens (positions) [N] u32 or 0, wte [V, C] f32,
                // wpe [maxT, C] f32 or 0 (the ranges' first elements).
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    grid_stride((n * c) as u64),
                    [
                        &out, &tokens, &positions, &wte, &wpe, &ni, &ti, &ci, &vi, &scale
                    ]
                )
            }
            Op::EncoderBackward {
                dout,
                tokens,
                positions,
                wte,
                wpe,
                rows,
                c,
                scale,
                ..
            } => {
                if e.frozen {
                    return Ok(());
                }
                let (r, c) = (rows.with_seq(ctx.seq), *c);
                let n = r.n();
                if n == 0 || c == 0 {
                    return Ok(());
                }
                let link = self.link(e, n)?;
                let dout = self.ptr(*dout)?;
                let dwte = self.grad_ptr(e, wte)?;
                let s = Scatter {
                    n: int(e, "N", n)?,
                    t: int(e, "T", r.t)?,
                    c: int(e, "C", c)?,
                    link,
                    dout,
                };
                let tokens = self.ptr(*tokens)?;
                self.scatter(e, &s, tokens, dwte, int(e, "V", wte.len() / c)?, *scale)?;
                let Some(wpe) = wpe else {
                    return Ok(());
                };
                if wpe.len() < r.t * c {
                    bail!(
                        "internal error: {}: wpe has {} rows, fewer than T = {}",
                        e.name,
                        wpe.len() / c,
                        r.t
                    );
                }
                let dwpe = self.grad_ptr(e, wpe)?;
                let positions = self.ptr_or_null(*positions)?;
                // The positions take dout unscaled.
                self.scatter(e, &s, positions, dwpe, s.t, 1.0)
            }
            _ => bail!("internal error: {} is not an embedding op", e.name),
        }
    }

    /// The scratch's `link` region, checked to hold u32 `[2·n]`.
    fn link(&self, e: &OpEntry, n: usize) -> Result<u64> {
        let need = 2 * n as u64 * 4;
        let s = self.scratch_layout;
        match self.scratch {
            Some((base, _)) if s.link >= need => Ok(base + s.link_offset()),
            _ => bail!(
                "internal error: {}: the backend's scratch has {} bytes of row links, the op \
                 needs {need}",
                e.name,
                s.link
            ),
        }
    }

    /// Steps 1-3 (or 4-6) of the backward: `dtable[key(r)] += scale · dout[r]` for every row,
    /// keyed by `keys` (u32 `[N]`, or 0: row % T), over a table of `table_rows` rows.
    fn scatter(
        &self,
        e: &OpEntry,
        s: &Scatter,
        keys: u64,
        dtable: u64,
        table_rows: i32,
        scale: f32,
    ) -> Result<()> {
        let (link, dout) = (s.link, s.dout);
        let (n, t, c) = (s.n, s.t, s.c);
        let f = self.plain_kernel("encoder_link_rows")?;
        // SAFETY: encoder_link_rows(unsigned* link, const unsigned* keys, int N, int T): link
        // u32 [2·N] (the region holds it), keys u32 [N] or 0 with T > 0; one thread per row.
        launch_kernel!(
            self,
            e,
            "encoder_link_rows",
            f,
            link_grid(n as u64),
            [&link, &keys, &n, &t]
        )?;
        let f = self.plain_kernel("encoder_mark_rows")?;
        // SAFETY: encoder_mark_rows(unsigned* link, int N): link u32 [2·N].
        launch_kernel!(
            self,
            e,
            "encoder_mark_rows",
            f,
            grid_stride(n as u64),
            [&link, &n]
        )?;
        let (name, f) = self.entry("encoder_backward_accumulate")?;
        // SAFETY: encoder_backward_accumulate_<S>(T* dtable, const T* dout, const unsigned*
        // keys, const unsigned* link, int N, int T, int C, int table_rows, float scale):
        // dtable [table_rows, C] T +=, dout [N, C] T, keys as given to encoder_link_rows, link
        // u32 [2·N] from it and encoder_mark_rows.
        launch_kernel!(
            self,
            e,
            name,
            f,
            accumulate_grid(n as u64, c as u64),
            [
                &dtable,
                &dout,
                &keys,
                &link,
                &n,
                &t,
                &c,
                &table_rows,
                &scale
            ]
        )
    }

    /// `out[n, :] = T(decode(wte row tokens[n]) · scale)` for a table of ggml blocks, `(n, c)`
    /// its rows and channels: one `dequant_gather_<type>_<S>` launch (a token past the table
    /// gives a NaN row, as `encoder_forward_<S>` does).
    #[allow(clippy::too_many_arguments)]
    fn gather_quantized(
        &self,
        e: &OpEntry,
        ty: GgmlType,
        tokens: BufId,
        out: BufId,
        wte: &std::ops::Range<usize>,
        (n, c): (usize, usize),
        scale: f32,
    ) -> Result<()> {
        if !ty.dequantizable() {
            bail!(
                "{}: the CUDA backend cannot decode a {ty} table (it decodes {})",
                e.name,
                crate::dtype::ggml::DEQUANTIZABLE.join(", ")
            );
        }
        let (name, f) = self.entry(&gather_stem(ty))?;
        let (w, ids, out) = (self.param_ptr(e, wte)?, self.ptr(tokens)?, self.ptr(out)?);
        let (cols, ni, vi) = (
            int(e, "C", c)?,
            int(e, "N", n)?,
            int(e, "V", wte.len() / c)?,
        );
        // SAFETY: dequant_gather_<type>_<S>(const u8* w, int cols, const u32* ids, int n,
        // int vocab, float scale, T* out): w the table's blocks [V rows of C values], ids [N]
        // u32 (read only below V), out [N, C] T.
        launch_kernel!(
            self,
            e,
            name,
            f,
            grid_stride((n * c) as u64),
            [&w, &cols, &ids, &ni, &vi, &scale, &out]
        )
    }
}

/// The sizes and addresses both scatters of a backward share.
struct Scatter {
    n: i32,
    t: i32,
    c: i32,
    link: u64,
    dout: u64,
}

/// `encoder_link_rows`: one thread per row, blocks of [`BLOCK`] rows.
fn link_grid(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK as u64).max(1) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `encoder_backward_accumulate`: a block per row (up to 2^31 - 1, strided) and per
/// [`BLOCK`] channels (up to 65535, strided).
fn accumulate_grid(n: u64, c: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            n.clamp(1, i32::MAX as u64) as u32,
            c.div_ceil(BLOCK as u64).clamp(1, 65535) as u32,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The stem of the kernel gathering rows of ggml type `ty` (`dequant_gather_q8_0`, ...).
fn gather_stem(ty: GgmlType) -> String {
    format!("dequant_gather_{}", ty.name.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::SOURCES;

    #[test]
    fn backward_grids_cover_rows_and_channels() {
        let g = link_grid(1000);
        assert_eq!((g.grid_dim, g.block_dim), ((4, 1, 1), (256, 1, 1)));
        assert_eq!(link_grid(256).grid_dim.0, 1);
        let g = accumulate_grid(8192, 768);
        assert_eq!((g.grid_dim, g.block_dim), ((8192, 3, 1), (256, 1, 1)));
        assert_eq!(accumulate_grid(1, 1).grid_dim, (1, 1, 1));
    }

    #[test]
    fn every_decodable_type_has_its_kernel() {
        let dequant = SOURCES.iter().find(|s| s.name == "dequant.cu").unwrap();
        for name in crate::dtype::ggml::DEQUANTIZABLE {
            let id = (0..64)
                .find(|&id| GgmlType::from_id(id).is_ok_and(|t| t.name == *name))
                .unwrap();
            let ty = GgmlType::from_id(id).unwrap();
            let stem = format!("dequant_{}", ty.name.to_ascii_lowercase());
            for stem in [stem, gather_stem(ty)] {
                assert!(dequant.per_storage.contains(&stem.as_str()), "{stem}");
            }
        }
    }
}
