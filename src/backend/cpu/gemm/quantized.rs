//! The two GEMMs of a frozen linear layer whose weight stays quantized (QLoRA's base): the
//! forward `out[n, o] = inp[n, i] · Wᵀ` and the input gradient `dinp[n, i] = dout[n, o] · W`,
//! with `W [out, in]` stored as rows of ggml blocks ([`QuantWeight`]: Q8_0, Q4_0, Q4_1, Q5_0,
//! Q4_K, Q6_K, or F16/BF16/F32 as a GGUF file holds them). A frozen layer has no weight gradient,
//! so there is no third GEMM.
//!
//! The weight is never dequantized whole: [`TILE_ROWS`] rows at a time are decoded (exactly
//! as llama.cpp decodes them, `dtype::dequant`) into an f32 workspace of
//! [`workspace_len`] elements, and the f32 GEMM ([`sgemm`](super::f32::sgemm)) runs on that tile. The decode is
//! O(out · in) per call against the GEMM's O(n · out · in), so it is a small share of the
//! time for the n = B·T rows of a training step. The results are those of the naive twins
//! [`naive_forward`] and [`naive_backward_input`] (dequantize whole, then the f64 reference
//! GEMM) to f32 rounding; like any GEMM on the `gemm` crate, not bitwise those of one f32
//! GEMM over the whole dequantized weight (its blocking depends on the tile's width).

use super::mixed::gemm_mixed;
use crate::dtype::Elem;
use crate::dtype::GgmlType;
use crate::dtype::dequant;
use anyhow::{Result, bail};
use rayon::prelude::*;

/// Rows of `W` decoded at once: the forward GEMM's output columns per call, the input
/// gradient's reduction depth per call.
pub const TILE_ROWS: usize = 256;

/// f32 elements of workspace the two GEMMs need for a weight of `cols` (= in) columns.
pub fn workspace_len(cols: usize) -> usize {
    TILE_ROWS * cols
}

/// A weight `[rows, cols]` stored as `ty`, row after row (each row a whole number of blocks).
#[derive(Clone, Copy, Debug)]
pub struct QuantWeight<'a> {
    pub ty: GgmlType,
    /// `rows` rows of `cols / block_size` blocks.
    pub bytes: &'a [u8],
    /// out (the rows of `W`).
    pub rows: usize,
    /// in (the values of a row).
    pub cols: usize,
}

