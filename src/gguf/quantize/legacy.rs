//! The 32-value block types, as llama.cpp's `quantize_row_{q8_0,q4_0,q4_1,q5_0}_ref` compute
//! them (ggml-quants.c), and BF16. One function per type: `src` whole blocks of 32 values,
//! `dst` their bytes.

use super::scale::put_f16;

/// C's `(int8_t)` of a float as llama.cpp's x86 builds (and numpy, for gguf-py) compute it:
/// truncation to a 32-bit integer (`cvttss2si`: `i32::MIN` for NaN and out-of-range values),
/// then its low byte. Only a block whose `d` is subnormal reaches those cases (`1 / d` is
/// infinite); its f16 `d` is zero, so its codes decode to zero whatever they are.
fn c_int8(v: f32) -> i8 {
    let i = if v.is_nan() || !(-2147483648.0..2147483648.0).contains(&v) {
        i32::MIN
    } else {
        v as i32
    };
    i as i8
}

/// Q8_0 (`quantize_row_q8_0_ref`): blocks of [f16 d, 32 × i8]; `d = amax / 127`,
/// `q = round(x / d)` (half away from zero).
pub fn q8_0_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        for (q, &v) in b[2..34].iter_mut().zip(x) {
            *q = c_int8((v * id).round()) as u8;
        }
    }
}

/// The value of largest magnitude in a block, with its sign (the first of equal magnitudes),
/// as Q4_0 and Q5_0 scale by it.
fn signed_max(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Q4_0 (`quantize_row_q4_0_ref`): blocks of [f16 d, 16 bytes]; byte j holds value j in its
/// low nibble and value j + 16 in its high nibble. `d = max / −8`,
/// `q = min(15, trunc(x / d + 8.5))`.
pub fn q4_0_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(18)) {
        let d = signed_max(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        let code = |v: f32| c_int8(v * id + 8.5).min(15) as u8;
        for j in 0..16 {
            b[2 + j] = code(x[j]) | (code(x[j + 16]) << 4);
        }
    }
}

/// Q4_1 (`quantize_row_q4_1_ref`): blocks of [f16 d, f16 m, 16 bytes as Q4_0];
/// `d = (max − min) / 15`, `m = min`, `q = min(15, trunc((x − min) / d + 0.5))`.
pub fn q4_1_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(20)) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in x {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        let code = |v: f32| c_int8((v - min) * id + 0.5).min(15) as u8;
        for j in 0..16 {
            b[4 + j] = code(x[j]) | (code(x[j + 16]) << 4);
        }
    }
}

