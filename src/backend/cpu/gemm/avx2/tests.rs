//! The AVX2 GEMM against [`reference()`], bit for bit: every transpose, edge tiles in both
//! dimensions, reductions across several [`KC`] blocks, padded strides, `alpha`, accumulation,
//! and one to three threads (the same bits for each).

use super::*;
use crate::backend::cpu::features::features;
use crate::backend::cpu::reduce::testutil::randn;

/// Runs [`sgemm`] on random operands laid out as the flags say (row strides padded by 3)
/// and checks it against [`reference()`] bit for bit, and that `c` outside the window is
/// untouched.
fn check(
    dims: (usize, usize, usize),
    t: (bool, bool),
    alpha: f32,
    accumulate: bool,
    threads: usize,
) {
    check_typed::<f32, f32>(dims, t, alpha, accumulate, false, threads);
}

/// [`check`] with operands stored as `A` and `B` (the reference reads them widened).
fn check_typed<A: Packable, B: Packable>(
    (m, n, k): (usize, usize, usize),
    (ta, tb): (bool, bool),
    alpha: f32,
    accumulate: bool,
    with_bias: bool,
    threads: usize,
) {
    let f = features();
    assert!(
        f.avx2 && f.fma,
        "the AVX2 GEMM's tests need a CPU with AVX2 and FMA"
    );
    let (ar, ac) = if ta { (k, m) } else { (m, k) };
    let (br, bc) = if tb { (n, k) } else { (k, n) };
    let (lda, ldb, ldc) = (ac + 3, bc + 3, n + 3);
    let a: Vec<A> = randn(ar * lda, 1.0, 1)
        .into_iter()
        .map(A::from_f32)
        .collect();
    let b: Vec<B> = randn(br * ldb, 1.0, 2)
        .into_iter()
        .map(B::from_f32)
        .collect();
    let c0 = randn(m * ldc, 1.0, 3);
    let bias = randn(n, 1.0, 4);
    let bias = with_bias.then_some(&bias[..]);
    let at = |i: usize, p: usize| if ta { a[p * lda + i] } else { a[i * lda + p] }.to_f32();
    let bt = |p: usize, j: usize| if tb { b[j * ldb + p] } else { b[p * ldb + j] }.to_f32();
    let mut want = c0.clone();
    reference((m, n, k), alpha, &at, &bt, &mut want, ldc, accumulate, bias);
    let mut got = c0.clone();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        // SAFETY: AVX2 and FMA asserted; the windows lie inside the vectors; k > 0.
        unsafe {
            sgemm(
                (m, n, k),
                alpha,
                Strided::of(a.as_ptr(), lda, ta),
                Strided::of(b.as_ptr(), ldb, tb),
                Dst {
                    c: got.as_mut_ptr(),
                    ldc,
                    accumulate,
                    bias: bias.map_or(std::ptr::null(), |b| b.as_ptr()),
                },
                threads,
            )
        }
    });
    for i in 0..m {
        for j in 0..ldc {
            let (g, w) = (got[i * ldc + j], want[i * ldc + j]);
            let what = if j < n { "result" } else { "padding" };
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{what} ({i}, {j}) of {m}x{n}x{k} {}·{} ta={ta} tb={tb} alpha={alpha} \
                 acc={accumulate} bias={with_bias} threads={threads}: {g} != {w}",
                A::NAME,
                B::NAME
            );
        }
    }
}

#[test]
fn small_shapes_equal_the_reference_bit_for_bit() {
    for (m, n, k) in [(1, 1, 1), (5, 17, 3), (6, 16, 8), (7, 33, 9), (13, 40, 300)] {
        for ta in [false, true] {
            for tb in [false, true] {
                check((m, n, k), (ta, tb), 1.0, false, 1);
                check((m, n, k), (ta, tb), 0.5, true, 1);
            }
        }
    }
}

#[test]
fn reductions_over_several_blocks_equal_the_reference_bit_for_bit() {
    // k crosses two KC boundaries with a ragged last block; m and n have edge tiles.
    for ta in [false, true] {
        for tb in [false, true] {
            check((19, 37, 2 * KC + 13), (ta, tb), 1.0, true, 1);
        }
    }
}

#[test]
fn threads_split_rows_or_columns_and_give_the_same_bits() {
    // Wide (split along n) and tall (split along m) problems above the threading threshold,
    // with more rows than one mc block and more columns than one nc panel (the blocks are
    // evened out: their sizes must not change a bit).
    let (tall, wide) = (Blocking::here().mc + 7, Blocking::here().nc + 21);
    for (m, n, k) in [(40, 500, 300), (tall, 24, 700), (24, wide, 40)] {
        for threads in [1, 2, 3] {
            check((m, n, k), (false, true), 1.0, false, threads);
            check((m, n, k), (true, false), 1.0, true, threads);
        }
    }
}

#[test]
fn blocking_follows_the_l2_size_within_bounds() {
    let b = Blocking::for_l2(1 << 20);
    assert_eq!((b.mc, b.nc), (510, 1024));
    let b = Blocking::for_l2(256 << 10);
    assert_eq!((b.mc, b.nc), (126, 512));
    let b = Blocking::for_l2(64 << 20);
    assert_eq!((b.mc, b.nc), (170 * MR, 256 * NR));
}

#[test]
fn bf16_operands_are_widened_as_packed_bit_for_bit() {
    for (m, n, k) in [(7, 33, 9), (19, 37, KC + 13), (40, 500, 300)] {
        for ta in [false, true] {
            for tb in [false, true] {
                check_typed::<half::bf16, half::bf16>((m, n, k), (ta, tb), 1.0, true, false, 2);
                check_typed::<f32, half::bf16>((m, n, k), (ta, tb), 1.0, false, false, 1);
                check_typed::<half::bf16, f32>((m, n, k), (ta, tb), 1.0, false, false, 3);
            }
        }
    }
}

#[test]
fn a_bias_is_added_before_the_first_block_bit_for_bit() {
    // With and without accumulation, one and several KC blocks, edge tiles, split threads.
    for (m, n, k) in [(7, 33, 9), (19, 37, 2 * KC + 13), (40, 500, 300)] {
        for accumulate in [false, true] {
            for threads in [1, 2] {
                check_typed::<f32, f32>((m, n, k), (false, true), 1.0, accumulate, true, threads);
                check_typed::<f32, f32>((m, n, k), (false, false), 1.0, accumulate, true, threads);
            }
        }
    }
}