impl<'a> QuantWeight<'a> {
    /// `bytes` as a `[rows, cols]` weight of type `ty`; refuses a type memwall cannot decode,
    /// a row that is not a whole number of blocks, and a byte count that is not the shape's.
    pub fn new(ty: GgmlType, bytes: &'a [u8], rows: usize, cols: usize) -> Result<QuantWeight<'a>> {
        dequant::check_supported(ty)?;
        let Some(row_bytes) = ty.bytes_for(cols as u64) else {
            bail!(
                "a row of {cols} values is not a whole number of {ty} blocks of {}",
                ty.block_size
            );
        };
        if row_bytes * rows as u64 != bytes.len() as u64 {
            bail!(
                "a [{rows}, {cols}] {ty} weight takes {} bytes, not {}",
                row_bytes * rows as u64,
                bytes.len()
            );
        }
        Ok(QuantWeight {
            ty,
            bytes,
            rows,
            cols,
        })
    }

    /// Decodes row `i` into `dst` (`cols` values): an embedding's row, gathered.
    pub fn decode_row(&self, i: usize, dst: &mut [f32]) {
        let rb = self.row_bytes();
        dequant::dequantize(
            self.ty,
            &self.bytes[i * rb..(i + 1) * rb],
            &mut dst[..self.cols],
        )
        .expect("rows checked by QuantWeight::new");
    }

    fn row_bytes(&self) -> usize {
        self.bytes.len() / self.rows.max(1)
    }

    /// Decodes rows `r0 .. r0 + dst.len() / cols` into `dst` (row-major), rows in parallel.
    fn decode(&self, r0: usize, dst: &mut [f32]) {
        let rb = self.row_bytes();
        let rows = dst.len() / self.cols;
        let src = &self.bytes[r0 * rb..(r0 + rows) * rb];
        let ty = self.ty;
        dst.par_chunks_mut(self.cols)
            .zip(src.par_chunks(rb))
            .for_each(|(d, s)| {
                dequant::dequantize(ty, s, d).expect("rows checked by QuantWeight::new")
            });
    }
}

/// `out[n, rows] = (accumulate ? out : 0) + inp[n, cols] · Wᵀ`, `W` decoded [`TILE_ROWS`]
/// rows at a time into `ws` (at least [`workspace_len`]`(cols)` elements). Activations of
/// any storage type: the tile product runs on [`gemm_mixed`] (exactly [`sgemm`](super::f32::sgemm) when all
/// f32; else `mixed_ws` holds its tiles, and each output element is rounded once).
#[allow(clippy::too_many_arguments)]
pub fn forward<A: Elem, C: Elem>(
    out: &mut [C], // [n, w.rows]
    inp: &[A],     // [n, w.cols]
    w: &QuantWeight,
    n: usize,
    accumulate: bool,
    ws: &mut [f32],       // [TILE_ROWS, w.cols]
    mixed_ws: &mut [f32], // [gemm_mixed_workspace_len()] unless A and C are f32
) {
    let (ic, oc) = (w.cols, w.rows);
    assert!(out.len() >= n * oc && inp.len() >= n * ic && ws.len() >= workspace_len(ic));
    let mut r0 = 0;
    while r0 < oc {
        let rows = TILE_ROWS.min(oc - r0);
        let tile = &mut ws[..rows * ic]; // [rows, ic]
        w.decode(r0, tile);
        // out[:, r0..r0 + rows] = inp · tileᵀ (tile stored [rows, ic]).
        gemm_mixed(
            n,
            rows,
            ic,
            inp,
            ic,
            false,
            &*tile,
            ic,
            true,
            &mut out[r0..],
            oc,
            accumulate,
            mixed_ws,
        );
        r0 += rows;
    }
}

/// `dinp[n, cols] = (accumulate ? dinp : 0) + dout[n, rows] · W`, `W` decoded
/// [`TILE_ROWS`] rows at a time into `ws` (at least [`workspace_len`]`(cols)` elements),
/// the products on [`gemm_mixed`] as in [`forward`] (a reduced-precision `dinp` is rounded
/// once per tile of rows).
#[allow(clippy::too_many_arguments)]
pub fn backward_input<A: Elem, C: Elem>(
    dinp: &mut [C], // [n, w.cols]
    dout: &[A],     // [n, w.rows]
    w: &QuantWeight,
    n: usize,
    accumulate: bool,
    ws: &mut [f32],       // [TILE_ROWS, w.cols]
    mixed_ws: &mut [f32], // [gemm_mixed_workspace_len()] unless A and C are f32
) {
    let (ic, oc) = (w.cols, w.rows);
    assert!(dinp.len() >= n * ic && dout.len() >= n * oc && ws.len() >= workspace_len(ic));
    if oc == 0 && !accumulate {
        dinp[..n * ic].fill(C::from_f32(0.0));
    }
    let mut r0 = 0;
    while r0 < oc {
        let rows = TILE_ROWS.min(oc - r0);
        let tile = &mut ws[..rows * ic]; // [rows, ic]
        w.decode(r0, tile);
        // dinp += dout[:, r0..r0 + rows] · tile.
        gemm_mixed(
            n,
            ic,
            rows,
            &dout[r0..],
            oc,
            false,
            &*tile,
            ic,
            false,
            &mut *dinp,
            ic,
            accumulate || r0 > 0,
            mixed_ws,
        );
        r0 += rows;
    }
}

/// The naive twin of [`forward`]: `W` dequantized whole, then the f64 reference GEMM.
pub fn naive_forward(out: &mut [f32], inp: &[f32], w: &QuantWeight, n: usize, accumulate: bool) {
    let full = dequantized(w);
    super::naive::sgemm(
        n, w.rows, w.cols, 1.0, inp, w.cols, false, &full, w.cols, true, out, w.rows, accumulate,
    );
}

/// The naive twin of [`backward_input`].
pub fn naive_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    w: &QuantWeight,
    n: usize,
    accumulate: bool,
) {
    let full = dequantized(w);
    super::naive::sgemm(
        n, w.cols, w.rows, 1.0, dout, w.rows, false, &full, w.cols, false, dinp, w.cols, accumulate,
    );
}

