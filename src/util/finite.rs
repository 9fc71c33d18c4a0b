//! Finding NaN and infinite values in loaded weights: a NaN block scale in a GGUF file or a
//! NaN in a safetensors file would otherwise load silently and show up, steps later, as a
//! NaN loss blamed on the learning rate. The loaders check each block of values as they copy
//! it (one pass over values already in cache) and name the tensor and file.

/// The first value of `xs` that is NaN or infinite, with its index; `None` when all are
/// finite. The common case (all finite) is one branch-free pass the compiler vectorizes.
pub fn first_non_finite(xs: &[f32]) -> Option<(usize, f32)> {
    // Exponent bits all ones is exactly NaN or ±∞.
    const EXP: u32 = 0x7f80_0000;
    let any = xs
        .iter()
        .fold(false, |acc, x| acc | (x.to_bits() & EXP == EXP));
    if !any {
        return None;
    }
    xs.iter().position(|x| !x.is_finite()).map(|i| (i, xs[i]))
}

/// Describes a non-finite value found at element `index` of a tensor of `len` elements,
/// counting how many of the tensor's `values` are non-finite: `element 17 of 4096 is NaN
/// (3 non-finite values)`.
pub fn describe(index: usize, value: f32, len: usize, values: &[f32]) -> String {
    let n = values.iter().filter(|x| !x.is_finite()).count();
    let what = if value.is_nan() {
        "NaN".to_string()
    } else {
        format!("{value}")
    };
    let count = if n > 1 {
        format!(" ({n} non-finite values in this part)")
    } else {
        String::new()
    };
    format!("element {index} of {len} is {what}{count}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_first_nan_or_infinity() {
        assert_eq!(
            first_non_finite(&[0.0, -1.0, f32::MAX, f32::MIN_POSITIVE]),
            None
        );
        assert_eq!(first_non_finite(&[]), None);
        let (i, v) = first_non_finite(&[1.0, f32::NAN, f32::INFINITY]).unwrap();
        assert!(i == 1 && v.is_nan());
        assert_eq!(
            first_non_finite(&[1.0, 2.0, f32::NEG_INFINITY]),
            Some((2, f32::NEG_INFINITY))
        );
        let s = describe(1, f32::NAN, 10, &[1.0, f32::NAN, f32::INFINITY]);
        assert_eq!(
            s,
            "element 1 of 10 is NaN (2 non-finite values in this part)"
        );
        assert_eq!(
            describe(0, f32::INFINITY, 3, &[f32::INFINITY]),
            "element 0 of 3 is inf"
        );
    }
}
