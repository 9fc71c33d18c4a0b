//! Element types: the crate's vocabulary for what a buffer holds, shared by the planner, the
//! backends, checkpoints and collectives (as candle's `dtype.rs`).
//!
//! - [`DType`]: how a plan buffer's bytes are laid out: elements of one type (f32, bf16, ...),
//!   or the values of ggml blocks ([`DType::Ggml`], a quantized LoRA base), with the byte
//!   count of a number of elements ([`DType::bytes_for`]) and the name in plan.json.
//! - [`Elem`]: a storage type kernels and collectives compute on: f32, bf16 and f16. Kernels
//!   are generic over it: they load elements into f32, compute in f32 (f32 accumulation
//!   everywhere), and round once when storing. For `f32` the conversions are the identity, so
//!   the f32 instantiation of a generic kernel is the f32 kernel.
//! - [`ggml`] ([`GgmlType`]: a GGUF tensor type's id, ggml name and block geometry) and
//!   [`dequant`] (ggml blocks decoded to f32 exactly as llama.cpp decodes them): a quantized
//!   LoRA base is a storage type like the others, which the planner lays out, the CPU
//!   backend's quantized GEMM decodes and `gguf` reads and writes, so it lives here, below
//!   all three.
//!
//! [`Elem`]'s conversions are written branch-free (selects, no calls) so loops over them
//! vectorise. bf16: widening is a 16-bit shift; narrowing rounds to nearest even by adding
//! `0x7FFF + lsb` before truncating, and keeps a NaN a quiet NaN (the carry of the rounding
//! would otherwise turn some NaN payloads into an infinity or even ±0.0, hiding the
//! non-finite value loss scaling and the trainer check for). f16: integer rebiasing of the
//! exponent, with the subnormal range done by an exact f32 multiply / add; `half::f16`'s own
//! conversions test for the F16C instruction set at run time on every call, which keeps loops
//! scalar. All give bitwise the results of the `half` crate, NaNs included, except that bf16
//! widening keeps a signalling NaN signalling (tests check every bf16 and f16 value and a
//! dense sample of f32 values, all rounding ties included).
//!
//! Slice conversions that need the CPU's instruction sets live with the CPU backend
//! (`backend::cpu::elem`). This module imports nothing of the crate, so every layer can
//! stand on it.

pub mod dequant;
pub mod ggml;

pub use ggml::GgmlType;

use half::{bf16, f16};
use serde::Serialize;

/// How a buffer stores its elements: one element type, or ggml blocks.
///
/// A buffer's `elems` counts its values in every case; its bytes are
/// [`DType::bytes_for`]`(elems)`. Of blocks ([`DType::Ggml`]), a buffer holds whole blocks
/// only: value `i` is in block `i / block_size`, and no element has a byte size of its own
/// ([`DType::size`] is `None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// Step scalars kept in plan buffers (the gradient norm's shares).
    F64,
    U32,
    Bf16,
    F16,
    I8,
    U8,
    /// Values stored as ggml blocks of a type (a LoRA plan's frozen base kept quantized,
    /// `--base-quant`; the layouts: [`dequant`]).
    Ggml(GgmlType),
}

impl DType {
    /// Bytes of one element; `None` for ggml blocks, whose values share their block's bytes.
    pub fn size(self) -> Option<usize> {
        Some(match self {
            DType::F64 => 8,
            DType::F32 | DType::U32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::I8 | DType::U8 => 1,
            DType::Ggml(_) => return None,
        })
    }

    /// Bytes of `n` elements: `n × size`, or for ggml blocks the blocks' bytes
    /// ([`GgmlType::bytes_for`]). `None` when `n` values are not a whole number of blocks, or
    /// the count overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        match (self, self.size()) {
            (DType::Ggml(t), _) => t.bytes_for(n),
            (_, Some(size)) => n.checked_mul(size as u64),
            (_, None) => None,
        }
    }

    /// The ggml block type of a buffer stored as blocks; `None` for an element type.
    pub fn ggml(self) -> Option<GgmlType> {
        match self {
            DType::Ggml(t) => Some(t),
            _ => None,
        }
    }
}

