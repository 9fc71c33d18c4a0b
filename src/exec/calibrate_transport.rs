//! `mpirun -np N memwall calibrate`: measure the collectives among N ranks, for the step-time
//! model's communication clock ([`crate::plan::time::Transport`]).
//!
//! Every rank runs the ring collectives the executor runs ([`crate::dist::ring`]: all-reduce,
//! reduce-scatter, all-gather) on f32, bf16 and f16 buffers of 64 Ki to 16 Mi elements, on
//! the scratch the plan would give them, filled with values and timed from memory, as in a
//! step. Each size is timed [`REPS`] times after a barrier; a repetition's time is the
//! slowest rank's (gathered), and the median repetition is kept. Per kind,
//! `seconds = s_per_byte · bytes sent + s_per_op` is fitted by least squares in seconds
//! ([`fit_seconds`]), so the large collectives that make most of a step's communication
//! weigh most. Rank 0 saves the result in the user cache, one file per rank count; plans for
//! that many ranks then time their collectives with it.

use crate::dist::{Comm, Summable, ring};
use crate::dtype::Elem;
use crate::ir::{Collective, Cut};
use crate::plan::time::{Calibration, Cost, Transport};
use crate::util::clock::utc_now;
use crate::util::machine::cpu_name;
use anyhow::{Result, bail};
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// Elements per buffer measured (every rank's whole buffer; each rank owns a 1/N chunk): 64 Ki
/// to 16 Mi, the sizes of parameter groups' gradients (a GPT-2 124M block is 7 Mi), where a
/// ring is bound by bandwidth and caches no longer hold the buffers.
pub const SIZES: [usize; 5] = [1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24];

/// Bytes written before each timed collective, more than a CPU's last-level cache holds: in
/// a training step compute runs between collectives and evicts their buffers, so they are
/// timed from memory, not from cache (measured: without it, sizes up to 1 Mi elements timed
/// 2–5× faster).
pub const EVICT_BYTES: usize = 256 << 20;

/// Timed repetitions per size (after one warm-up); the median is kept.
pub const REPS: usize = 5;

const COLLECTIVES: [(Collective, &str); 3] = [
    (Collective::AllReduce, "all_reduce"),
    (Collective::ReduceScatter, "reduce_scatter"),
    (Collective::AllGather, "all_gather"),
];

/// Measures the collectives among `comm`'s ranks (every rank must call it; each returns the
/// same figures). `progress` hears a line per kind.
pub fn measure(comm: &dyn Comm, progress: &mut dyn FnMut(&str)) -> Result<Transport> {
    let n = comm.size();
    if n < 2 {
        bail!(
            "one rank has no collectives to measure: start it with `mpirun -np N memwall calibrate` (N >= 2)"
        );
    }
    // [EVICT_BYTES] written before each repetition.
    let mut evict = vec![0u8; EVICT_BYTES];
    let mut kinds = BTreeMap::new();
    for (c, name) in COLLECTIVES {
        for (dtype, size) in [("f32", 4), ("bf16", 2), ("f16", 2)] {
            let kind = format!("{name}/{dtype}");
            // (bytes this rank sends, seconds) per size.
            let mut samples = Vec::new();
            for elems in SIZES {
                let secs = match dtype {
                    "f32" => time_collective::<f32>(comm, c, elems, &mut evict)?,
                    "bf16" => time_collective::<bf16>(comm, c, elems, &mut evict)?,
                    _ => time_collective::<f16>(comm, c, elems, &mut evict)?,
                };
                let cut = cut(elems, n);
                samples.push(((cut.sent(c, comm.rank()) * size) as f64, secs));
            }
            let cost = fit_seconds(&samples);
            let sizes: Vec<String> = samples
                .iter()
                .zip(SIZES)
                .map(|((_, t), n)| format!("{} Ki {:.2} ms", n >> 10, t * 1e3))
                .collect();
            progress(&format!(
                "{kind}: {}; fit {:.2} GB/s + {:.0} us a call (error {:.1}%)",
                sizes.join(", "),
                if cost.s_per_byte > 0.0 {
                    1e-9 / cost.s_per_byte
                } else {
                    f64::INFINITY
                },
                cost.s_per_op * 1e6,
                cost.fit_error_pct
            ));
            kinds.insert(kind, cost);
        }
    }
    Ok(Transport {
        at: utc_now(),
        ranks: n,
        transport: comm.describe(),
        cpu: cpu_name(),
        kinds,
    })
}

