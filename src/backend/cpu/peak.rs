//! The machine's arithmetic ceiling, measured rather than looked up: every thread of the
//! current rayon pool runs a register-only chain of fused multiply-adds at the widest vector
//! width the CPU has (AVX-512F, else AVX2 + FMA), and the pool's total rate is the f32 peak
//! no kernel on this machine can beat at that moment. `memwall bench` reports it before and
//! after its timed steps, so a throughput figure comes with the ceiling of the same sitting
//! (on a shared virtual machine the ceiling itself moves: a sibling hyperthread or another
//! guest can take a core away).
//!
//! The loop keeps [`CHAINS`] independent accumulators per thread (more than the FMA latency
//! times the FMA ports of current x86 cores), touches no memory, and returns the sum of its
//! accumulators so the work cannot be optimised away; the tests check that sum against a
//! scalar twin, which proves the loop performs the multiply-adds it is credited with.

use super::features::features;
use crate::backend::Peak;

/// Independent accumulator vectors per thread.
pub const CHAINS: usize = 16;

/// The multiplier and addend of every step of a chain: `acc = acc · MUL + ADD`. Both keep the
/// accumulators bounded (|acc| stays near `ADD / (1 − MUL)`), so no chain overflows or
/// becomes denormal however long it runs.
const MUL: f32 = 0.999_999;
const ADD: f32 = 1e-4;

/// The vector loop this CPU can run, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Avx512,
    Avx2,
}

impl Isa {
    fn detect() -> Option<Isa> {
        let f = features();
        if f.avx512f {
            return Some(Isa::Avx512);
        }
        if f.avx2 && f.fma {
            return Some(Isa::Avx2);
        }
        None
    }

    fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 => 8,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512f",
            Isa::Avx2 => "avx2+fma",
        }
    }

    /// Runs `iters` steps of every chain; returns the sum of all lanes of all accumulators.
    fn run(self, iters: usize) -> f32 {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `detect` found the features each variant is compiled for.
            unsafe {
                match self {
                    Isa::Avx512 => x86::chains_avx512(iters),
                    Isa::Avx2 => x86::chains_avx2(iters),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = iters;
            unreachable!("no vector loop is detected off x86_64")
        }
    }
}

/// The starting value of chain `j` (distinct per chain, so the twin test sees every chain).
fn start(j: usize) -> f32 {
    j as f32 * 1e-3
}

/// Measures the pool's f32 FMA peak: each of `rounds` rounds runs about `seconds_per_round`
/// on every thread at once; the fastest round is the peak. `None` when the CPU has neither
/// AVX-512F nor AVX2 + FMA (there is no vector loop to measure).
pub fn measure(rounds: usize, seconds_per_round: f64) -> Option<Peak> {
    let isa = Isa::detect()?;
    let threads = rayon::current_num_threads();
    let flops_per_iter = (CHAINS * isa.lanes() * 2) as f64;
    // Calibrate on one thread: iterations for the round length at this thread's rate.
    let probe = 1 << 16;
    let t = std::time::Instant::now();
    std::hint::black_box(isa.run(probe));
    let rate = probe as f64 / t.elapsed().as_secs_f64().max(1e-9);
    let iters = ((rate * seconds_per_round) as usize).max(probe);
    let mut best = 0.0f64;
    for _ in 0..rounds.max(1) {
        let t = std::time::Instant::now();
        let sums = rayon::broadcast(|_| isa.run(iters));
        let s = t.elapsed().as_secs_f64().max(1e-9);
        std::hint::black_box(sums);
        best = best.max(threads as f64 * iters as f64 * flops_per_iter / s / 1e9);
    }
    Some(Peak {
        gflops_per_s: best,
        threads,
        isa: isa.name(),
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{ADD, CHAINS, MUL, start};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(super) fn chains_avx512(iters: usize) -> f32 {
        let mut acc: [__m512; CHAINS] = std::array::from_fn(|j| _mm512_set1_ps(start(j)));
        let (mul, add) = (_mm512_set1_ps(MUL), _mm512_set1_ps(ADD));
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, mul, add);
            }
        }
        acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn chains_avx2(iters: usize) -> f32 {
        let mut acc: [__m256; CHAINS] = std::array::from_fn(|j| _mm256_set1_ps(start(j)));
        let (mul, add) = (_mm256_set1_ps(MUL), _mm256_set1_ps(ADD));
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, mul, add);
            }
        }
        acc.iter()
            .map(|&a| {
                let mut lanes = [0.0f32; 8];
                // SAFETY: `lanes` holds 8 f32.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
                lanes.iter().sum::<f32>()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar twin: the same chains, one lane each, with the same fused rounding.
    fn chains_naive(iters: usize, lanes: usize) -> f64 {
        (0..CHAINS)
            .map(|j| {
                let mut a = start(j);
                for _ in 0..iters {
                    a = a.mul_add(MUL, ADD);
                }
                a as f64 * lanes as f64
            })
            .sum()
    }

    /// The vector loop of `isa` against its scalar twin; panics when the CPU lacks `isa`.
    fn loop_does_the_multiply_adds_of_its_scalar_twin(isa: Isa) {
        let f = features();
        let runs = match isa {
            Isa::Avx512 => f.avx512f,
            Isa::Avx2 => f.avx2 && f.fma,
        };
        assert!(runs, "this CPU cannot run the {} loop", isa.name());
        for iters in [0, 1, 7, 1000, 100_000] {
            let got = isa.run(iters) as f64;
            let want = chains_naive(iters, isa.lanes());
            // Same per-lane arithmetic; only the final sum's order differs.
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                "{iters} iterations: vector loop {got}, scalar twin {want}"
            );
        }
        // The result depends on the iteration count, so no iteration can be skipped.
        assert_ne!(isa.run(1000), isa.run(1001));
    }

    /// The AVX2 + FMA loop (every x86-64 CPU memwall targets has AVX2 + FMA; the test fails
    /// on one without).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_loop_does_the_multiply_adds_of_its_scalar_twin() {
        loop_does_the_multiply_adds_of_its_scalar_twin(Isa::Avx2);
    }

    #[test]
    #[ignore = "needs AVX-512F"]
    fn avx512_loop_does_the_multiply_adds_of_its_scalar_twin() {
        loop_does_the_multiply_adds_of_its_scalar_twin(Isa::Avx512);
    }

    #[test]
    fn measure_reports_a_positive_rate_for_the_pool() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let peak = pool.install(|| measure(2, 0.002));
        match Isa::detect() {
            None => assert_eq!(peak, None),
            Some(isa) => {
                let p = peak.unwrap();
                assert_eq!((p.threads, p.isa), (2, isa.name()));
                assert!(p.gflops_per_s.is_finite() && p.gflops_per_s > 0.0);
            }
        }
    }
}
