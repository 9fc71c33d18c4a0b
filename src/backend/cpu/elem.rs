//! Storage element types of activations, weights and gradients: f32, bf16 and f16. Kernels
//! are generic over [`Elem`]: they load elements into f32, compute in f32 (f32 accumulation
//! everywhere), and round once when storing. For `f32` the conversions are the identity, so
//! the f32 instantiation of a generic kernel is the f32 kernel.
//!
//! The bf16 conversions are written branch-free so loops over them vectorise: widening is a
//! 16-bit shift; narrowing rounds to nearest even by adding `0x7FFF + lsb` before truncating
//! (a NaN stays a NaN or becomes an infinity, both non-finite, which is what loss scaling
//! and the trainer check for).

use half::{bf16, f16};

/// An element type kernels can store.
pub trait Elem: Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static {
    /// Name for messages and reports (`f32`, `bf16`, `f16`).
    const NAME: &'static str;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f32 {
        x
    }
}

impl Elem for bf16 {
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> bf16 {
        let b = x.to_bits();
        let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1));
        bf16::from_bits((rounded >> 16) as u16)
    }
}

impl Elem for f16 {
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f16 {
        f16::from_f32(x)
    }
}

/// `dst[i] = T::from_f32(src[i])`.
pub fn narrow<T: Elem>(dst: &mut [T], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "narrow: lengths");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(s);
    }
}

/// `dst[i] = src[i].to_f32()`.
pub fn widen<T: Elem>(dst: &mut [f32], src: &[T]) {
    assert_eq!(dst.len(), src.len(), "widen: lengths");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half() {
        // Round to nearest even, as the `half` crate does, over many bit patterns.
        let mut x = 0x0001_2345u32;
        for _ in 0..200_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let f = f32::from_bits(x);
            if !f.is_finite() {
                continue;
            }
            assert_eq!(
                <bf16 as Elem>::from_f32(f).to_bits(),
                bf16::from_f32(f).to_bits(),
                "{f:e}"
            );
            let b = bf16::from_bits((x >> 16) as u16);
            if b.is_finite() {
                assert_eq!(Elem::to_f32(b), b.to_f32());
            }
        }
        assert!(!<bf16 as Elem>::from_f32(f32::NAN).to_f32().is_finite());
        assert_eq!(<bf16 as Elem>::from_f32(f32::MAX).to_f32(), f32::INFINITY);
    }

    #[test]
    fn f32_is_the_identity() {
        let v = [1.5f32, -0.0, 3e-39, f32::MAX];
        let mut w = [0f32; 4];
        narrow(&mut w, &v);
        assert_eq!(v, w);
    }
}