/// Fits `seconds ≈ b · bytes + c` (b, c ≥ 0) to `(bytes, seconds)` samples by least squares
/// in seconds; the fit error reported is the root-mean-square error relative to the times'
/// (so, like the fit, it is the large collectives' error).
pub fn fit_seconds(samples: &[(f64, f64)]) -> Cost {
    let n = samples.len() as f64;
    let (sx, st) = samples
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, t)| (a + x, b + t));
    let (sxx, sxt) = samples
        .iter()
        .fold((0.0, 0.0), |(a, b), &(x, t)| (a + x * x, b + x * t));
    let det = n * sxx - sx * sx;
    let (mut b, mut c) = if det > 0.0 {
        ((n * sxt - sx * st) / det, (sxx * st - sx * sxt) / det)
    } else {
        (0.0, st / n.max(1.0))
    };
    if c < 0.0 {
        // Through the origin.
        (b, c) = (if sxx > 0.0 { sxt / sxx } else { 0.0 }, 0.0);
    }
    if b < 0.0 {
        (b, c) = (0.0, st / n.max(1.0));
    }
    let err = samples
        .iter()
        .map(|&(x, t)| (b * x + c - t).powi(2))
        .sum::<f64>();
    let size = samples.iter().map(|&(_, t)| t * t).sum::<f64>();
    Cost {
        s_per_flop: 0.0,
        s_per_byte: b,
        s_per_op: c,
        samples: samples.len(),
        fit_error_pct: if size > 0.0 {
            100.0 * (err / size).sqrt()
        } else {
            0.0
        },
    }
}

/// The even cut of a buffer of about `elems` elements among `n` ranks (chunks of a multiple
/// of 16, as the plan pads them).
fn cut(elems: usize, n: usize) -> Cut {
    Cut::equal(elems.div_ceil(n).next_multiple_of(16), n)
}

