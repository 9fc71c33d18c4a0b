//! The quantizers against the `gguf` Python package (llama.cpp's gguf-py), run through
//! `scripts/gguf_py.py` with the python `MEMWALL_GGUF_PY` names (`.ci/run` installs it):
//!
//! - the 32-value types gguf-py can quantize (Q8_0, Q4_0, Q4_1, Q5_0, BF16): our bytes equal
//!   `gguf.quants.quantize`'s, byte for byte, on edge cases and 4096 blocks of random values
//!   over magnitudes 1e-30..1e6;
//! - Q4_K and Q6_K, which gguf-py only decodes: gguf-py's `dequantize` of our bytes equals
//!   ours, bitwise, and the error on llama.cpp's `tests/test-quantize-fns.cpp` data is within
//!   its bound.

use super::quantize;
use crate::dtype::GgmlType;
use crate::dtype::dequant::dequantize;
use crate::gguf::testutil::gguf_py;
use crate::util::rng::Rng;
use std::path::Path;

fn write_f32(path: &Path, x: &[f32]) {
    let b: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, b).unwrap();
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn ours(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut q = vec![0u8; ty.bytes_for(x.len() as u64).unwrap() as usize];
    quantize(ty, x, &mut q).unwrap();
    q
}

/// Edge-case blocks of 32: zeros (and −0), equal values, one value among zeros, +max and
/// −max (the first decides the sign), ties on each type's grid, subnormal and huge values.
fn edge_blocks() -> Vec<f32> {
    let mut x: Vec<f32> = Vec::new();
    let mut block = |f: &dyn Fn(usize) -> f32| x.extend((0..32).map(f));
    block(&|_| 0.0);
    block(&|i| if i % 2 == 0 { -0.0 } else { 0.0 });
    block(&|_| 1.0);
    block(&|_| -2.5);
    block(&|_| 3e-5);
    block(&|i| if i == 7 { -1.0 } else { 0.0 });
    block(&|i| {
        if i == 0 {
            4.0
        } else if i == 9 {
            -4.0
        } else {
            1.0
        }
    });
    block(&|i| {
        if i == 0 {
            -4.0
        } else if i == 9 {
            4.0
        } else {
            -1.0
        }
    });
    // Ties: values whose x / d lands on .5 exactly for one type or another.
    block(&|i| (i as f32 - 16.0) / 2.0);
    block(&|i| (i as f32 - 16.0) / 4.0);
    block(&|i| (i as f32) * 0.5 - 8.0);
    block(&|i| (i as f32 - 15.5) * 127.0 / 16.0);
    block(&|i| (i % 16) as f32 * 15.0 / 16.0 + 0.5);
    block(&|i| 1e-40 * (i as f32 - 16.0));
    block(&|i| 1e-45 * i as f32);
    block(&|i| 6e4 * (i as f32 - 16.0));
    block(&|i| 3e38 * ((i as f32) / 31.0 - 0.5));
    x
}

/// `n` values in blocks of 32 at a random magnitude 10^(−30..6) each, normal or uniform.
fn random_blocks(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut x = Vec::with_capacity(n);
    while x.len() < n {
        let scale = 10f32.powf(rng.next_f32() * 36.0 - 30.0);
        let uniform = rng.next_f32() < 0.3;
        for _ in 0..32 {
            let v = if uniform {
                rng.next_f32() - 0.3
            } else {
                rng.normal()
            };
            x.push(v * scale);
        }
    }
    x.truncate(n);
    x
}

#[test]
#[ignore = "needs gguf-py (set MEMWALL_GGUF_PY): .ci/run provides it"]
fn gguf_py_quantizes_the_32_value_types_to_our_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let mut x = edge_blocks();
    x.extend(random_blocks(29, 32 * 4096 - x.len()));
    let input = tmp.path().join("x.f32");
    write_f32(&input, &x);
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::BF16,
    ] {
        let out = tmp.path().join(format!("{}.bin", ty.name));
        gguf_py(&[
            "quantize".as_ref(),
            ty.name.as_ref(),
            input.as_ref(),
            out.as_ref(),
        ]);
        let want = std::fs::read(&out).unwrap();
        let got = ours(ty, &x);
        assert_eq!(got.len(), want.len(), "{ty}: byte count");
        // Bytes per 32 values.
        let ts = ty.bytes_for(32).unwrap() as usize;
        let (mut differ, mut signed_zero) = (Vec::new(), 0);
        for (i, (a, b)) in got.chunks(ts).zip(want.chunks(ts)).enumerate() {
            if a == b {
                continue;
            }
            let xb = &x[32 * i..32 * i + 32];
            if is_signed_zero_difference(ty, xb, a, b) {
                signed_zero += 1;
            } else {
                differ.push(i);
            }
        }
        assert!(
            differ.is_empty(),
            "{ty}: {} of {} blocks differ from gguf-py's, the first {:?}: values {:?}",
            differ.len(),
            got.len() / ts,
            &differ[..differ.len().min(5)],
            &x[differ[0] * 32..differ[0] * 32 + 32]
        );
        // At most the one block of ±0 (edge_blocks' second).
        assert!(signed_zero <= 1, "{ty}: {signed_zero} blocks of ±0");
    }
}

