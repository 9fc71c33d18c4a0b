//! The machine's arithmetic ceiling, measured rather than looked up: every thread of the
//! current rayon pool runs a register-only chain of fused multiply-adds, and the pool's
//! total rate is the peak no kernel on this machine can beat at that moment. Each loop the
//! CPU can run is measured: AVX2 + FMA (8 f32 lanes), AVX-512F (16) and AVX512_BF16's
//! `vdpbf16ps` (32 bf16 products into 16 f32 lanes). The ceiling of fp32 figures is the
//! widest f32 loop any kernel of the step uses ([`super::features::widest_in_use`]): the
//! `gemm` crate picks AVX-512 where the CPU has it, whatever `MEMWALL_CPU_ISA` says, unless
//! the build leaves out the `avx512-gemm` feature; so the AVX2 ceiling applies on an AVX-512
//! machine to a `--no-default-features` build run with `MEMWALL_CPU_ISA=avx2`. `memwall bench` reports it before and after its timed
//! steps, so a throughput figure comes with the ceiling of the same sitting (on a shared
//! virtual machine the ceiling itself moves: a sibling hyperthread or another guest can take
//! a core away).
//!
//! Each loop keeps enough independent accumulators to cover the FMA latency times the FMA
//! pipes of current x86 cores (4 cycles × 2 pipes = 8) with room to spare, and no more than
//! its register file holds beside the two constant operands: [`AVX2_CHAINS`] of the 16 YMM
//! registers, [`AVX512_CHAINS`] of the 32 ZMM ones. (Sixteen AVX2 chains, as this file once
//! had, spill two accumulators to the stack and shuffle the rest through moves each
//! iteration: on an AVX2-only Zen 3 that measured below what the GEMMs reached.) A loop
//! touches no memory and returns the sum of its accumulators so the work cannot be
//! optimised away; the tests check that sum against a scalar twin, which proves the loop
//! performs the multiply-adds it is credited with.
//!
//! The implied clock is the per-thread rate over two pipes' worth of each instruction per
//! cycle: near the core's real clock where the core has two such pipes (Skylake-SP Gold and
//! Platinum, Zen 3/4/5 for f32 FMAs, Zen 4/5 for `vdpbf16ps`), half of it where it has one,
//! and a quarter for `vdpbf16ps` on an Intel Emerald Rapids core (0.61–0.68 GHz implied
//! against 2.5–3.0 for its FMAs: one every two cycles, half the flops of its f32 FMAs).

use super::features::{Isa, features};
use crate::backend::{IsaPeak, Peak};

/// Independent accumulator vectors of the AVX2 loop (16 YMM registers: 12 + 2 constants).
pub const AVX2_CHAINS: usize = 12;
/// Independent accumulator vectors of the AVX-512 loops (32 ZMM registers: 24 + 2).
pub const AVX512_CHAINS: usize = 24;

/// The multiplier and addend of every step of an f32 chain: `acc = acc · MUL + ADD`. Both
/// keep the accumulators bounded (|acc| stays near `ADD / (1 − MUL)`), so no chain overflows
/// or becomes denormal however long it runs.
const MUL: f32 = 0.999_999;
const ADD: f32 = 1e-4;

/// The bf16 pair of every step of a `vdpbf16ps` chain: `acc += X·Y + X·Y` in each lane, with
/// `X = Y = 2⁻⁷` (bf16 `0x3C00`): each product is 2⁻¹⁴, exact, so the twin can match the
/// instruction bit for bit while the sum stays below 2¹⁰; past that the additions round (to
/// even) and the chain stops growing, never overflowing.
const BF16_X: u16 = 0x3C00;

/// A loop this CPU may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loop {
    Avx2,
    Avx512,
    Avx512Bf16,
}

impl Loop {
    /// Every loop, widest f32 first.
    const ALL: [Loop; 3] = [Loop::Avx512, Loop::Avx2, Loop::Avx512Bf16];