/// Seconds of collective `c` over a buffer of `elems` elements of `T`: the median over
/// [`REPS`] of the slowest rank's time, each after `evict` is written and a barrier.
fn time_collective<T: Summable + Elem>(
    comm: &dyn Comm,
    c: Collective,
    elems: usize,
    evict: &mut [u8],
) -> Result<f64> {
    let cut = cut(elems, comm.size());
    // Values written into every page: a zeroed allocation's untouched pages all map the one
    // zero page, which a send would read from cache (all-gathers measured 3.5x too fast).
    let values = |n: usize| -> Vec<T> {
        (0..n)
            .map(|i| T::from_f32((i % 251) as f32 * 1e-3))
            .collect()
    };
    // [cut.len()] the buffer, [scratch] the pieces received, [chunk] a reduce-scatter's out.
    let mut buf = values(cut.len());
    let mut scratch = values(cut.scratch());
    let mut out = values(cut.shard(comm.rank()).len());
    let mut times = Vec::with_capacity(REPS);
    for rep in 0..=REPS {
        evict.iter_mut().for_each(|b| *b = b.wrapping_add(1));
        std::hint::black_box(&mut *evict);
        comm.barrier()?;
        let t0 = Instant::now();
        match c {
            Collective::AllReduce => ring::all_reduce(comm, &mut buf, &cut, &mut scratch)?,
            Collective::ReduceScatter => {
                ring::reduce_scatter(comm, &mut buf, &cut, &mut out, &mut scratch, false)?
            }
            Collective::AllGather => ring::all_gather(comm, &mut buf, &cut)?,
        }
        let mine = [t0.elapsed().as_secs_f64()];
        let mut all = vec![0.0f64; comm.size()];
        ring::gather_values(comm, &mine, &mut all)?;
        if rep > 0 {
            times.push(all.iter().copied().fold(0.0, f64::max));
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Where the transport measured among `ranks` ranks is kept in the user cache.
pub fn cache_file(ranks: usize) -> Option<PathBuf> {
    crate::util::cache::memwall_cache()
        .map(|d| d.join("calibration").join(format!("ranks-{ranks}.json")))
}

/// Writes `t` to `path` (atomically; the directory is created).
pub fn save(t: &Transport, path: &std::path::Path) -> Result<()> {
    super::calibrate::save_json(t, path)
}

/// The saved transport among `ranks` ranks on this CPU: `Ok(None)` when there is none (or
/// it was measured on another CPU), an error naming the file when it cannot be read.
pub fn load(ranks: usize) -> Result<Option<Transport>> {
    let Some(path) = cache_file(ranks) else {
        return Ok(None);
    };
    let redo = format!("mpirun -np {ranks} memwall calibrate");
    let t: Option<Transport> = super::calibrate::load_json(&path, &redo, Transport::check)?;
    Ok(t.filter(|t| t.cpu == cpu_name() && t.ranks == ranks))
}

/// The calibration the time model uses on `threads` threads among `ranks` ranks: the
/// ops' ([`super::calibrate::current`]) with the transport measured among that many ranks,
/// if there is one.
pub fn current(threads: usize, ranks: usize) -> Result<Calibration> {
    let mut cal = super::calibrate::current(threads)?;
    if ranks > 1 {
        cal.transport = load(ranks)?;
    }
    Ok(cal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::Local;

    /// Measures among `n` thread ranks; every rank's result.
    fn measured(n: usize) -> Vec<Transport> {
        let group = Local::group(n);
        std::thread::scope(|s| {
            let handles: Vec<_> = group
                .iter()
                .map(|c| s.spawn(move || measure(c, &mut |_| {}).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_collective_and_type_is_fitted_on_every_size() {
        for n in [2, 3] {
            let all = measured(n);
            let t = &all[0];
            assert_eq!(t.ranks, n);
            assert_eq!(t.kinds.len(), 9, "{:?}", t.kinds.keys());
            for (kind, cost) in &t.kinds {
                assert_eq!(cost.samples, SIZES.len(), "{kind}");
                assert!(cost.s_per_flop == 0.0, "{kind}: a collective does no FLOPs");
                // Non-negative and finite (the slope is not checked: tests running beside
                // this one share the cores, and a stalled small size can flatten a fit).
                let valid = |v: f64| v.is_finite() && v >= 0.0;
                assert!(
                    valid(cost.s_per_byte) && valid(cost.s_per_op),
                    "{kind}: {cost:?}"
                );
                assert!(cost.seconds(0, 1 << 26) > 0.0, "{kind}: {cost:?}");
            }
            // Every rank keeps the slowest rank's times, so all fit the same costs.
            for other in &all[1..] {
                assert_eq!(t.kinds, other.kinds);
            }
        }
    }

    #[test]
    fn the_fit_recovers_a_line_and_never_goes_negative() {
        let line: Vec<(f64, f64)> = [1e5, 1e6, 1e7, 6e7]
            .iter()
            .map(|&x| (x, x / 4e9 + 20e-6))
            .collect();
        let c = fit_seconds(&line);
        assert!((c.s_per_byte * 4e9 - 1.0).abs() < 1e-9, "{c:?}");
        assert!((c.s_per_op - 20e-6).abs() < 1e-12, "{c:?}");
        assert!(c.fit_error_pct < 1e-6);
        // Times that would want a negative constant: the line goes through the origin.
        let c = fit_seconds(&[(1e6, 1e-5), (2e6, 3e-4)]);
        assert!(c.s_per_op == 0.0 && c.s_per_byte > 0.0, "{c:?}");
        // Times falling with size: a constant.
        let c = fit_seconds(&[(1e6, 2e-3), (2e6, 1e-3)]);
        assert!(
            c.s_per_byte == 0.0 && (c.s_per_op - 1.5e-3).abs() < 1e-12,
            "{c:?}"
        );
    }

    #[test]
    fn hand_broken_transports_are_refused_naming_the_file_and_field() {
        let mut kinds = BTreeMap::new();
        kinds.insert(
            "all_reduce/f32".to_string(),
            fit_seconds(&[(1e6, 1e-3), (2e6, 2e-3)]),
        );
        let t = Transport {
            at: "2026-01-01T00:00:00Z".into(),
            ranks: 2,
            transport: "MPI".into(),
            cpu: cpu_name(),
            kinds,
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ranks-2.json");
        let load = |v: &serde_json::Value| {
            std::fs::write(&path, v.to_string()).unwrap();
            let redo = "mpirun -np 2 memwall calibrate";
            super::super::calibrate::load_json(&path, redo, Transport::check)
        };
        let good = serde_json::to_value(&t).unwrap();
        assert_eq!(load(&good).unwrap(), Some(t));
        for (at, value, field) in [
            (
                "/kinds/all_reduce~1f32/s_per_byte",
                serde_json::json!(-1.0),
                "s_per_byte is -1",
            ),
            ("/ranks", serde_json::json!(1), "ranks is 1"),
        ] {
            let mut v = good.clone();
            *v.pointer_mut(at).unwrap() = value;
            let e = format!("{:#}", load(&v).unwrap_err());
            assert!(
                e.contains(&path.display().to_string())
                    && e.contains("`mpirun -np 2 memwall calibrate`")
                    && e.contains(field),
                "{at}: {e}"
            );
        }
    }

    #[test]
    fn one_rank_is_refused_with_how_to_start_several() {
        let err = measure(&crate::dist::Single, &mut |_| {}).unwrap_err();
        assert!(err.to_string().contains("mpirun -np N"), "{err}");
    }
}