/// The name in plan.json and in op kinds: `f32`, `bf16`, ..., and for blocks the ggml
/// type's name in lower case (`q4_0`, `q8_0`; ggml's `bf16` is spelled as the element type,
/// whose layout it has).
impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::U32 => "u32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Ggml(t) => return f.write_str(&t.name.to_ascii_lowercase()),
        })
    }
}

/// As its name ([`DType`]'s `Display`).
impl Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

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
        // A NaN is truncated and made quiet (as `half` does), never rounded.
        let bits = if x.is_nan() { b | 0x0040_0000 } else { rounded };
        bf16::from_bits((bits >> 16) as u16)
    }
}

impl Elem for f16 {
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        let h = self.to_bits() as u32;
        let sign = (h & 0x8000) << 16;
        let em = h & 0x7FFF; // exponent and mantissa
        // Normal: rebias the exponent by 127 - 15.
        let normal = (em << 13) + (112 << 23);
        // Subnormal (and zero): mantissa · 2^-24, exact, and a normal f32.
        let sub = (em as f32 * (1.0 / 16_777_216.0)).to_bits();
        // Infinity, or NaN with its payload, made quiet.
        let special = if em > 0x7C00 {
            (em << 13) | 0x7FC0_0000
        } else {
            0x7F80_0000
        };
        let bits = if em >= 0x7C00 {
            special
        } else if em < 0x0400 {
            sub
        } else {
            normal
        };
        f32::from_bits(sign | bits)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> f16 {
        let b = x.to_bits();
        let sign = (b >> 16) & 0x8000;
        let a = b & 0x7FFF_FFFF; // |x|
        // Normal result: rebias the exponent by 15 - 127 and round to nearest even at bit 13
        // (add 0xFFF plus the lowest kept bit, then truncate).
        let normal = a
            .wrapping_sub(112 << 23)
            .wrapping_add(0xFFF + ((a >> 13) & 1))
            >> 13;
        // Subnormal result (|x| < 2^-14): adding 0.5 leaves round(|x| / 2^-24) (to nearest
        // even, by the f32 addition) in the low mantissa bits.
        let sub = (f32::from_bits(a) + 0.5)
            .to_bits()
            .wrapping_sub(0x3F00_0000);
        // |x| ≥ 65536 (or rounding to it): infinity; NaN: truncated payload, made quiet.
        let special = if a > 0x7F80_0000 {
            0x7E00 | ((a >> 13) & 0x3FF)
        } else {
            0x7C00
        };
        let h = if a >= 0x4780_0000 {
            special
        } else if a < 0x3880_0000 {
            sub
        } else {
            normal
        };
        f16::from_bits((sign | h) as u16)
    }
}