    fn available(self) -> bool {
        let f = features();
        match self {
            Loop::Avx2 => f.avx2 && f.fma,
            Loop::Avx512 => f.avx512f,
            Loop::Avx512Bf16 => f.avx512f && f.avx512bf16,
        }
    }

    fn chains(self) -> usize {
        match self {
            Loop::Avx2 => AVX2_CHAINS,
            Loop::Avx512 | Loop::Avx512Bf16 => AVX512_CHAINS,
        }
    }

    /// f32 accumulator lanes of one vector.
    fn lanes(self) -> usize {
        match self {
            Loop::Avx2 => 8,
            Loop::Avx512 | Loop::Avx512Bf16 => 16,
        }
    }

    /// Flops of one instruction: 2 per lane for an FMA, 4 for `vdpbf16ps` (two products,
    /// two additions).
    fn flops_per_instruction(self) -> usize {
        match self {
            Loop::Avx2 | Loop::Avx512 => 2 * self.lanes(),
            Loop::Avx512Bf16 => 4 * self.lanes(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Loop::Avx2 => "avx2+fma",
            Loop::Avx512 => "avx512f",
            Loop::Avx512Bf16 => "avx512_bf16",
        }
    }

    /// Runs `iters` steps of every chain; returns the sum of all lanes of all accumulators.
    /// Panics when the CPU lacks the loop's instructions.
    fn run(self, iters: usize) -> f32 {
        assert!(
            self.available(),
            "this CPU cannot run the {} loop",
            self.name()
        );
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `available` checked the features each variant is compiled for.
            unsafe {
                match self {
                    Loop::Avx512 => x86::chains_avx512(iters),
                    Loop::Avx2 => x86::chains_avx2(iters),
                    Loop::Avx512Bf16 => x86::chains_avx512_bf16(iters),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = iters;
            unreachable!("no vector loop is available off x86_64")
        }
    }

    /// The pool's rate (GFLOP/s): the fastest of `rounds` rounds of about
    /// `seconds_per_round` on every thread at once.
    fn measure(self, rounds: usize, seconds_per_round: f64) -> IsaPeak {
        let threads = rayon::current_num_threads();
        let flops_per_iter = (self.chains() * self.flops_per_instruction()) as f64;
        // Calibrate on one thread: iterations for the round length at this thread's rate.
        let probe = 1 << 16;
        let t = std::time::Instant::now();
        std::hint::black_box(self.run(probe));
        let rate = probe as f64 / t.elapsed().as_secs_f64().max(1e-9);
        let iters = ((rate * seconds_per_round) as usize).max(probe);
        let mut best = 0.0f64;
        for _ in 0..rounds.max(1) {
            let t = std::time::Instant::now();
            let sums = rayon::broadcast(|_| self.run(iters));
            let s = t.elapsed().as_secs_f64().max(1e-9);
            std::hint::black_box(sums);
            best = best.max(threads as f64 * iters as f64 * flops_per_iter / s / 1e9);
        }
        IsaPeak {
            isa: self.name(),
            gflops_per_s: best,
            implied_ghz: best / threads as f64 / (2 * self.flops_per_instruction()) as f64,
        }
    }
}

/// The starting value of chain `j` (distinct per chain, so the twin test sees every chain).
fn start(j: usize) -> f32 {
    j as f32 * 1e-3
}

/// Measures every loop this CPU has on the current pool (see the module doc); the peak is
/// the f32 loop of the widest vectors the step's kernels use. `None` when the CPU has neither AVX-512F nor AVX2 + FMA (there is
/// no vector loop to measure).
pub fn measure(rounds: usize, seconds_per_round: f64) -> Option<Peak> {
    let by_isa: Vec<IsaPeak> = Loop::ALL
        .into_iter()
        .filter(|l| l.available())
        .map(|l| l.measure(rounds, seconds_per_round))
        .collect();
    let ceiling = match super::features::widest_in_use() {
        Isa::Avx512 => Loop::Avx512,
        Isa::Avx2 | Isa::Baseline => Loop::Avx2,
    };
    let f32_peak = by_isa.iter().find(|p| p.isa == ceiling.name())?;
    Some(Peak {
        gflops_per_s: f32_peak.gflops_per_s,
        threads: rayon::current_num_threads(),
        isa: f32_peak.isa,
        implied_ghz: f32_peak.implied_ghz,
        by_isa,
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ADD, AVX2_CHAINS, AVX512_CHAINS, BF16_X, MUL, start};
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Runs `$iters` steps of the chains `$a` (chain `j` initialised by `$init(j)`), each in
    /// its own register `$r`, every step `$insn r, X, Y` with the operands `$x` and `$y` in
    /// the registers `$xr` and `$yr`; returns the sum of `$reduce` over the chains. Written
    /// in assembly with named registers so that every accumulator stays in a register
    /// whatever the compiler would do: as Rust, LLVM spilled AVX-512 accumulators to the
    /// stack though registers were free, and the `zmm_reg` class offers only 16 of the 32.
    macro_rules! chains {
        ($insn:literal, $iters:expr, $x:expr => $xr:tt, $y:expr => $yr:tt,
         $init:expr, $reduce:expr; $($a:ident $r:tt)*) => {{
            let [$(mut $a),*] = std::array::from_fn($init);
            let iters: usize = $iters;
            if iters > 0 {
                // SAFETY: register-only arithmetic; the caller's target features include
                // the instruction's.
                unsafe {
                    asm!(
                        "2:",
                        $(concat!($insn, " ", $r, ", ", $xr, ", ", $yr),)*
                        "dec {n}",
                        "jnz 2b",
                        n = inout(reg) iters => _,
                        in($xr) $x,
                        in($yr) $y,
                        $(inout($r) $a,)*
                        options(nomem, nostack),
                    );
                }
            }
            [$($a),*].into_iter().map($reduce).sum::<f32>()
        }};
    }

    /// `a = a · MUL + ADD` (`vfmadd213ps a, mul, add`) on 24 ZMM chains.
    #[target_feature(enable = "avx512f")]
    pub(super) fn chains_avx512(iters: usize) -> f32 {
        const _: () = assert!(AVX512_CHAINS == 24);
        chains!(
            "vfmadd213ps", iters, _mm512_set1_ps(MUL) => "zmm30", _mm512_set1_ps(ADD) => "zmm31",
            |j| _mm512_set1_ps(start(j)), |a| _mm512_reduce_add_ps(a);
            a0 "zmm0" a1 "zmm1" a2 "zmm2" a3 "zmm3" a4 "zmm4" a5 "zmm5" a6 "zmm6" a7 "zmm7" a8 "zmm8" a9 "zmm9" a10 "zmm10" a11 "zmm11" a12 "zmm12" a13 "zmm13" a14 "zmm14" a15 "zmm15" a16 "zmm16" a17 "zmm17" a18 "zmm18" a19 "zmm19" a20 "zmm20" a21 "zmm21" a22 "zmm22" a23 "zmm23"
        )
    }

    /// `a += x·x + x·x` per f32 lane (`vdpbf16ps a, x, x`) on 24 ZMM chains.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) fn chains_avx512_bf16(iters: usize) -> f32 {
        let x = _mm512_set1_epi16(BF16_X as i16);
        chains!(
            "vdpbf16ps", iters, x => "zmm30", x => "zmm31",
            |j| _mm512_set1_ps(start(j)), |a| _mm512_reduce_add_ps(a);
            a0 "zmm0" a1 "zmm1" a2 "zmm2" a3 "zmm3" a4 "zmm4" a5 "zmm5" a6 "zmm6" a7 "zmm7" a8 "zmm8" a9 "zmm9" a10 "zmm10" a11 "zmm11" a12 "zmm12" a13 "zmm13" a14 "zmm14" a15 "zmm15" a16 "zmm16" a17 "zmm17" a18 "zmm18" a19 "zmm19" a20 "zmm20" a21 "zmm21" a22 "zmm22" a23 "zmm23"
        )
    }

    /// `a = a · MUL + ADD` on 12 YMM chains.
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn chains_avx2(iters: usize) -> f32 {
        const _: () = assert!(AVX2_CHAINS == 12);
        chains!(
            "vfmadd213ps", iters, _mm256_set1_ps(MUL) => "ymm14", _mm256_set1_ps(ADD) => "ymm15",
            |j| _mm256_set1_ps(start(j)),
            |a: __m256| {
                let mut lanes = [0.0f32; 8];
                // SAFETY: `lanes` holds 8 f32.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
                lanes.iter().sum::<f32>()
            };
            a0 "ymm0" a1 "ymm1" a2 "ymm2" a3 "ymm3" a4 "ymm4" a5 "ymm5" a6 "ymm6" a7 "ymm7" a8 "ymm8" a9 "ymm9" a10 "ymm10" a11 "ymm11"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar twin: the same chains, one lane each, with the same rounding.
    fn chains_naive(l: Loop, iters: usize) -> f64 {
        let x = half::bf16::from_bits(BF16_X).to_f32();
        (0..l.chains())
            .map(|j| {
                let mut a = start(j);
                for _ in 0..iters {
                    a = match l {
                        Loop::Avx2 | Loop::Avx512 => a.mul_add(MUL, ADD),
                        // Two exact products added one at a time.
                        Loop::Avx512Bf16 => a + x * x + x * x,
                    };
                }
                a as f64 * l.lanes() as f64
            })
            .sum()
    }

    /// The vector loop `l` against its scalar twin; panics when the CPU lacks it.
    fn loop_does_the_work_of_its_scalar_twin(l: Loop) {
        for iters in [0, 1, 7, 1000, 100_000] {
            let got = l.run(iters) as f64;
            let want = chains_naive(l, iters);
            // Same per-lane arithmetic; only the final sum's order differs.
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{} {iters} iterations: vector loop {got}, scalar twin {want}",
                l.name()
            );
        }
        // The result depends on the iteration count, so no iteration can be skipped.
        assert_ne!(l.run(1000), l.run(1001), "{}", l.name());
    }

    /// The AVX2 + FMA loop (every x86-64 CPU memwall targets has AVX2 + FMA; the test fails
    /// on one without).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_loop_does_the_multiply_adds_of_its_scalar_twin() {
        loop_does_the_work_of_its_scalar_twin(Loop::Avx2);
    }

    #[test]
    #[ignore = "needs AVX-512F"]
    fn avx512_loop_does_the_multiply_adds_of_its_scalar_twin() {
        loop_does_the_work_of_its_scalar_twin(Loop::Avx512);
    }

    #[test]
    #[ignore = "needs AVX512_BF16"]
    fn avx512bf16_loop_does_the_dot_products_of_its_scalar_twin() {
        loop_does_the_work_of_its_scalar_twin(Loop::Avx512Bf16);
    }

    #[test]
    fn measure_reports_every_loop_of_the_cpu_for_the_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let peak = pool.install(|| measure(2, 0.002));
        let available: Vec<&str> = Loop::ALL
            .into_iter()
            .filter(|l| l.available())
            .map(Loop::name)
            .collect();
        let Some(p) = peak else {
            assert!(available.is_empty(), "{available:?} but no peak");
            return;
        };
        let names: Vec<&str> = p.by_isa.iter().map(|i| i.isa).collect();
        assert_eq!(names, available);
        let widest = match crate::backend::cpu::features::widest_in_use() {
            Isa::Avx512 => "avx512f",
            _ => "avx2+fma",
        };
        assert_eq!((p.threads, p.isa), (2, widest));
        for i in &p.by_isa {
            assert!(i.gflops_per_s.is_finite() && i.gflops_per_s > 0.0, "{i:?}");
            assert!(i.implied_ghz > 0.0, "{i:?}");
        }
        let of_widest = p.by_isa.iter().find(|i| i.isa == widest).unwrap();
        assert_eq!(p.gflops_per_s, of_widest.gflops_per_s);
    }
}
