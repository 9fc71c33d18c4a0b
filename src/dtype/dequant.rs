//! Dequantization of GGUF tensor data to f32, exactly as llama.cpp's `dequantize_row_*`
//! (ggml-quants.c) computes it: same block layouts, same f32 operations in the same order.
//!
//! Block layouts (all little-endian; `f16` is IEEE half precision):
//!
//! | type | values | bytes | layout                                                        |
//! |------|--------|-------|---------------------------------------------------------------|
//! | Q8_0 | 32     | 34    | f16 d, 32 × i8 q; `y = q·d`                                   |
//! | Q4_0 | 32     | 18    | f16 d, 16 bytes; low nibbles are values 0–15, high 16–31; `y = (q − 8)·d` |
//! | Q4_1 | 32     | 20    | f16 d, f16 m, 16 bytes as Q4_0; `y = q·d + m`                 |
//! | Q5_0 | 32     | 22    | f16 d, u32 qh (bit j: value j's fifth bit), 16 bytes as Q4_0; `y = (q − 16)·d` |
//! | Q4_K | 256    | 144   | f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles |
//! | Q6_K | 256    | 210   | 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 × i8 scales, f16 d last |
//!
//! F32, F16 and BF16 are widened as they are. Every other ggml type is refused by its ggml
//! name with the list of supported ones. Blocks are independent, so large tensors are split
//! into fixed chunks of blocks over rayon: the result is the same for any thread count.

use crate::dtype::ggml::{DEQUANTIZABLE, GgmlType};
use anyhow::{Result, bail};
use half::{bf16, f16};
use rayon::prelude::*;

/// Blocks per parallel work item (fixed, so the partition does not depend on the pool).
const CHUNK_BLOCKS: usize = 1024;

/// Dequantizes `src` (the bytes of `dst.len()` values of type `ty`) into `dst`.
///
/// Errors: a type memwall does not decode (named, with the supported list), or a byte count
/// that does not match `dst.len()` values of `ty`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_supported(ty)?;
    let n = dst.len() as u64;
    match ty.bytes_for(n) {
        Some(b) if b == src.len() as u64 => {}
        Some(b) => bail!(
            "{n} {ty} values take {b} bytes, but {} were given",
            src.len()
        ),
        None => bail!(
            "{n} values are not a whole number of {ty} blocks of {}",
            ty.block_size
        ),
    }
    let (bs, ts) = (ty.block_size as usize, ty.type_size as usize);
    let row: fn(&[u8], &mut [f32]) = match ty.name {
        "F32" => f32_row,
        "F16" => f16_row,
        "BF16" => bf16_row,
        "Q8_0" => q8_0_row,
        "Q4_0" => q4_0_row,
        "Q4_1" => q4_1_row,
        "Q5_0" => q5_0_row,
        "Q4_K" => q4_k_row,
        "Q6_K" => q6_k_row,
        _ => unreachable!("dequantizable() lists exactly these types"),
    };
    // Chunks of CHUNK_BLOCKS blocks: src [n_blocks, ts] bytes → dst [n_blocks, bs] values.
    src.par_chunks(CHUNK_BLOCKS * ts)
        .zip(dst.par_chunks_mut(CHUNK_BLOCKS * bs))
        .for_each(|(s, d)| row(s, d));
    Ok(())
}

/// Refuses, by ggml name and with the list of supported types, a type memwall cannot decode.
pub fn check_supported(ty: GgmlType) -> Result<()> {
    if !ty.dequantizable() {
        bail!(
            "tensor type {ty} cannot be dequantized: memwall decodes {}; re-quantize the model to one of them (llama-quantize) or convert from the original safetensors",
            DEQUANTIZABLE.join(", ")
        );
    }
    Ok(())
}

/// A little-endian f16 at `b[i..i + 2]`, widened.
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// F32: `src` `[n × 4 bytes]` → `dst` `[n]`.
pub fn f32_row(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

/// F16: `src` `[n × 2 bytes]` → `dst` `[n]`.
pub fn f16_row(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16::from_le_bytes([s[0], s[1]]).to_f32();
    }
}

/// BF16: `src` `[n × 2 bytes]` → `dst` `[n]` (exact: bf16 is the top half of an f32).
pub fn bf16_row(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16::from_le_bytes([s[0], s[1]]).to_f32();
    }
}

/// Q8_0 (`dequantize_row_q8_0`): blocks of [f16 d, 32 × i8] → 32 values `q·d`.
pub fn q8_0_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        for (y, &q) in y.iter_mut().zip(&b[2..34]) {
            *y = (q as i8) as f32 * d;
        }
    }
}