/// The one place gguf-py departs from ggml's reference code: the sign of a zero scale in a
/// block of +0 and −0. ggml's loops keep the first of equal values (Q4_0 and Q5_0: `max`
/// stays its initial +0, so `d = +0 / −k = −0`; Q4_1: `min` is the block's first value),
/// where numpy's `argmax`, `min` and `max` may pick either zero. memwall follows ggml; both
/// decode to zeros. True when the block `x` is all zeros and `ours` and `theirs` differ only
/// in the sign bits of their f16 fields (d; Q4_1: d and m), each ±0.
fn is_signed_zero_difference(ty: GgmlType, x: &[f32], ours: &[u8], theirs: &[u8]) -> bool {
    let fields = match ty.name {
        "Q4_0" | "Q5_0" => 1,
        "Q4_1" => 2,
        _ => return false,
    };
    let is_zero = |b: &[u8]| b == [0x00, 0x00] || b == [0x00, 0x80];
    x.iter().all(|&v| v == 0.0)
        && (0..fields)
            .all(|f| is_zero(&ours[2 * f..2 * f + 2]) && is_zero(&theirs[2 * f..2 * f + 2]))
        && ours[2 * fields..] == theirs[2 * fields..]
}

/// llama.cpp's `tests/test-quantize-fns.cpp` data: `generate_data(offset, n, dst,
/// amplitude)`, `dst[i] = 0.1 + amplitude·cosf(i + offset)` (the sum in double, stored as
/// float).
fn generate_data(offset: f32, n: usize, amplitude: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (0.1f64 + (amplitude * (i as f32 + offset).cos()) as f64) as f32)
        .collect()
}

/// test-quantize-fns' `array_rmse`: `sqrtf(Σ (a − b)²) / n`, the differences in float, the
/// sum in double.
fn array_rmse(a: &[f32], b: &[f32]) -> f32 {
    let sum: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    (sum.sqrt() as f32) / a.len() as f32
}

/// Q4_K and Q6_K: gguf-py decodes our bytes to exactly our decoding, on test-quantize-fns'
/// data (its four series), the edge-case blocks and 4096 super-blocks of random values; and the total error on
/// that data (`test_size = 32·128`, offset 0, amplitude 2) is below its
/// `MAX_QUANTIZATION_TOTAL_ERROR = 0.002`, the bound it sets for both.
#[test]
#[ignore = "needs gguf-py (set MEMWALL_GGUF_PY): .ci/run provides it"]
fn gguf_py_decodes_our_k_quants_as_we_do_within_llama_cpps_error_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let n = 32 * 128;
    let series = [
        generate_data(0.0, n, 2.0),
        generate_data(1.0, n, 2.0),
        generate_data(3.0, n, 1.0),
        generate_data(4.0, n, 1.5),
    ];
    // The edge blocks whose squares stay finite (Q4_K sums x²), padded to a super-block.
    let mut x: Vec<f32> = series.concat();
    let edges: Vec<f32> = edge_blocks()
        .chunks(32)
        .filter(|b| b.iter().all(|v| v.abs() < 1e15))
        .flatten()
        .copied()
        .collect();
    x.extend(&edges);
    x.resize(x.len().div_ceil(256) * 256, 0.5);
    x.extend(random_blocks(31, 256 * 4096));
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        let q = ours(ty, &x);
        let (qp, yp) = (tmp.path().join("q.bin"), tmp.path().join("y.f32"));
        std::fs::write(&qp, &q).unwrap();
        gguf_py(&[
            "dequantize".as_ref(),
            ty.name.as_ref(),
            qp.as_ref(),
            yp.as_ref(),
        ]);
        let theirs = read_f32(&yp);
        let mut mine = vec![0f32; x.len()];
        dequantize(ty, &q, &mut mine).unwrap();
        assert_eq!(theirs.len(), mine.len(), "{ty}");
        let first = (0..mine.len()).find(|&i| mine[i].to_bits() != theirs[i].to_bits());
        assert_eq!(first, None, "{ty}: first value decoded differently");
        let total = array_rmse(&x[..n], &mine[..n]);
        assert!(total < 0.002, "{ty}: total quantization error {total}");
    }
}
