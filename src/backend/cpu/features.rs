//! What this CPU can run, detected once per process, and the choices that follow from it:
//! every CPU-feature test of the backend (and of the executor's f16 check) reads
//! [`features`], so there is one place to look and one place to fake for a test.
//!
//! - [`Features`]: the instruction-set extensions the kernels use (AVX2, FMA, AVX-512F/BW/VL,
//!   AVX512_BF16, F16C), all false off x86-64.
//! - [`Isa`], [`isa`], [`set_isa`]: the vector width the elementwise loops run at, capped by
//!   the `MEMWALL_CPU_ISA` environment variable (`baseline`, `avx2` or `avx512`), and the
//!   `multiversion!` macro that dispatches on it.
//! - [`bf16_dot_request`]: what `MEMWALL_BF16_DOT` asks of the bf16 dot-product GEMM (`off`
//!   or `0`: the widening path; `emulated`: the instruction emulated; otherwise the hardware
//!   instruction where the CPU has it); [`crate::backend::cpu::gemm::mixed::bf16_dot`]
//!   turns it into the kernel variant, once per process.
//!
//! Vector width: the crate is built for baseline x86-64 (SSE2), so the hot loops of all CPU
//! kernels are wrapped in `multiversion!`, which compiles them again for AVX2+FMA and AVX-512
//! and picks one at run time ([`isa`]). The arithmetic is written without `mul_add`, so every
//! variant gives bit-identical results (tests check this); only the speed differs.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction-set extensions of this CPU that the kernels use (all false off x86-64).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    pub avx2: bool,
    pub fma: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    /// The bf16 dot product `vdpbf16ps`.
    pub avx512bf16: bool,
    /// Hardware f16 ↔ f32 conversion.
    pub f16c: bool,
}

/// This CPU's features, detected on the first call.
pub fn features() -> &'static Features {
    static DETECTED: OnceLock<Features> = OnceLock::new();
    DETECTED.get_or_init(detect)
}

fn detect() -> Features {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        Features {
            avx2: has!("avx2"),
            fma: has!("fma"),
            avx512f: has!("avx512f"),
            avx512bw: has!("avx512bw"),
            avx512vl: has!("avx512vl"),
            avx512bf16: has!("avx512bf16"),
            f16c: has!("f16c"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Features::default()
    }
}

/// Whether this CPU has the AVX512_BF16 dot product (`vdpbf16ps`).
pub fn cpu_has_bf16_dot() -> bool {
    features().avx512bf16
}

/// Whether the CPU converts f16 in hardware: F16C on x86-64; always on aarch64.
pub fn f16_conversions_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        features().f16c
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        cfg!(target_arch = "aarch64")
    }
}

/// Vector instruction set the elementwise loops are compiled for (see `multiversion!`).
/// Every variant performs the same arithmetic in the same order (no FMA contraction), so
/// results are bit-identical whichever one runs; only the speed differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The build's baseline target (SSE2 on x86-64).
    Baseline = 1,
    /// AVX2 + FMA.
    Avx2 = 2,
    /// AVX-512F (+ AVX2, FMA).
    Avx512 = 3,
}

static ISA: AtomicU8 = AtomicU8::new(0);

/// The best instruction set this CPU supports.
pub fn detected_isa() -> Isa {
    let f = features();
    let avx2 = f.avx2 && f.fma;
    if avx2 && f.avx512f {
        return Isa::Avx512;
    }
    if avx2 {
        return Isa::Avx2;
    }
    Isa::Baseline
}

/// The instruction set in use: the detected one, capped by `MEMWALL_CPU_ISA`
/// (`baseline`, `avx2` or `avx512`) when that is set, or by [`set_isa`].
#[inline]
pub fn isa() -> Isa {
    match ISA.load(Ordering::Relaxed) {
        1 => Isa::Baseline,
        2 => Isa::Avx2,
        3 => Isa::Avx512,
        _ => {
            let cap = match std::env::var("MEMWALL_CPU_ISA").as_deref() {
                Ok("baseline") => Isa::Baseline,
                Ok("avx2") => Isa::Avx2,
                _ => Isa::Avx512,
            };
            set_isa(cap)
        }
    }
}