/// Q4_0 (`dequantize_row_q4_0`): blocks of [f16 d, 16 bytes]; byte j holds value j in its low
/// nibble and value j + 16 in its high nibble; `y = (q − 8)·d`.
pub fn q4_0_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        let qs = &b[2..18]; // [16]
        for j in 0..16 {
            let x0 = (qs[j] & 0x0F) as i32 - 8;
            let x1 = (qs[j] >> 4) as i32 - 8;
            y[j] = x0 as f32 * d;
            y[j + 16] = x1 as f32 * d;
        }
    }
}

/// Q4_1 (`dequantize_row_q4_1`): blocks of [f16 d, f16 m, 16 bytes as Q4_0]; `y = q·d + m`.
pub fn q4_1_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(20).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..20]; // [16]
        for j in 0..16 {
            let x0 = (qs[j] & 0x0F) as i32;
            let x1 = (qs[j] >> 4) as i32;
            y[j] = x0 as f32 * d + m;
            y[j + 16] = x1 as f32 * d + m;
        }
    }
}

/// Q5_0 (`dequantize_row_q5_0`): blocks of [f16 d, 4 bytes qh, 16 bytes qs]; value j's low
/// 4 bits are a nibble as in Q4_0, its fifth bit is bit j of the little-endian u32 qh;
/// `y = (q − 16)·d`.
pub fn q5_0_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22]; // [16]
        for j in 0..16 {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            let x0 = ((qs[j] & 0x0F) | h0) as i32 - 16;
            let x1 = ((qs[j] >> 4) | h1) as i32 - 16;
            y[j] = x0 as f32 * d;
            y[j + 16] = x1 as f32 * d;
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) from Q4_K's 12 packed bytes
/// (`get_scale_min_k4`): sub-blocks 0–3 keep theirs in the low 6 bits of bytes j and j + 4;
/// sub-blocks 4–7 in the nibbles of byte j + 4, topped by the high 2 bits of bytes j − 4
/// (scale) and j (min).
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K (`dequantize_row_q4_K`): super-blocks of [f16 d, f16 dmin, 12 bytes scales, 128 bytes
/// qs] → 256 values in 8 sub-blocks of 32. Each 32-byte run of qs feeds two sub-blocks: low
/// nibbles the first (scale index 2k), high nibbles the second (2k + 1);
/// `y = d·sc·q − dmin·m`.
pub fn q4_k_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(144).zip(dst.chunks_exact_mut(256)) {
        let d = f16_at(b, 0);
        let min = f16_at(b, 2);
        let scales = &b[4..16]; // [12]
        let qs = &b[16..144]; // [128]
        for k in 0..4 {
            let q = &qs[32 * k..32 * k + 32];
            let (sc, m) = scale_min_k4(2 * k, scales);
            let (d1, m1) = (d * sc as f32, min * m as f32);
            let (sc, m) = scale_min_k4(2 * k + 1, scales);
            let (d2, m2) = (d * sc as f32, min * m as f32);
            let y = &mut y[64 * k..64 * k + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

/// Q6_K (`dequantize_row_q6_K`): super-blocks of [128 bytes ql, 64 bytes qh, 16 × i8 scales,
/// f16 d] → 256 values, two halves of 128. In half h, for l in 0..32, byte `ql[l]` and
/// `ql[l + 32]` give the low 4 bits of values l, l + 32 (low nibbles) and l + 64, l + 96 (high
/// nibbles); `qh[l]` gives their high 2 bits (bits 0–1, 2–3, 4–5, 6–7); each 16 values share a
/// scale; `y = d·sc·(q − 32)`.
pub fn q6_k_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(210).zip(dst.chunks_exact_mut(256)) {
        let d = f16_at(b, 208);
        for h in 0..2 {
            let ql = &b[64 * h..64 * h + 64]; // [64]
            let qh = &b[128 + 32 * h..128 + 32 * h + 32]; // [32]
            let sc = &b[192 + 8 * h..192 + 8 * h + 8]; // [8] i8
            let y = &mut y[128 * h..128 * h + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Each block type against values derived here from the format's formula: the tests
    //! choose quantized values and scales, lay the bytes out by the layout's description, and
    //! state the floats those should decode to, without calling the decoders' helpers.
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    fn deq(ty: GgmlType, src: &[u8], n: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; n];
        dequantize(ty, src, &mut y).unwrap();
        y
    }

    #[test]
    fn plain_types_widen_exactly() {
        let xs = [0.0f32, -1.5, 3.25, 65504.0, 1e-3];
        let b: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(deq(GgmlType::F32, &b, 5), xs);
        let b: Vec<u8> = xs.iter().flat_map(|&x| h(x)).collect();
        let want: Vec<f32> = xs.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
        assert_eq!(deq(GgmlType::F16, &b, 5), want);
        // bf16 bits are the top 16 bits of the f32: 0x3FC0 = 1.5, 0xC040 = -3.0.
        let b = [0xC0, 0x3F, 0x40, 0xC0];
        assert_eq!(deq(GgmlType::BF16, &b, 2), [1.5, -3.0]);
    }

    #[test]
    fn q8_0_is_q_times_d() {
        // d = 0.5, q = -16..16: y = q / 2.
        let mut b = h(0.5).to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(deq(GgmlType::Q8_0, &b, 32), want);
    }

    #[test]
    fn q4_0_low_nibbles_first_half_high_nibbles_second() {
        // Value j (< 16) has q = j in byte j's low nibble; value j + 16 has q = 15 - j in its
        // high nibble. d = 0.25: y = (q - 8) / 4.
        let mut b = h(0.25).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut want = vec![0f32; 32];
        for j in 0..16 {
            want[j] = (j as f32 - 8.0) * 0.25;
            want[j + 16] = ((15 - j) as f32 - 8.0) * 0.25;
        }
        assert_eq!(deq(GgmlType::Q4_0, &b, 32), want);
        assert_eq!(want[0], -2.0);
        assert_eq!(want[16], 1.75);
    }

    #[test]
    fn q4_1_is_q_times_d_plus_m() {
        let mut b = h(2.0).to_vec();
        b.extend(h(-10.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut want = vec![0f32; 32];
        for j in 0..16 {
            want[j] = j as f32 * 2.0 - 10.0;
            want[j + 16] = (15 - j) as f32 * 2.0 - 10.0;
        }
        assert_eq!(deq(GgmlType::Q4_1, &b, 32), want);
        assert_eq!((want[0], want[16], want[31]), (-10.0, 20.0, -10.0));
    }

    #[test]
    fn q5_0_fifth_bits_come_from_qh_bit_j() {
        // Value j has code q(j) = (7·j + 3) % 32: its low 4 bits in a nibble as Q4_0 lays
        // them out, its fifth bit as bit j of the little-endian u32 qh. d = 0.5:
        // y = (q − 16) / 2.
        let q = |j: usize| ((7 * j + 3) % 32) as u8;
        let mut qh = 0u32;
        for j in 0..32 {
            qh |= ((q(j) >> 4) as u32) << j;
        }
        let mut b = h(0.5).to_vec();
        b.extend(qh.to_le_bytes());
        b.extend((0..16).map(|j| (q(j) & 0x0F) | ((q(j + 16) & 0x0F) << 4)));
        let want: Vec<f32> = (0..32).map(|j| (q(j) as f32 - 16.0) * 0.5).collect();
        assert_eq!(deq(GgmlType::Q5_0, &b, 32), want);
        // Value 2: code 17 (fifth bit set), y = 0.5; value 18: code 1, y = −7.5.
        assert_eq!((want[2], want[18]), (0.5, -7.5));
    }

    /// Packs 8 six-bit scales and mins as Q4_K stores them: sub-blocks 0–3 in the low 6 bits
    /// of bytes 0–3 (scales) and 4–7 (mins); sub-blocks 4–7 in the low (scale) and high (min)
    /// nibbles of bytes 8–11, their top 2 bits in bits 6–7 of bytes 0–3 (scale) and 4–7 (min).
    fn pack_k4(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
        let mut p = [0u8; 12];
        for j in 0..4 {
            p[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            p[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            p[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
        }
        p
    }

    #[test]
    fn q4_k_scales_mins_and_nibbles() {
        let sc = [1u8, 2, 3, 63, 17, 40, 5, 63];
        let mn = [0u8, 7, 63, 1, 33, 2, 50, 63];
        let (d, dmin) = (0.5f32, 0.25f32);
        // Value v of sub-block s (32 values each) has q = (v + s) % 16.
        let q = |s: usize, v: usize| ((v + s) % 16) as u8;
        let mut b = h(d).to_vec();
        b.extend(h(dmin));
        b.extend(pack_k4(sc, mn));
        // Sub-blocks 2k and 2k + 1 share 32 bytes: 2k in the low nibbles, 2k + 1 in the high.
        for k in 0..4 {
            b.extend((0..32).map(|l| q(2 * k, l) | (q(2 * k + 1, l) << 4)));
        }
        assert_eq!(b.len(), 144);
        let mut want = vec![0f32; 256];
        for s in 0..8 {
            for v in 0..32 {
                want[32 * s + v] = d * sc[s] as f32 * q(s, v) as f32 - dmin * mn[s] as f32;
            }
        }
        assert_eq!(deq(GgmlType::Q4_K, &b, 256), want);
        // Sub-block 7, value 31: q = 6, 0.5·63·6 − 0.25·63 = 173.25.
        assert_eq!(want[255], 173.25);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &pack_k4(sc, mn)), (sc[j], mn[j]), "j={j}");
        }
    }

    #[test]
    fn q6_k_low_and_high_bits_scales_and_d_last() {
        // Value v (0..256) has the 6-bit code c(v) = (v * 7 + 3) % 64, i.e. q = c − 32, and
        // scale sc[v / 16]; d = 0.125.
        let c = |v: usize| ((v * 7 + 3) % 64) as u8;
        let sc: [i8; 16] = [
            1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12, 13, -14, 127, -128,
        ];
        let d = 0.125f32;
        // Layout of half h (values 128h..128h+128), l in 0..32: ql[64h + l] holds values l
        // (low nibble) and l + 64 (high nibble); ql[64h + l + 32] values l + 32 and l + 96;
        // qh[32h + l] holds the top 2 bits of values l, l + 32, l + 64, l + 96 in bit pairs
        // 0–1, 2–3, 4–5, 6–7.
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for hf in 0..2 {
            let v = |i: usize| 128 * hf + i;
            for l in 0..32 {
                ql[64 * hf + l] = (c(v(l)) & 15) | ((c(v(l + 64)) & 15) << 4);
                ql[64 * hf + l + 32] = (c(v(l + 32)) & 15) | ((c(v(l + 96)) & 15) << 4);
                qh[32 * hf + l] = (c(v(l)) >> 4)
                    | ((c(v(l + 32)) >> 4) << 2)
                    | ((c(v(l + 64)) >> 4) << 4)
                    | ((c(v(l + 96)) >> 4) << 6);
            }
        }
        let mut b = ql.to_vec();
        b.extend(qh);
        b.extend(sc.iter().map(|&s| s as u8));
        b.extend(h(d));
        assert_eq!(b.len(), 210);
        let want: Vec<f32> = (0..256)
            .map(|v| d * sc[v / 16] as f32 * (c(v) as f32 - 32.0))
            .collect();
        assert_eq!(deq(GgmlType::Q6_K, &b, 256), want);
        // Value 255: code (255·7 + 3) % 64 = 60, q = 28, scale −128: 0.125·(−128)·28 = −448.
        assert_eq!(want[255], -448.0);
    }

    #[test]
    fn many_blocks_split_across_chunks_decode_like_one() {
        // More than CHUNK_BLOCKS blocks: the parallel split must equal one sequential pass.
        let blocks = CHUNK_BLOCKS * 2 + 3;
        let src: Vec<u8> = (0..blocks * 20)
            .map(|i| (i * 31 % 251) as u8 & 0x3F)
            .collect();
        let par = deq(GgmlType::Q4_1, &src, blocks * 32);
        let mut seq = vec![0f32; blocks * 32];
        q4_1_row(&src, &mut seq);
        assert_eq!(par, seq);
    }

    #[test]
    fn unsupported_types_and_wrong_sizes_are_refused_by_name() {
        let mut y = vec![0f32; 256];
        let q5k = GgmlType::from_id(13).unwrap();
        let e = format!("{:#}", dequantize(q5k, &[0u8; 176], &mut y).unwrap_err());
        assert!(e.contains("Q5_K") && e.contains("Q4_K, Q6_K"), "{e}");
        let iq = GgmlType::from_id(17).unwrap();
        let e = format!("{:#}", dequantize(iq, &[0u8; 74], &mut y).unwrap_err());
        assert!(e.contains("IQ2_XS"), "{e}");
        let e = format!(
            "{:#}",
            dequantize(GgmlType::Q6_K, &[0u8; 200], &mut y).unwrap_err()
        );
        assert!(e.contains("210 bytes"), "{e}");
        let e = format!(
            "{:#}",
            dequantize(GgmlType::Q8_0, &[0u8; 34], &mut y[..33]).unwrap_err()
        );
        assert!(e.contains("whole number"), "{e}");
    }
}