/// Q5_0 (`quantize_row_q5_0_ref`): blocks of [f16 d, u32 qh, 16 bytes]; `d = max / −16`,
/// `q = min(31, trunc(x / d + 16.5))`, its low 4 bits as Q4_0's nibbles, its fifth bit as
/// bit j of the little-endian qh (value j + 16: bit j + 16).
pub fn q5_0_row(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(22)) {
        let d = signed_max(x) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        let code = |v: f32| c_int8(v * id + 16.5).min(31) as u8;
        let mut qh = 0u32;
        for j in 0..16 {
            let (q0, q1) = (code(x[j]), code(x[j + 16]));
            b[6 + j] = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
            qh |= ((q0 as u32 & 0x10) >> 4) << j;
            qh |= ((q1 as u32 & 0x10) >> 4) << (j + 16);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

/// BF16: each value rounded to the nearest bfloat16 (ties to even), little-endian.
pub fn bf16_row(src: &[f32], dst: &mut [u8]) {
    for (&x, b) in src.iter().zip(dst.chunks_exact_mut(2)) {
        b.copy_from_slice(&half::bf16::from_f32(x).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::super::{quantize, round_trip};
    use crate::dtype::GgmlType;
    use crate::util::rng::Rng;
    use half::f16;

    /// Every value comes back within half a step of its block's grid (plus the scale's f16
    /// rounding), and the block's extreme value (the one that sets the scale) comes back
    /// almost exactly.
    #[test]
    fn values_come_back_within_half_a_step() {
        let mut rng = Rng::new(9);
        let x: Vec<f32> = (0..32 * 64)
            .map(|i| (rng.next_f32() - 0.5) * (1 + i / 32) as f32)
            .collect();
        for (ty, steps) in [
            (GgmlType::Q8_0, 254.0),
            (GgmlType::Q4_0, 16.0),
            (GgmlType::Q4_1, 15.0),
            (GgmlType::Q5_0, 32.0),
        ] {
            let y = round_trip(ty, &x);
            for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let lo = xb.iter().fold(f32::MAX, |m, &v| m.min(v));
                let hi = xb.iter().fold(f32::MIN, |m, &v| m.max(v));
                let range = match ty.name {
                    "Q4_1" => hi - lo,
                    _ => 2.0 * lo.abs().max(hi.abs()),
                };
                let step = range / steps;
                for (j, (&a, &c)) in xb.iter().zip(yb).enumerate() {
                    // Half a step (Q4_0, Q5_0: a whole one, as their codes reach −8·d
                    // (−16·d) but only 7·d (15·d) on the other side), and the f16 rounding
                    // of d (and m) over the steps.
                    let half = if matches!(ty.name, "Q4_0" | "Q5_0") {
                        1.0
                    } else {
                        0.5
                    };
                    let tol = half * step + range * 2e-3;
                    assert!(
                        (a - c).abs() <= tol,
                        "{ty} block {b} value {j}: {a} came back {c} (step {step})"
                    );
                }
            }
        }
    }

    /// Bytes llama.cpp's reference quantizers write for one hand-checked block each.
    #[test]
    fn blocks_are_the_reference_quantizers_bytes() {
        // 0, 1, ..., 31: the largest magnitude is 31 (the last value).
        let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let mut q8 = [0u8; 34];
        quantize(GgmlType::Q8_0, &x, &mut q8).unwrap();
        // d = 31 / 127; q = round(i · 127 / 31): 0, 4 (4.097), 8, ..., 127.
        assert_eq!(
            f16::from_le_bytes([q8[0], q8[1]]),
            f16::from_f32(31.0 / 127.0)
        );
        assert_eq!(&q8[2..6], &[0, 4, 8, 12]);
        assert_eq!(q8[33], 127);
        let mut q4 = [0u8; 18];
        quantize(GgmlType::Q4_0, &x, &mut q4).unwrap();
        // d = 31 / −8; code(i) = min(15, trunc(−8i/31 + 8.5)): code(0) = 8, code(31) = 0,
        // code(16) = trunc(4.371) = 4.
        assert_eq!(
            f16::from_le_bytes([q4[0], q4[1]]),
            f16::from_f32(-31.0 / 8.0)
        );
        assert_eq!(q4[2], 8 | (4 << 4));
        assert_eq!(q4[17] >> 4, 0);
        let mut q41 = [0u8; 20];
        quantize(GgmlType::Q4_1, &x, &mut q41).unwrap();
        // d = 31 / 15, m = 0; code(i) = trunc(15i/31 + 0.5): code(1) = 0 (0.98), code(2) = 1.
        assert_eq!(f16::from_le_bytes([q41[2], q41[3]]), f16::from_f32(0.0));
        assert_eq!(q41[4] & 0x0F, 0);
        assert_eq!(q41[5] & 0x0F, 0);
        assert_eq!(q41[6] & 0x0F, 1);
        assert_eq!(q41[19] >> 4, 15);
        let mut q5 = [0u8; 22];
        quantize(GgmlType::Q5_0, &x, &mut q5).unwrap();
        // d = 31 / −16; code(i) = min(31, trunc(−16i/31 + 16.5)): code(0) = 16 (fifth bit
        // set, low nibble 0), code(31) = 0, code(1) = trunc(15.98) = 15, code(16) =
        // trunc(8.24) = 8.
        assert_eq!(
            f16::from_le_bytes([q5[0], q5[1]]),
            f16::from_f32(-31.0 / 16.0)
        );
        let qh = u32::from_le_bytes([q5[2], q5[3], q5[4], q5[5]]);
        assert_eq!(qh & 1, 1, "value 0's fifth bit");
        assert_eq!((qh >> 1) & 1, 0, "value 1's fifth bit");
        assert_eq!(q5[6], 8 << 4);
        assert_eq!(q5[7] & 0x0F, 15);
        assert_eq!((q5[21] >> 4, qh >> 31), (0, 0));
        // A block of zeros: d = 0, every value decodes to zero.
        let zeros = [0f32; 32];
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
        ] {
            assert!(round_trip(ty, &zeros).iter().all(|&v| v == 0.0), "{ty}");
        }
    }

    /// Bitwise the bytes of llama.cpp's reference quantizers, as the `gguf` Python package
    /// (gguf-py) computes them (`tests/fixtures/make_quant_reference.py`): normal and uniform
    /// rows, constant blocks (one of zeros), and grid points with ties.
    #[test]
    fn bytes_are_those_of_gguf_py() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/quant_reference.json"
        );
        let text = std::fs::read_to_string(path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 4);
        for (r, row) in rows.iter().enumerate() {
            let x: Vec<f32> = row["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
                let hex = row[ty.name].as_str().unwrap();
                let want: Vec<u8> = (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect();
                let mut got = vec![0u8; want.len()];
                quantize(ty, &x, &mut got).unwrap();
                let first = got.iter().zip(&want).position(|(a, b)| a != b);
                assert_eq!(first, None, "row {r} {ty}: first differing byte");
            }
        }
    }
}
