//! Conformance checks the kernel tests share (compiled for tests only).
//!
//! - Storage types: [`check_stored_as`] runs a kernel ([`Case`]) with its inputs and outputs
//!   stored as bf16 or f16 on 1 and on 3 threads, and again stored as f32 on the same values
//!   (the inputs rounded to the narrow type, then widened exactly), and compares output by
//!   output: the narrow runs bitwise with each other, and each output with the f32 run by its
//!   own rule ([`Out`]): a stored output is the f32 result rounded once; a value the kernels
//!   keep in f32 (statistics, optimizer state, codes) is bitwise the f32 one; a kernel whose
//!   narrow instantiation does other f32 arithmetic states a tolerance instead.
//! - Instruction sets: [`isa_invariant`] runs a computation at the baseline and at each given
//!   `multiversion!` instruction set and asserts bitwise-equal results; it fails, rather than
//!   comparing the baseline with itself, when the CPU lacks one of them ([`isas_here`] lists
//!   the ones this CPU has).

use super::features::{Isa, detected_isa, isa, set_isa};
use super::reduce::testutil::with_threads;
use crate::dtype::Elem;
use std::sync::Mutex;

/// `x` rounded to `T`, stored as `S`: the inputs of a [`Case`], the same values whatever `S`
/// (`S` = `T`: the narrow run; `S` = f32: the reference run on the narrow values, exactly).
pub fn stored<T: Elem, S: Elem>(x: &[f32]) -> Vec<S> {
    x.iter()
        .map(|&v| S::from_f32(T::from_f32(v).to_f32()))
        .collect()
}

/// A kernel run generic over the storage type, for [`check_stored_as`].
pub trait Case: Sync {
    /// Runs the kernel with every stored input and output of type `S`, on inputs made with
    /// [`stored::<T, S>`](stored); returns its outputs, in the same order for every `S`.
    fn run<T: Elem, S: Elem>(&self) -> Vec<Out>;
}

/// How an output of the narrow run must relate to the same output of the f32 run.
#[derive(Clone, Copy, Debug)]
pub enum Rule {
    /// Stored as the run's element type: bitwise the f32 run's value rounded to it.
    Rounded,
    /// Kept in f32 (or f64, or integer codes) whatever the storage type: bitwise the same.
    Exact,
    /// Within `rel·|want| + of_max·max|want| + abs` of the f32 run's value (kernels whose
    /// narrow instantiation does other f32 arithmetic, say on converted copies).
    Close(Tol),
}

/// The tolerance of [`Rule::Close`].
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rel: f32,
    pub of_max: f32,
    pub abs: f32,
}

/// The values of an output.
#[derive(Clone, Debug)]
pub enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
    /// Integer codes or other bit patterns.
    Bits(Vec<u64>),
}

/// One output of a [`Case`] run.
#[derive(Clone, Debug)]
pub struct Out {
    pub name: &'static str,
    pub rule: Rule,
    /// Stored as the run's element type (else kept in f32 or another fixed type).
    pub stored: bool,
    pub data: Data,
}

impl Out {
    /// An output stored as the run's element type (widened exactly): [`Rule::Rounded`].
    pub fn stored<S: Elem>(name: &'static str, x: &[S]) -> Out {
        let data = Data::F32(x.iter().map(|v| v.to_f32()).collect());
        Out {
            name,
            rule: Rule::Rounded,
            stored: true,
            data,
        }
    }

    /// An output kept in f32 whatever the storage type: [`Rule::Exact`].
    pub fn f32(name: &'static str, x: &[f32]) -> Out {
        Out::exact(name, Data::F32(x.to_vec()))
    }

    /// An output kept in f64: [`Rule::Exact`].
    pub fn f64(name: &'static str, x: &[f64]) -> Out {
        Out::exact(name, Data::F64(x.to_vec()))
    }

    /// Codes or other bit patterns that do not depend on the storage type: [`Rule::Exact`].
    pub fn bits(name: &'static str, x: impl IntoIterator<Item = u64>) -> Out {
        Out::exact(name, Data::Bits(x.into_iter().collect()))
    }

