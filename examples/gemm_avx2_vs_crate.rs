//! memwall's AVX2 GEMM against the `gemm` crate's, alternated in one process, on the f32
//! GEMMs of a GPT-2 124M training step (4 × 256 tokens). Prints one line per shape: the
//! configuration, each side's best GFLOP/s of 5 runs, and their ratio.
//!
//! ```text
//! cargo run --release --no-default-features --example gemm_avx2_vs_crate
//! T=1 COLD=1 ONLY=lm.dx cargo run --release --no-default-features --example gemm_avx2_vs_crate
//! ```
//!
//! `T`: threads (default 2); `COLD`: write 64 MiB between runs so operands come from memory,
//! as in a step; `ONLY`: one shape by name; `SHAPE=m,n,k[,ta,tb]`: that shape instead (`ta`,
//! `tb` 1 for a transposed operand); `REPS`: GEMMs per timed run (default 1; more for small
//! shapes). Without `--no-default-features` the crate runs its AVX-512 kernels where the CPU
//! has them.
//!
//! `MICRO=1` times the micro-kernel alone instead, on one thread, its slivers and tile in L1
//! (calls of `KC` steps, as in a GEMM), next to the one-thread AVX2 FMA ceiling
//! (`memwall::backend::cpu::peak`): how far the kernel itself is from the loop without loads.
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
    if std::env::var_os("MICRO").is_some() {
        micro();
        return;
    }
    let threads = std::env::var("T").map(|v| v.parse().unwrap()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let cold = std::env::var("COLD").is_ok();
    let mut junk = vec![1f32; 16 << 20];
    let only = std::env::var("ONLY").ok();
    let reps: usize = std::env::var("REPS").map_or(1, |v| v.parse().expect("REPS: a count"));
    let custom = std::env::var("SHAPE").ok().map(|v| {
        let x: Vec<usize> = v
            .split(',')
            .map(|t| t.parse().expect("SHAPE: m,n,k[,ta,tb]"))
            .collect();
        assert!(x.len() == 3 || x.len() == 5, "SHAPE: m,n,k[,ta,tb]");
        let t = |i: usize| x.get(i) == Some(&1);
        [("shape", x[0], x[1], x[2], t(3), t(4))]
    });
    let shapes = custom.as_ref().map_or(shapes, |c| &c[..]);
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
                for _ in 0..reps {
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
                }
                best[r % 2] = best[r % 2].min(t.elapsed().as_secs_f64());
            }
        });
        let g = |s: f64| 2.0 * (reps * m * n * k) as f64 / s / 1e9;
        println!(
            "{name:8} {m:6}x{n:6}x{k:6} ta={ta:5} tb={tb:5} crate {:6.1} own {:6.1} GF/s  ratio {:.3}",
            g(best[0]),
            g(best[1]),
            best[0] / best[1]
        );
    }
}

/// The micro-kernel alone on one thread, against the one-thread AVX2 ceiling, five rounds.
fn micro() {
    use avx2::kernel::{MR, NR, Store, kernel};
    assert!(
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
        "the micro-kernel needs AVX2 and FMA"
    );
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let a = vec![0.5f32; avx2::KC * MR]; // [KC, MR]
    let b = vec![0.25f32; avx2::KC * NR]; // [KC, NR]
    let mut c = vec![0f32; MR * NR]; // [MR, NR]
    let calls = 200_000;
    for _ in 0..5 {
        let t = Instant::now();
        for i in 0..calls {
            let st = if i == 0 {
                Store::raw()
            } else {
                Store::onto_c(1.0)
            };
            // SAFETY: AVX2 + FMA checked above; the slivers hold KC steps, `c` one tile.
            unsafe { kernel(avx2::KC, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), NR, st) };
        }
        let s = t.elapsed().as_secs_f64();
        let kernel_gflops = 2.0 * (calls * avx2::KC * MR * NR) as f64 / s / 1e9;
        let peak = one
            .install(|| memwall::backend::cpu::peak::measure(3, 0.02))
            .map(|p| {
                p.by_isa
                    .iter()
                    .find(|l| l.isa == "avx2+fma")
                    .map(|l| l.gflops_per_s)
            });
        match peak.flatten() {
            Some(p) => println!(
                "micro-kernel {kernel_gflops:6.1} GF/s, one-thread AVX2 peak {p:6.1}: {:.3}",
                kernel_gflops / p
            ),
            None => println!("micro-kernel {kernel_gflops:6.1} GF/s (no AVX2 loop measured)"),
        }
    }
    std::hint::black_box(&c);
}
