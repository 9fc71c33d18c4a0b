//! The 6 × 16 micro-kernel: `acc[6, 16] = Σ_k a[k, 0..6] ⊗ b[k, 0..16]` over one packed
//! sliver pair, then `c = (load ? c : 0) + alpha · acc`. Twelve YMM accumulators (6 rows × 2
//! vectors of 8), two registers for the row of `b` and one for the broadcast element of `a`:
//! 15 of AVX2's 16 registers, so nothing spills. Each accumulator is one FMA chain walked
//! in `k` order from zero; a lane's result therefore does not depend on the tile it lies in.
//!
//! Its scalar twin is [`super::reference()`] (the same chains with `f32::mul_add`, bit for bit).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Rows of `c` per micro-tile.
pub const MR: usize = 6;
/// Columns of `c` per micro-tile (two vectors of 8).
pub const NR: usize = 16;

/// How a finished tile meets `c`: `c = base + alpha · acc`, where `base` is `c + bias`,
/// `c`, `bias` or nothing (then `c = alpha · acc`) as `load` and `bias` say.
#[derive(Clone, Copy, Debug)]
pub struct Store {
    /// Add to the values already in `c` (else overwrite them).
    pub load: bool,
    /// Scale of the product; 1 multiplies nothing.
    pub alpha: f32,
    /// A row of `NR` values added to every row of the tile (null: none).
    pub bias: *const f32,
}

impl Store {
    /// The store of a block after the first: onto `c`, no bias.
    pub fn onto_c(alpha: f32) -> Store {
        Store {
            load: true,
            alpha,
            bias: std::ptr::null(),
        }
    }

    /// The raw product, overwriting (the edge tiles' scratch store).
    pub fn raw() -> Store {
        Store {
            load: false,
            alpha: 1.0,
            bias: std::ptr::null(),
        }
    }

    /// What this store writes for one element: `old` in `c`, `bias` its bias (read only when
    /// there is one), `acc` the product. The kernel's vector store does the same operations.
    #[inline(always)]
    pub fn element(&self, old: f32, bias: f32, acc: f32) -> f32 {
        let v = if self.alpha != 1.0 {
            acc * self.alpha
        } else {
            acc
        };
        match (self.load, self.bias.is_null()) {
            (true, true) => old + v,
            (false, true) => v,
            (true, false) => (old + bias) + v,
            (false, false) => bias + v,
        }
    }
}

/// Runs the micro-kernel over `kc` steps of the packed slivers `a` (`[kc, MR]`) and `b`
/// (`[kc, NR]`) and stores the whole `MR × NR` tile into `c` (row stride `ldc`).
///
/// # Safety
/// The CPU has AVX2 and FMA; `a` holds `kc · MR` and `b` `kc · NR` readable f32; `c` is
/// valid for reads and writes of `MR` rows of `NR` f32 at row stride `ldc`; a non-null
/// `st.bias` points at `NR` readable f32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn kernel(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, st: Store) {
    // acc[i][h] covers c[i, 8h .. 8h + 8].
    let mut acc = [[_mm256_setzero_ps(); 2]; MR];
    let (mut a, mut b) = (a, b);
    // SAFETY (all pointer reads below): `a` and `b` advance by MR and NR per step, kc steps,
    // within the lengths the caller guarantees.
    unsafe {
        // The tile's rows of c arrive while the FMAs run, not after them, with intent to write
        // (also when c is only overwritten: its lines are read for ownership either way).
        for i in 0..MR {
            let ci = c.add(i * ldc);
            _mm_prefetch::<_MM_HINT_ET0>(ci as *const i8);
            _mm_prefetch::<_MM_HINT_ET0>(ci.add(NR - 1) as *const i8);
        }
        for _ in 0..kc {
            // The sliver of a streams from L2: ask for it 16 steps (384 bytes) ahead. Past
            // the sliver's end this touches the next one, or a few bytes past the buffer,
            // which a prefetch may (it never faults).
            _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(MR * 16) as *const i8);
            let b0 = _mm256_loadu_ps(b);
            let b1 = _mm256_loadu_ps(b.add(8));
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm256_broadcast_ss(&*a.add(i));
                row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
                row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
            }
            a = a.add(MR);
            b = b.add(NR);
        }
        // The same operations as `Store::element`, 8 lanes at a time.
        let alpha = _mm256_set1_ps(st.alpha);
        let has_bias = !st.bias.is_null();
        for (i, row) in acc.iter().enumerate() {
            let ci = c.add(i * ldc);
            for (h, &v) in row.iter().enumerate() {
                let mut v = v;
                if st.alpha != 1.0 {
                    v = _mm256_mul_ps(v, alpha);
                }
                let base = match (st.load, has_bias) {
                    (true, false) => Some(_mm256_loadu_ps(ci.add(8 * h))),
                    (false, false) => None,
                    (true, true) => Some(_mm256_add_ps(
                        _mm256_loadu_ps(ci.add(8 * h)),
                        _mm256_loadu_ps(st.bias.add(8 * h)),
                    )),
                    (false, true) => Some(_mm256_loadu_ps(st.bias.add(8 * h))),
                };
                if let Some(base) = base {
                    v = _mm256_add_ps(base, v);
                }
                _mm256_storeu_ps(ci.add(8 * h), v);
            }
        }
    }
}