    fn exact(name: &'static str, data: Data) -> Out {
        Out {
            name,
            rule: Rule::Exact,
            stored: false,
            data,
        }
    }

    /// This output compared within `tol` instead ([`Rule::Close`]; f32 values only).
    pub fn close(self, tol: Tol) -> Out {
        assert!(
            matches!(self.data, Data::F32(_)),
            "{}: close needs f32",
            self.name
        );
        Out {
            rule: Rule::Close(tol),
            ..self
        }
    }

    /// The values, when f32 (stored outputs are widened exactly).
    pub fn f32s(&self) -> &[f32] {
        match &self.data {
            Data::F32(x) => x,
            _ => panic!("{}: not f32 values", self.name),
        }
    }

    /// The values, when f64.
    pub fn f64s(&self) -> &[f64] {
        match &self.data {
            Data::F64(x) => x,
            _ => panic!("{}: not f64 values", self.name),
        }
    }

    /// The bit patterns of the values (equal iff the values are identical, NaN payloads and
    /// signed zeros included).
    fn image(&self) -> Vec<u64> {
        match &self.data {
            Data::F32(x) => x.iter().map(|v| v.to_bits() as u64).collect(),
            Data::F64(x) => x.iter().map(|v| v.to_bits()).collect(),
            Data::Bits(x) => x.clone(),
        }
    }
}

/// Runs `case` stored as `T` on 1 and on 3 threads and stored as f32 (on the current pool)
/// on the same values, and asserts that the two narrow runs are bitwise identical and that
/// each output follows its [`Rule`] against the f32 run. Returns the narrow run's outputs
/// and the f32 run's, for checks of the caller's own.
#[track_caller]
pub fn check_stored_as<T: Elem>(case: &impl Case, what: &str) -> (Vec<Out>, Vec<Out>) {
    let what = format!("{what} ({})", T::NAME);
    let got = with_threads(1, || case.run::<T, T>());
    let got3 = with_threads(3, || case.run::<T, T>());
    let want = case.run::<T, f32>();
    assert!(!got.is_empty(), "{what}: no outputs");
    assert_eq!(got.len(), got3.len(), "{what}: outputs");
    assert_eq!(got.len(), want.len(), "{what}: outputs");
    for ((g, g3), w) in got.iter().zip(&got3).zip(&want) {
        let name = g.name;
        assert_eq!((name, name), (g3.name, w.name), "{what}: output order");
        assert!(
            g.image() == g3.image(),
            "{what} {name}: 1 and 3 threads differ"
        );
        match g.rule {
            Rule::Rounded => {
                let (g, w) = (g.f32s(), w.f32s());
                assert_eq!(g.len(), w.len(), "{what} {name}: length");
                for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
                    let r = T::from_f32(w).to_f32();
                    assert!(
                        g.to_bits() == r.to_bits(),
                        "{what} {name}[{i}]: {g:?} vs f32 {w} rounded {r:?}"
                    );
                }
            }
            Rule::Exact => {
                let (gi, wi) = (g.image(), w.image());
                assert_eq!(gi.len(), wi.len(), "{what} {name}: length");
                for (i, (g, w)) in gi.iter().zip(&wi).enumerate() {
                    assert!(g == w, "{what} {name}[{i}]: bits {g:#x} vs f32 run {w:#x}");
                }
            }
            Rule::Close(tol) => {
                let stored = g.stored;
                let (g, w) = (g.f32s(), w.f32s());
                assert_eq!(g.len(), w.len(), "{what} {name}: length");
                let maxabs = w.iter().fold(0.0f32, |m, w| m.max(w.abs()));
                let mut differ = 0usize;
                for (i, (&g, &w)) in g.iter().zip(w).enumerate() {
                    let tol = tol.rel * w.abs() + tol.of_max * maxabs + tol.abs;
                    assert!((g - w).abs() <= tol, "{what} {name}[{i}]: {g} vs f32 {w}");
                    let rounded = if stored { T::from_f32(w).to_f32() } else { w };
                    differ += (g.to_bits() != rounded.to_bits()) as usize;
                }
                println!(
                    "{what} {name}: {differ} of {} differ from the f32 run's{}",
                    g.len(),
                    if stored { " rounded" } else { "" }
                );
            }
        }
    }
    (got, want)
}

