//! The f16 scale fields of ggml blocks: written rounded to nearest even (`GGML_FP32_TO_FP16`),
//! read back widened (`GGML_FP16_TO_FP32`), and ggml's `nearest_int` rounding.

use half::f16;

/// `x` rounded to f16 (nearest even), little-endian at `b[at..at + 2]`.
pub fn put_f16(b: &mut [u8], at: usize, x: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(x).to_le_bytes());
}

/// The little-endian f16 at `b[at..at + 2]`, widened.
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the f32 magic constant
/// 1.5·2²³ (exact for |x| ≤ 2²²).
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12582912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        let got: Vec<i32> = [0.5f32, 1.5, 2.5, -0.5, -1.5, 2.49, -3.7]
            .iter()
            .map(|&x| nearest_int(x))
            .collect();
        assert_eq!(got, [0, 2, 2, 0, -2, 2, -4]);
    }

    #[test]
    fn f16_fields_round_to_nearest_even() {
        let mut b = [0u8; 4];
        // 1 + 2⁻¹¹ is halfway between f16 1.0 and 1 + 2⁻¹⁰: ties to even (1.0).
        put_f16(&mut b, 2, 1.0 + 2f32.powi(-11));
        assert_eq!(f16_at(&b, 2), 1.0);
        put_f16(&mut b, 0, 1.0 + 3.0 * 2f32.powi(-11));
        assert_eq!(f16_at(&b, 0), 1.0 + 2.0 * 2f32.powi(-10));
    }
}
