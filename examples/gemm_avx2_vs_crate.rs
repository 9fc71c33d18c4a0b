//! memwall's AVX2 GEMM against the `gemm` crate's, alternated in one process, on the f32
//! GEMMs of a GPT-2 124M training step (4 × 256 tokens). Prints one JSON object per shape:
//! the configuration, each side's best GFLOP/s of 5 runs, and their ratio.
//!
//! ```text
//! cargo run --release --no-default-features --example gemm_avx2_vs_crate
//! T=1 COLD=1 ONLY=lm.dx cargo run --release --no-default-features --example gemm_avx2_vs_crate
//! ```
//!
//! `T`: threads (default 2); `COLD`: write 64 MiB between runs so operands come from memory,
//! as in a step; `ONLY`: one shape by name. Without `--no-default-features` the crate runs its
//! AVX-512 kernels where the CPU has them.
use memwall::backend::cpu::gemm::avx2::{self, pack::Strided};
use std::time::Instant;
fn main() {
    let shapes: &[(&str, usize, usize, usize, bool, bool)] = &[
        ("fc", 1024, 3072, 768, false, false),
        ("proj", 1024, 768, 3072, false, false),
        ("fc.dx", 1024, 768, 3072, false, true),
        ("fc.dw", 768, 3072, 1024, true, false),
        ("qkv.dw", 768, 2304, 1024, true, false),
        ("lm.fwd", 256, 50257, 768, false, true),
        ("lm.dx", 256, 768, 50257, false, false),
        ("lm.dw", 50257, 768, 256, true, false),
    ];
    let threads = std::env::var("T").map(|v| v.parse().unwrap()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let cold = std::env::var("COLD").is_ok();
    let mut junk = vec![1f32; 16 << 20];
    let only = std::env::var("ONLY").ok();
    for &(name, m, n, k, ta, tb) in shapes {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
        let mut c = vec![0f32; m * n];
        let lda = if ta { m } else { k };
        let ldb = if tb { k } else { n };
        let (a_rs, a_cs) = if ta { (1, lda) } else { (lda, 1) };
        let (b_rs, b_cs) = if tb { (1, ldb) } else { (ldb, 1) };
        let mut best = [f64::MAX; 2];
        pool.install(|| {
            for r in 0..10 {
                if cold {
                    for x in junk.iter_mut() {
                        *x += r as f32;
                    }
                }
                let t = Instant::now();
                if r % 2 == 0 {
                    unsafe {
                        gemm::gemm(
                            m,
                            n,
                            k,
                            c.as_mut_ptr(),
                            1,
                            n as isize,
                            false,
                            a.as_ptr(),
                            a_cs as isize,
                            a_rs as isize,
                            b.as_ptr(),
                            b_cs as isize,
                            b_rs as isize,
                            1.0,
                            1.0,
                            false,
                            false,
                            false,
                            gemm::Parallelism::Rayon(threads),
                        );
                    }
                } else {
                    unsafe {
                        avx2::sgemm(
                            (m, n, k),
                            1.0,
                            Strided::of(a.as_ptr(), lda, ta),
                            Strided::of(b.as_ptr(), ldb, tb),
                            avx2::Dst {
                                c: c.as_mut_ptr(),
                                ldc: n,
                                accumulate: false,
                                bias: std::ptr::null(),
                            },
                            threads,
                        );
                    }
                }
                best[r % 2] = best[r % 2].min(t.elapsed().as_secs_f64());
            }
        });
        let g = |s: f64| 2.0 * (m * n * k) as f64 / s / 1e9;
        println!(
            "{name:8} {m:6}x{n:6}x{k:6} ta={ta:5} tb={tb:5} crate {:6.1} own {:6.1} GF/s  ratio {:.3}",
            g(best[0]),
            g(best[1]),
            best[0] / best[1]
        );
    }
}