/// The `multiversion!` instruction sets above the baseline that this CPU has.
pub fn isas_here() -> Vec<Isa> {
    [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|&i| i <= detected_isa())
        .collect()
}

/// Serialises the tests that change the instruction set in use, so that one's baseline run
/// never runs at another's setting.
static ISA_LOCK: Mutex<()> = Mutex::new(());

/// Runs `run` at the baseline and then at each of `isas`, asserting that every result equals
/// the baseline's; returns the baseline's. Panics when the CPU lacks one of `isas` (so a
/// test asking for AVX-512 fails there rather than compare the baseline with itself).
/// Restores the instruction set in use before.
#[track_caller]
pub fn isa_invariant<R: PartialEq>(isas: &[Isa], run: impl Fn() -> R, what: &str) -> R {
    /// Sets the instruction set back when dropped (also when an assertion fails).
    struct Restore(Isa);
    impl Drop for Restore {
        fn drop(&mut self) {
            set_isa(self.0);
        }
    }
    let _lock = ISA_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let _restore = Restore(isa());
    let at = |want: Isa| {
        let got = set_isa(want);
        assert_eq!(got, want, "{what}: this CPU cannot run {want:?}");
        run()
    };
    let base = at(Isa::Baseline);
    for &want in isas {
        assert!(at(want) == base, "{what}: {want:?} differs from Baseline");
    }
    base
}

/// The checks fail on kernels that break their rule.
mod tests {
    use super::*;
    use crate::backend::cpu::reduce::testutil::randn;
    use half::bf16;

    /// Rounds to the storage type twice (x·3, then ·1.001): not the f32 result rounded once.
    struct RoundsTwice;

    impl Case for RoundsTwice {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            let x: Vec<S> = stored::<T, S>(&randn(1000, 1.0, 1));
            let y: Vec<S> = x
                .iter()
                .map(|v| S::from_f32(S::from_f32(v.to_f32() * 3.0).to_f32() * 1.001))
                .collect();
            vec![Out::stored("y", &y)]
        }
    }

    #[test]
    #[should_panic(expected = "rounded")]
    fn double_rounding_fails() {
        check_stored_as::<bf16>(&RoundsTwice, "rounds twice");
    }

    #[test]
    fn double_rounding_passes_within_a_tolerance() {
        struct Close;
        impl Case for Close {
            fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
                let tol = Tol {
                    rel: 1.0 / 128.0,
                    of_max: 0.0,
                    abs: 0.0,
                };
                let out = RoundsTwice.run::<T, S>().remove(0);
                vec![out.close(tol)]
            }
        }
        check_stored_as::<bf16>(&Close, "rounds twice, within a tolerance");
    }

    /// An "f32" output that depends on the storage type.
    struct DependsOnStorage;

    impl Case for DependsOnStorage {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            vec![Out::f32("name length", &[S::NAME.len() as f32])]
        }
    }

    #[test]
    #[should_panic(expected = "bits")]
    fn exact_output_that_depends_on_storage_fails() {
        check_stored_as::<bf16>(&DependsOnStorage, "depends on storage");
    }

    /// An output that depends on the thread count.
    struct DependsOnThreads;

    impl Case for DependsOnThreads {
        fn run<T: Elem, S: Elem>(&self) -> Vec<Out> {
            vec![Out::f32("threads", &[rayon::current_num_threads() as f32])]
        }
    }

    #[test]
    #[should_panic(expected = "1 and 3 threads differ")]
    fn thread_dependent_output_fails() {
        check_stored_as::<bf16>(&DependsOnThreads, "depends on threads");
    }

    /// (Needs an instruction set above the baseline: AVX2 + FMA on x86-64.)
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[should_panic(expected = "differs from Baseline")]
    fn isa_dependent_result_fails() {
        isa_invariant(&[Isa::Avx2], isa, "reports the ISA");
    }
}