fn dequantized(w: &QuantWeight) -> Vec<f32> {
    let mut full = vec![0f32; w.rows * w.cols]; // [rows, cols]
    dequant::dequantize(w.ty, w.bytes, &mut full).expect("rows checked by QuantWeight::new");
    full
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::Rng;
    use half::f16;

    /// A valid `[rows, cols]` weight of `ty`: random bytes, with every block's f16 scales
    /// (and mins) set to small finite values.
    fn weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
        let n = ty.bytes_for((rows * cols) as u64).unwrap() as usize;
        let mut b: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
        let put = |b: &mut [u8], at: usize, x: f32| {
            b[at..at + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes())
        };
        let ts = ty.type_size as usize;
        for block in b.chunks_exact_mut(ts) {
            let d = 0.01 + 0.02 * rng.next_f32();
            let m = -0.05 * rng.next_f32();
            match ty.name {
                "Q8_0" | "Q4_0" | "Q5_0" => put(block, 0, d),
                "Q4_1" | "Q4_K" => {
                    put(block, 0, d);
                    put(block, 2, m);
                }
                "Q6_K" => put(block, ts - 2, d),
                "F16" => {
                    for i in (0..ts).step_by(2) {
                        put(block, i, rng.next_f32() - 0.5);
                    }
                }
                "F32" => block.copy_from_slice(&(rng.next_f32() - 0.5).to_le_bytes()),
                _ => unreachable!("{ty}"),
            }
        }
        b
    }

    fn close(got: &[f32], want: &[f32], what: &str) {
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * scale + 1e-6 * w.abs(),
                "{what}[{i}]: {g} against {w} (largest {scale})"
            );
        }
    }

    /// Every block type, a weight taller than a tile and not a multiple of it, both GEMMs,
    /// with and without accumulation, against dequantize-then-reference.
    #[test]
    fn both_gemms_match_dequantize_then_reference_for_every_block_type() {
        let mut rng = Rng::new(3);
        let (n, rows) = (7, TILE_ROWS + 37);
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::F16,
            GgmlType::F32,
        ] {
            let cols = if ty.block_size == 256 { 512 } else { 96 };
            let bytes = weight(ty, rows, cols, &mut rng);
            let w = QuantWeight::new(ty, &bytes, rows, cols).unwrap();
            let mut ws = vec![f32::NAN; workspace_len(cols)];
            let inp: Vec<f32> = (0..n * cols).map(|_| rng.next_f32() - 0.5).collect();
            let dout: Vec<f32> = (0..n * rows).map(|_| rng.next_f32() - 0.5).collect();
            for accumulate in [false, true] {
                let start: Vec<f32> = (0..n * rows).map(|_| rng.next_f32()).collect();
                let (mut got, mut want) = (start.clone(), start.clone());
                forward(&mut got, &inp, &w, n, accumulate, &mut ws, &mut []);
                naive_forward(&mut want, &inp, &w, n, accumulate);
                close(
                    &got,
                    &want,
                    &format!("{ty} forward (accumulate {accumulate})"),
                );
                let start: Vec<f32> = (0..n * cols).map(|_| rng.next_f32()).collect();
                let (mut got, mut want) = (start.clone(), start.clone());
                backward_input(&mut got, &dout, &w, n, accumulate, &mut ws, &mut []);
                naive_backward_input(&mut want, &dout, &w, n, accumulate);
                close(
                    &got,
                    &want,
                    &format!("{ty} input gradient (accumulate {accumulate})"),
                );
            }
        }
    }

    #[test]
    fn weights_of_the_wrong_size_or_type_are_refused() {
        let e = format!(
            "{:#}",
            QuantWeight::new(GgmlType::Q4_0, &[0; 18], 1, 48).unwrap_err()
        );
        assert!(e.contains("not a whole number of Q4_0 blocks of 32"), "{e}");
        let e = format!(
            "{:#}",
            QuantWeight::new(GgmlType::Q4_0, &[0; 18], 2, 32).unwrap_err()
        );
        assert!(e.contains("takes 36 bytes, not 18"), "{e}");
        let e = format!(
            "{:#}",
            QuantWeight::new(GgmlType::from_id(7).unwrap(), &[0; 24], 1, 32).unwrap_err()
        );
        assert!(e.contains("cannot be dequantized"), "{e}");
    }
}