/// true when `T` is `f32`, so that `to_f32`/`from_f32` are the identity. A constant after
/// monomorphisation: kernels use it to keep the f32 instantiation on the f32 code path (for
/// example reading operands in place instead of converting them to scratch).
#[inline(always)]
pub fn is_f32<T: Elem>() -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_names() {
        assert_eq!(DType::F32.bytes_for(3), Some(12));
        assert_eq!(DType::U8.bytes_for(3), Some(3));
        assert_eq!(DType::F64.bytes_for(u64::MAX / 4), None);
        // Blocks: 64 values of Q4_0 are two blocks of 18 bytes; 33 are not whole blocks.
        let q = DType::Ggml(GgmlType::Q4_0);
        assert_eq!(
            (q.size(), q.bytes_for(64), q.bytes_for(33)),
            (None, Some(36), None)
        );
        assert_eq!(q.ggml(), Some(GgmlType::Q4_0));
        assert_eq!(DType::Bf16.ggml(), None);
        let names = [
            (DType::F32, "f32"),
            (DType::F64, "f64"),
            (DType::U32, "u32"),
            (DType::Bf16, "bf16"),
            (DType::F16, "f16"),
            (DType::I8, "i8"),
            (DType::U8, "u8"),
            (q, "q4_0"),
            (DType::Ggml(GgmlType::Q6_K), "q6_k"),
            (DType::Ggml(GgmlType::BF16), "bf16"),
        ];
        for (d, name) in names {
            assert_eq!(d.to_string(), name);
            assert_eq!(serde_json::to_string(&d).unwrap(), format!("\"{name}\""));
        }
    }

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

    /// f32 values to test narrowing on: a dense stride over all bit patterns (every sign,
    /// exponent, NaN and infinity), and for every pair of neighbouring `T` values the exact
    /// midpoint (a rounding tie) and its two f32 neighbours.
    fn narrowing_cases<T: Elem>(from_bits: impl Fn(u16) -> T) -> Vec<f32> {
        let mut v: Vec<f32> = (0..=u32::MAX).step_by(997).map(f32::from_bits).collect();
        v.extend([
            0.0,
            -0.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-45,
            f32::NAN,
            -f32::NAN,
        ]);
        v.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x7FFF_FFFF),
        ]);
        v.extend([f32::from_bits(0xFFFF_FFFF), f32::from_bits(0x7F80_0001)]);
        for h in 0..=u16::MAX {
            let (lo, hi) = (from_bits(h).to_f32(), from_bits(h.wrapping_add(1)).to_f32());
            if !lo.is_finite() || !hi.is_finite() {
                continue;
            }
            let mid = ((lo as f64 + hi as f64) / 2.0) as f32; // exact: one more bit
            let m = mid.to_bits();
            v.extend([
                mid,
                f32::from_bits(m.wrapping_sub(1)),
                f32::from_bits(m + 1),
            ]);
        }
        v
    }

    #[test]
    fn bf16_matches_half_bitwise_including_nan() {
        for x in narrowing_cases(bf16::from_bits) {
            let (got, want) = (<bf16 as Elem>::from_f32(x), bf16::from_f32(x));
            assert_eq!(got.to_bits(), want.to_bits(), "{:#010x}", x.to_bits());
        }
        for h in 0..=u16::MAX {
            // Widening is a plain shift: a signalling NaN stays signalling (`half` quiets it).
            let b = bf16::from_bits(h);
            if b.is_nan() {
                assert!(Elem::to_f32(b).is_nan());
            } else {
                assert_eq!(Elem::to_f32(b).to_bits(), b.to_f32().to_bits(), "{h:#06x}");
            }
        }
        // The NaNs whose rounding carry would reach the sign bit or leave the NaN range.
        for bits in [0x7FFF_FFFFu32, 0xFFFF_FFFF, 0x7F80_0001, 0x7FFF_8000] {
            assert!(
                <bf16 as Elem>::from_f32(f32::from_bits(bits)).is_nan(),
                "{bits:#x}"
            );
        }
    }

    #[test]
    fn f16_matches_half_bitwise() {
        // Every f16 value widens exactly as `half` does it (payloads of NaNs included).
        for h in 0..=u16::MAX {
            let x = f16::from_bits(h);
            assert_eq!(Elem::to_f32(x).to_bits(), x.to_f32().to_bits(), "{h:#06x}");
        }
        let cases = narrowing_cases(f16::from_bits);
        assert!(cases.len() > 4_000_000);
        for x in cases {
            let (got, want) = (<f16 as Elem>::from_f32(x), f16::from_f32(x));
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{x:e} ({:#010x})",
                x.to_bits()
            );
        }
        // Range ends: largest finite, the first value that rounds to infinity, the smallest
        // subnormal and the largest value that rounds to zero.
        let n = |x: f32| <f16 as Elem>::from_f32(x).to_bits();
        assert_eq!(n(65504.0), 0x7BFF);
        assert_eq!(n(65520.0), 0x7C00);
        assert_eq!(n(-65520.0), 0xFC00);
        assert_eq!(n(2f32.powi(-24)), 0x0001);
        assert_eq!(n(2f32.powi(-25)), 0x0000); // tie: to even (zero)
        assert_eq!(n(f32::from_bits(2f32.powi(-25).to_bits() + 1)), 0x0001);
    }

    #[test]
    fn f32_is_the_identity() {
        let v = [1.5f32, -0.0, 3e-39, f32::MAX];
        let w = v.map(f32::from_f32);
        assert_eq!(v.map(f32::to_bits), w.map(f32::to_bits));
    }
}