/// The instruction set the `gemm` crate's f32 kernels use: AVX-512 where the CPU has it and
/// the build has the `avx512-gemm` feature (the default), else AVX2 + FMA (or the baseline).
/// `MEMWALL_CPU_ISA` does not reach it: the crate detects the CPU itself.
pub fn gemm_isa() -> Isa {
    let detected = detected_isa();
    if detected == Isa::Avx512 && !cfg!(feature = "avx512-gemm") {
        Isa::Avx2
    } else {
        detected
    }
}

/// The widest f32 vectors any kernel of a step runs on: [`isa`] for memwall's own, or
/// [`gemm_isa`] for the GEMMs, whichever is wider; the ceiling of a step's fp32 rate.
pub fn widest_in_use() -> Isa {
    isa().max(gemm_isa())
}

/// Caps the instruction set at `want` (never above what the CPU supports); returns the one
/// now in use. For benchmarks and tests; the results do not depend on it.
pub fn set_isa(want: Isa) -> Isa {
    let got = want.min(detected_isa());
    ISA.store(got as u8, Ordering::Relaxed);
    got
}

/// What `MEMWALL_BF16_DOT` asks of bf16 products (read on each call; the GEMM reads it once,
/// see [`crate::backend::cpu::gemm::mixed::bf16_dot`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16DotRequest {
    /// `off` or `0`: the widening path, to compare the two on one machine.
    Off,
    /// `emulated`: the dot-product path with `vdpbf16ps` emulated (slow; to exercise the
    /// path on CPUs without the instruction).
    Emulated,
    /// Unset or anything else: the `vdpbf16ps` kernel where the CPU has it.
    Hardware,
}

/// The request `MEMWALL_BF16_DOT` makes now.
pub fn bf16_dot_request() -> Bf16DotRequest {
    match std::env::var("MEMWALL_BF16_DOT").as_deref() {
        Ok("off" | "0") => Bf16DotRequest::Off,
        Ok("emulated") => Bf16DotRequest::Emulated,
        _ => Bf16DotRequest::Hardware,
    }
}

/// Defines a function whose body is compiled three times (baseline, AVX2+FMA, AVX-512) and
/// dispatched on [`isa()`] at each call, so auto-vectorised loops use the widest vectors the
/// CPU has although the crate is built for baseline x86-64. Call it on whole chunks (the
/// dispatch is one relaxed atomic load), never per element. The function may have type
/// parameters with one bound each (`fn f<T: Elem>(x: &[T])`); each instantiation is
/// multiversioned.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident $(<$($g:ident : $b:path),+ $(,)?>)?
        ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(<$($g: $b),+>)? ($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn inner $(<$($g: $b),+>)? ($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v512 $(<$($g: $b),+>)? ($($arg: $ty),*) $(-> $ret)? {
                    inner $(::<$($g),+>)? ($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v256 $(<$($g: $b),+>)? ($($arg: $ty),*) $(-> $ret)? {
                    inner $(::<$($g),+>)? ($($arg),*)
                }
                match $crate::backend::cpu::features::isa() {
                    // SAFETY: isa() never reports an instruction set the CPU lacks.
                    $crate::backend::cpu::features::Isa::Avx512 => {
                        return unsafe { v512 $(::<$($g),+>)? ($($arg),*) }
                    }
                    // SAFETY: as above.
                    $crate::backend::cpu::features::Isa::Avx2 => {
                        return unsafe { v256 $(::<$($g),+>)? ($($arg),*) }
                    }
                    $crate::backend::cpu::features::Isa::Baseline => {}
                }
            }
            inner $(::<$($g),+>)? ($($arg),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isa_follows_the_features() {
        let f = features();
        let want = if f.avx2 && f.fma && f.avx512f {
            Isa::Avx512
        } else if f.avx2 && f.fma {
            Isa::Avx2
        } else {
            Isa::Baseline
        };
        assert_eq!(detected_isa(), want, "{f:?}");
        assert!(isa() <= detected_isa());
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn features_match_std_detection() {
        use std::arch::is_x86_feature_detected as has;
        assert_eq!(*features(), detect());
        assert_eq!(features().avx512f, has!("avx512f"));
        assert_eq!(cpu_has_bf16_dot(), has!("avx512bf16"));
        assert_eq!(f16_conversions_available(), has!("f16c"));
    }
}
