//! Slice conversions of the CPU kernels between the storage types ([`Elem`]) and f32:
//! `cast`/`as_f32` view a slice as the type it is when that is the one asked for (the f32
//! fast paths, which read operands in place), `as_words` lends f32 scratch as 32-bit words,
//! `widen_row`/`narrow_row` convert a row to and from f32 (f16 through `half`'s F16C slice
//! conversion, multiversioned), and `bf16_bits` rounds one f32 to bf16 bits as `half` does.
//! The element types themselves, and their scalar conversions, are [`crate::dtype`]'s.

use super::features::multiversion;
use crate::dtype::Elem;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use std::any::TypeId;

/// `x` as `&[U]` when `T` is `U`.
pub(crate) fn cast<T: 'static, U: 'static>(x: &[T]) -> Option<&[U]> {
    (TypeId::of::<T>() == TypeId::of::<U>()).then(|| {
        // SAFETY: T and U are the same type, so the layout is the same.
        unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<U>(), x.len()) }
    })
}

/// `x` as `&mut [U]` when `T` is `U`.
pub(crate) fn cast_mut<T: 'static, U: 'static>(x: &mut [T]) -> Option<&mut [U]> {
    (TypeId::of::<T>() == TypeId::of::<U>()).then(|| {
        // SAFETY: T and U are the same type; the borrow is moved into the result.
        unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<U>(), x.len()) }
    })
}

/// The slice as f32 when `T` is f32 (for the f32 fast paths of generic kernels).
pub(crate) fn as_f32<T: Elem>(x: &[T]) -> Option<&[f32]> {
    cast(x)
}

/// The slice as f32 when `T` is f32.
pub(crate) fn as_f32_mut<T: Elem>(x: &mut [T]) -> Option<&mut [f32]> {
    cast_mut(x)
}

/// f32 scratch reused as 32-bit words (the dot-product path's packing buffer).
pub(crate) fn as_words(x: &mut [f32]) -> &mut [u32] {
    // SAFETY: f32 and u32 have the same size and alignment, and every bit pattern is valid
    // for both; the borrow is moved into the result.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<u32>(), x.len()) }
}

multiversion! {
    /// dst[i] = src[i].to_f32() (f16 through `half`'s F16C slice conversion).
    pub(crate) fn widen_row<T: Elem>(
        dst: &mut [f32], // [len]
        src: &[T],       // [len]
    ) {
        if let Some(s) = cast::<T, f16>(src) {
            s.convert_to_f32_slice(dst);
            return;
        }
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
}

multiversion! {
    /// dst[i] = T::from_f32(src[i]) (f16 through `half`'s F16C slice conversion, which
    /// rounds like `f16::from_f32`).
    pub(crate) fn narrow_row<T: Elem>(
        dst: &mut [T], // [len]
        src: &[f32],   // [len]
    ) {
        if let Some(d) = cast_mut::<T, f16>(dst) {
            d.convert_from_f32_slice(src);
            return;
        }
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = T::from_f32(s);
        }
    }
}

/// The bits of `x` rounded to bf16 (as `half::bf16::from_f32`: to nearest even, NaN kept
/// quiet), in the low 16 bits.
#[inline(always)]
pub(crate) fn bf16_bits(x: f32) -> u32 {
    bf16::from_f32(x).to_bits() as u32
}
