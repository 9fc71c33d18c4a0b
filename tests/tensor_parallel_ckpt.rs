//! Checkpoints of tensor-parallel plans (`--tp`), ranks as threads over `dist::Local` as in
//! `tensor_parallel.rs`: a checkpoint never depends on the number of ranks. Tensor ranks
//! write the files one process writes (byte for byte, given the same state): rank 0 gathers
//! each cut tensor's parts from data rank 0's tensor ranks, whole tensors are its own, and
//! the data ranks beside them write nothing. Each tensor rank loads its parts back from the
//! whole files, so a run saved by one process resumes on two tensor ranks, and the reverse,
//! training on as one process does (losses within 1e-5, weights within 1e-4), with any
//! moments (8-bit ones too: a part's blocks are its whole tensor's). With ZeRO 1–3
//! on the data axis (dp 2 × tp 2), rank 0 gathers each piece from its owner (data shard and
//! tensor part): the files are those one process, tp 2 and zero alone write of the same
//! state, and a run resumes on each of those layouts and back like an uninterrupted one.

mod common;

use common::worst_tensor;
use memwall::backend::under_test as backend;
use memwall::ckpt::{self, SaveOptions, TrainerState};
use memwall::dist::{Comm, Local, Single};
use memwall::exec::{Executor, OptimHparams};
use memwall::ir::{Mesh, Moments, MomentsMut, OptimState, Zero};
use memwall::model::{ModelSpec, ParamLayout};
use memwall::plan::{Mode, StepConfig, build_plan};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const SEQ: usize = 32;
/// Rows per data rank.
const BATCH: usize = 2;
/// Steps of the uninterrupted reference run (a resumed run saves half way).
const STEPS: u64 = 4;

/// Step `step`'s global batch: `rows` rows of SEQ+1 tokens below `vocab`.
fn global_batch(step: u64, rows: usize, vocab: usize) -> Vec<u32> {
    common::random_batch(11, step, (rows, SEQ), vocab)
}

fn hparams(step: u64) -> OptimHparams {
    common::rank_test_hparams(step)
}

fn trainer_state(spec: &ModelSpec, step: u64) -> TrainerState {
    TrainerState {
        step,
        data_position: step,
        seed: 3,
        rng_state: 3,
        model: spec.to_hf_config(),
        train: serde_json::Value::Null,
        memwall_version: "test".into(),
        loss_scale: None,
    }
}

/// One rank of a job: its executor and place in the mesh.
struct Rank {
    ex: Executor,
    mesh: Mesh,
    spec: ModelSpec,
    /// Rows per step of this data rank.
    batch: usize,
}

impl Rank {
    /// `model`'s training plan for `mesh`'s rank, started on `comm`, its moments stored as
    /// `state`.
    fn start(model: &str, mesh: Mesh, comm: Arc<dyn Comm>, state: OptimState) -> Rank {
        Rank::start_at(model, (mesh, Zero::DP), comm, state, BATCH)
    }

    /// [`Rank::start`] with ZeRO stage `zero` on the data axis and `batch` rows per data
    /// rank.
    fn start_at(
        model: &str,
        (mesh, zero): (Mesh, Zero),
        comm: Arc<dyn Comm>,
        state: OptimState,
        batch: usize,
    ) -> Rank {
        let spec = ModelSpec::preset(model).unwrap();
        let mut cfg = StepConfig::new(batch, SEQ, 1);
        cfg.mesh = mesh;
        cfg.zero = zero;
        cfg.optim_state = state;
        let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
        let ex = Executor::among(plan, backend(), comm).unwrap();
        Rank {
            ex,
            mesh,
            spec,
            batch,
        }
    }

    /// The whole model's initialisation (seed 3), this rank's part of it.
    fn init(&mut self) {
        let layout = self.ex.plan.layout.clone();
        let mut init = layout.initializer(3);
        self.ex
            .fill_params(|r, p| {
                init.fill(r, p);
                Ok(())
            })
            .unwrap();
    }

    /// Loads checkpoint `dir` as `train --resume` does (`exec::train`'s `restore`): the
    /// parameters and moments this rank holds, from the whole files.
    fn resume(&mut self, dir: &Path) -> TrainerState {
        let layout = self.ex.plan.layout.clone();
        let ex = &mut self.ex;
        ckpt::load_params_by(dir, &layout, |copy| ex.fill_params(|r, p| copy(r, p))).unwrap();
        let format = ex.plan.cfg.optim_state;
        ckpt::load_trainer_state_by(dir, (&layout, &layout), format, |copy| {
            ex.fill_moments(copy)
        })
        .unwrap()
    }

    /// Trains steps `steps` on this data rank's rows of each global batch; the losses.
    fn train(&mut self, steps: std::ops::RangeInclusive<u64>) -> Vec<f32> {
        let mut losses = Vec::new();
        for step in steps {
            let all = global_batch(step, self.batch * self.mesh.data, self.spec.vocab_size);
            let (w, d) = (self.batch * (SEQ + 1), self.mesh.data_rank());
            self.ex.upload_batch(&all[d * w..(d + 1) * w]).unwrap();
            losses.push(self.ex.train_step(&hparams(step)).unwrap().loss);
        }
        losses
    }

    /// Saves a checkpoint of step `step` into `run` (every rank calls it).
    fn save(&self, run: &Path, step: u64, opts: &SaveOptions) -> PathBuf {
        let state = trainer_state(&self.spec, step);
        self.ex.save_checkpoint(run, &state, opts).unwrap()
    }

    /// This rank's state: its parameters, and its moments as f32 (m then v each).
    fn state(&self) -> Held {
        let params = self.ex.download_params().unwrap();
        let (m, v) = self
            .ex
            .with_moments(|m| match m {
                Moments::F32 { m, v } => (m.to_vec(), v.to_vec()),
                Moments::Bf16 { m, v } => {
                    let f = |x: &[half::bf16]| x.iter().map(|x| x.to_f32()).collect();
                    (f(m), f(v))
                }
                Moments::Int8 { .. } => unreachable!("no 8-bit moments here"),
            })
            .unwrap();
        Held {
            params,
            m,
            v,
            layout: self.ex.plan.layout.clone(),
        }
    }
}

/// What a rank holds: its parameters and moments in its layout.
#[derive(Clone)]
struct Held {
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    layout: ParamLayout,
}

/// Runs `f` on each rank of a `data × tensor` job as threads (one process: `Single`); the
/// results in rank order.
fn job<T: Send>(data: usize, tensor: usize, f: impl Fn(Mesh, Arc<dyn Comm>) -> T + Sync) -> Vec<T> {
    staged_job((data, tensor, 1), f)
}

/// [`job`] of `data × tensor × pipeline` ranks.
fn staged_job<T: Send>(
    (data, tensor, pipeline): (usize, usize, usize),
    f: impl Fn(Mesh, Arc<dyn Comm>) -> T + Sync,
) -> Vec<T> {
    let comms: Vec<Arc<dyn Comm>> = match data * tensor * pipeline {
        1 => vec![Arc::new(Single)],
        n => Local::group(n)
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Comm>)
            .collect(),
    };
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let mesh = Mesh {
                    data,
                    tensor,
                    pipeline,
                    rank,
                };
                s.spawn(move || f(mesh, comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The whole model's arrays from the tensor ranks of one data rank (`parts`, in tensor
/// order; `pick` chooses the array): `common::gathered` of each rank's (layout, array).
fn gathered(whole: &ParamLayout, parts: &[Held], pick: fn(&Held) -> &[f32]) -> Vec<f32> {
    let held: Vec<_> = parts.iter().map(|h| (&h.layout, pick(h))).collect();
    common::gathered(whole, &held)
}

/// Asserts that `a` is `b` bitwise, naming the first element that differs.
fn same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let differ: Vec<usize> = (0..a.len())
        .filter(|&i| a[i].to_bits() != b[i].to_bits())
        .collect();
    if let Some(&i) = differ.first() {
        panic!(
            "{what}: {} of {} elements differ, the first {i}: {} vs {}",
            differ.len(),
            a.len(),
            a[i],
            b[i]
        );
    }
}

/// A checkpoint's files other than the trainer state, by name, with their bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// `data × tensor` ranks of `model` train 3 steps and save (weights cut into shards of at
/// most `max_shard_bytes`, moments as `state`): the checkpoint is the files one process
/// writes of the gathered parts, byte for byte, and loads in one process to the gathered
/// parts; fresh tensor ranks load their parts of it back bitwise.
fn saves_the_gathered_model(
    model: &str,
    data: usize,
    tensor: usize,
    state: OptimState,
    max_shard_bytes: u64,
) {
    let what = format!("{model} data={data} tensor={tensor} {state}");
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("tp");
    let opts = SaveOptions {
        max_shard_bytes,
        ..SaveOptions::default()
    };
    let out = job(data, tensor, |mesh, comm| {
        let mut r = Rank::start(model, mesh, comm, state);
        r.init();
        r.train(1..=3);
        let dir = r.save(&run, 3, &opts);
        (dir, r.state())
    });
    let dir = out[0].0.clone();
    for (rank, (d, _)) in out.iter().enumerate() {
        assert_eq!(d, &dir, "{what} rank {rank}: the checkpoint's path");
    }
    let spec = ModelSpec::preset(model).unwrap();
    let whole = ParamLayout::new(&spec);
    let held: Vec<Held> = out.into_iter().map(|(_, h)| h).collect();
    assert!(held[0].layout.split.is_split(), "{what}: ranks hold parts");
    let parts = &held[..tensor];
    let (params, m, v) = (
        gathered(&whole, parts, |h| &h.params),
        gathered(&whole, parts, |h| &h.m),
        gathered(&whole, parts, |h| &h.v),
    );
    // The other data ranks hold the same state.
    for d in 1..data {
        let other = &held[d * tensor..(d + 1) * tensor];
        let theirs = gathered(&whole, other, |h| &h.params);
        same_bits(&theirs, &params, &format!("{what}: data rank {d}"));
    }

    // One process loads it to the gathered parts.
    let mut p = vec![0f32; whole.total];
    ckpt::load_params(&dir, &whole, &mut p).unwrap();
    same_bits(&p, &params, &format!("{what}: the saved weights"));
    let (mut m2, mut v2) = (vec![0f32; whole.total], vec![0f32; whole.total]);
    let (mut mb, mut vb) = (
        vec![half::bf16::ZERO; whole.total],
        vec![half::bf16::ZERO; whole.total],
    );
    let moments = match state {
        OptimState::F32 => MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        },
        _ => MomentsMut::Bf16 {
            m: &mut mb,
            v: &mut vb,
        },
    };
    let st = ckpt::load_trainer_state(&dir, &whole, moments).unwrap();
    assert_eq!(st, trainer_state(&spec, 3));
    if state == OptimState::Bf16 {
        m2 = mb.iter().map(|x| x.to_f32()).collect();
        v2 = vb.iter().map(|x| x.to_f32()).collect();
    }
    same_bits(&m2, &m, &format!("{what}: the saved m"));
    same_bits(&v2, &v, &format!("{what}: the saved v"));

    // The files one process writes of that state, byte for byte.
    let alone = tmp.path().join("alone");
    let (mb, vb): (Vec<half::bf16>, Vec<half::bf16>) = (
        m.iter().map(|&x| half::bf16::from_f32(x)).collect(),
        v.iter().map(|&x| half::bf16::from_f32(x)).collect(),
    );
    let moments = match state {
        OptimState::F32 => Moments::F32 { m: &m, v: &v },
        _ => Moments::Bf16 { m: &mb, v: &vb },
    };
    let st = trainer_state(&spec, 3);
    let one =
        ckpt::save_checkpoint_with(&alone, &spec, &whole, &params, &moments, &st, &opts).unwrap();
    let (a, b) = (files(&dir), files(&one));
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&a), names(&b), "{what}");
    if max_shard_bytes < ckpt::DEFAULT_MAX_SHARD_BYTES {
        assert!(
            a.iter().any(|(n, _)| n == ckpt::MODEL_INDEX_FILE),
            "{what}: sharded"
        );
    }
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{what}: {name} differs from one process's");
    }

    // Fresh tensor ranks load their parts back bitwise.
    let back = job(1, tensor, |mesh, comm| {
        let mut r = Rank::start(model, mesh, comm, state);
        assert_eq!(r.resume(&dir), trainer_state(&spec, 3));
        r.state()
    });
    for (rank, (x, y)) in back.iter().zip(parts).enumerate() {
        same_bits(&x.params, &y.params, &format!("{what} rank {rank}: params"));
        same_bits(&x.m, &y.m, &format!("{what} rank {rank}: m"));
        same_bits(&x.v, &y.v, &format!("{what} rank {rank}: v"));
    }
}

#[test]
fn two_tensor_ranks_save_gpt2_as_one_process_does() {
    saves_the_gathered_model(
        "gpt2-tiny",
        1,
        2,
        OptimState::F32,
        ckpt::DEFAULT_MAX_SHARD_BYTES,
    );
}

#[test]
fn two_tensor_ranks_save_llama_as_one_process_does_in_shards() {
    // Shards of at most 64 KiB: tensors of one file are gathered into several.
    saves_the_gathered_model("llama-tiny", 1, 2, OptimState::F32, 64 << 10);
}

#[test]
fn tensor_and_data_ranks_save_once_with_bf16_moments() {
    // Data rank 1's tensor ranks hold the same state and write nothing; bf16 moments are
    // flat arrays, each rank's part read from its runs of them.
    saves_the_gathered_model(
        "gpt2-tiny",
        2,
        2,
        OptimState::Bf16,
        ckpt::DEFAULT_MAX_SHARD_BYTES,
    );
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// A run of `model` on `first` tensor ranks saves after 2 steps and resumes on `then`
/// tensor ranks for 2 more: its losses and weights are one process's uninterrupted 4 steps'.
fn resumes_on_other_tensor_ranks(model: &str, first: usize, then: usize) {
    let what = format!("{model}: saved on --tp {first}, resumed on --tp {then}");
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let opts = SaveOptions::default();
    let reference = job(1, 1, |mesh, comm| {
        let mut r = Rank::start(model, mesh, comm, OptimState::F32);
        r.init();
        let losses = r.train(1..=STEPS);
        (losses, r.state())
    })
    .remove(0);
    let dirs = job(1, first, |mesh, comm| {
        let mut r = Rank::start(model, mesh, comm, OptimState::F32);
        r.init();
        let losses = r.train(1..=2);
        (losses, r.save(&run, 2, &opts))
    });
    for (losses, _) in &dirs {
        for (a, b) in losses.iter().zip(&reference.0) {
            assert!(
                rel(*a, *b) < 1e-5,
                "{what}: loss {a} vs {b} before the save"
            );
        }
    }
    let dir = dirs[0].1.clone();
    let resumed = job(1, then, |mesh, comm| {
        let mut r = Rank::start(model, mesh, comm, OptimState::F32);
        assert_eq!(r.resume(&dir).step, 2);
        let losses = r.train(3..=STEPS);
        (losses, r.state())
    });
    for (rank, (losses, _)) in resumed.iter().enumerate() {
        for (k, (a, b)) in losses.iter().zip(&reference.0[2..]).enumerate() {
            assert!(
                rel(*a, *b) < 1e-5,
                "{what} rank {rank} step {}: loss {a} vs {b}",
                k + 3
            );
        }
    }
    let whole = ParamLayout::new(&ModelSpec::preset(model).unwrap());
    let parts: Vec<Held> = resumed.into_iter().map(|(_, h)| h).collect();
    let mut params = match then {
        1 => parts[0].params.clone(),
        _ => gathered(&whole, &parts, |h| &h.params),
    };
    let reference = &reference.1.params;
    common::key_biases_within_noise(
        &whole,
        &mut params,
        reference,
        2.0 * hparams(1).lr * STEPS as f32,
        &what,
    );
    let w = worst_tensor(&whole, &params, reference);
    assert!(w < 1e-4, "{what}: weights differ by {w}");
}

#[test]
fn gpt2_saved_by_one_process_resumes_on_two_tensor_ranks_and_back() {
    resumes_on_other_tensor_ranks("gpt2-tiny", 1, 2);
    resumes_on_other_tensor_ranks("gpt2-tiny", 2, 1);
}

#[test]
fn llama_saved_by_one_process_resumes_on_two_tensor_ranks_and_back() {
    resumes_on_other_tensor_ranks("llama-tiny", 1, 2);
    resumes_on_other_tensor_ranks("llama-tiny", 2, 1);
}

/// A job's layout: data ranks (ZeRO stage `zero` on that axis) × tensor ranks.
#[derive(Clone, Copy, Debug)]
struct Layout {
    data: usize,
    tensor: usize,
    pipeline: usize,
    zero: u8,
}

impl Layout {
    const ONE: Layout = Layout {
        data: 1,
        tensor: 1,
        pipeline: 1,
        zero: 0,
    };

    fn new(data: usize, tensor: usize, zero: u8) -> Layout {
        Layout::staged(data, tensor, 1, zero)
    }

    fn staged(data: usize, tensor: usize, pipeline: usize, zero: u8) -> Layout {
        Layout {
            data,
            tensor,
            pipeline,
            zero,
        }
    }

    /// The ranks of data rank 0 (each stage's tensor ranks), in stage order.
    fn first_copy(self) -> Vec<usize> {
        let (t, d) = (self.tensor, self.data);
        (0..self.pipeline)
            .flat_map(|p| (0..t).map(move |r| r + t * d * p))
            .collect()
    }

    /// Runs `f` on each rank of this layout (threads), each started with its plan of
    /// `model` (moments as `state`, [`ROWS`] rows per step among the data ranks).
    fn run<T: Send>(
        self,
        model: &str,
        state: OptimState,
        f: impl Fn(&mut Rank) -> T + Sync,
    ) -> Vec<T> {
        staged_job((self.data, self.tensor, self.pipeline), |mesh, comm| {
            let at = (mesh, Zero(self.zero));
            let mut r = Rank::start_at(model, at, comm, state, ROWS / self.data);
            f(&mut r)
        })
    }
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dp {} x tp {} x pp {} zero {}",
            self.data, self.tensor, self.pipeline, self.zero
        )
    }
}

/// Rows of each step's global batch, whatever the layout.
const ROWS: usize = 2 * BATCH;

/// Asserts that checkpoints `a` and `b` hold the same files, byte for byte.
fn same_files(a: &Path, b: &Path, what: &str) {
    let (a, b) = (files(a), files(b));
    let names = |f: &[(String, Vec<u8>)]| f.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(names(&a), names(&b), "{what}");
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(x == y, "{what}: {name} differs");
    }
}

/// The ranks of `mesh` train `model` 3 steps and save (moments as `state`, weights in files
/// of at most `max_shard_bytes`). Unless the parameters are sharded (ZeRO 3) the saved
/// weights are the ranks' parts put together, bitwise. Loaded on each of `others` and on
/// fresh ranks of `mesh`, and saved again by each, the checkpoint comes back byte for byte:
/// what every layout writes of that state.
fn saves_what_every_layout_saves(
    model: &str,
    mesh: Layout,
    state: OptimState,
    max_shard_bytes: u64,
    others: &[Layout],
) {
    let zero = mesh.zero;
    let what = format!("{model} {mesh} {state}");
    let tmp = tempfile::tempdir().unwrap();
    let opts = SaveOptions {
        max_shard_bytes,
        ..SaveOptions::default()
    };
    let run = tmp.path().join("saved");
    let out = mesh.run(model, state, |r| {
        r.init();
        r.train(1..=3);
        let dir = r.save(&run, 3, &opts);
        let params =
            (zero < 3).then(|| (r.ex.download_params().unwrap(), r.ex.plan.layout.clone()));
        (dir, params)
    });
    let dir = out[0].0.clone();
    for (rank, (d, _)) in out.iter().enumerate() {
        assert_eq!(d, &dir, "{what} rank {rank}: the checkpoint's path");
    }
    let spec = ModelSpec::preset(model).unwrap();
    let whole = ParamLayout::new(&spec);
    let mut saved = vec![0f32; whole.total];
    ckpt::load_params(&dir, &whole, &mut saved).unwrap();
    if zero < 3 {
        let parts: Vec<Held> = (mesh.first_copy().into_iter())
            .map(|r| &out[r].1)
            .map(|p| {
                let (params, layout) = p.clone().unwrap();
                Held {
                    params,
                    m: Vec::new(),
                    v: Vec::new(),
                    layout,
                }
            })
            .collect();
        same_bits(
            &gathered(&whole, &parts, |h| &h.params),
            &saved,
            &format!("{what}: the saved weights"),
        );
    }
    if max_shard_bytes < ckpt::DEFAULT_MAX_SHARD_BYTES {
        assert!(
            dir.join(ckpt::MODEL_INDEX_FILE).exists(),
            "{what}: the weights in several files"
        );
    }
    for (k, &other) in others.iter().chain([&mesh]).enumerate() {
        let again = tmp.path().join(format!("again{k}"));
        let dirs = other.run(model, state, |r| {
            assert_eq!(r.resume(&dir), trainer_state(&spec, 3));
            r.save(&again, 3, &opts)
        });
        same_files(
            &dirs[0],
            &dir,
            &format!("{what}: loaded and saved by {other}"),
        );
    }
}

/// [`saves_what_every_layout_saves`] on dp 2 × tp 2 at ZeRO stage `zero`, loaded on one
/// process, on tp 2 and on dp 2 at that stage alone.
fn zero_and_tensor_ranks_save_as_every_layout(
    model: &str,
    zero: u8,
    state: OptimState,
    max_shard_bytes: u64,
) {
    let others = [Layout::ONE, Layout::new(1, 2, 0), Layout::new(2, 1, zero)];
    saves_what_every_layout_saves(
        model,
        Layout::new(2, 2, zero),
        state,
        max_shard_bytes,
        &others,
    );
}

#[test]
fn zero_1_with_tensor_ranks_saves_what_one_process_saves() {
    zero_and_tensor_ranks_save_as_every_layout(
        "gpt2-tiny",
        1,
        OptimState::F32,
        ckpt::DEFAULT_MAX_SHARD_BYTES,
    );
}

#[test]
fn zero_2_with_tensor_ranks_saves_bf16_moments_as_one_process_does() {
    zero_and_tensor_ranks_save_as_every_layout(
        "llama-tiny",
        2,
        OptimState::Bf16,
        ckpt::DEFAULT_MAX_SHARD_BYTES,
    );
}

#[test]
fn zero_3_with_tensor_ranks_saves_sharded_files_as_one_process_does() {
    // Parameters sharded along the data axis and cut along the tensor axis, in files of at
    // most 64 KiB.
    zero_and_tensor_ranks_save_as_every_layout("llama-tiny", 3, OptimState::F32, 64 << 10);
    zero_and_tensor_ranks_save_as_every_layout(
        "gpt2-tiny",
        3,
        OptimState::Bf16,
        ckpt::DEFAULT_MAX_SHARD_BYTES,
    );
}

#[test]
fn zero_alone_saves_int8_moments_sharded_at_block_edges_as_one_process_does() {
    // No tensor ranks (8-bit blocks are the whole tensors'): the block scales' shares.
    for zero in [1, 3] {
        saves_what_every_layout_saves(
            "gpt2-tiny",
            Layout::new(2, 1, zero),
            OptimState::Int8,
            ckpt::DEFAULT_MAX_SHARD_BYTES,
            &[Layout::ONE],
        );
    }
}

/// One process's uninterrupted [`STEPS`] steps of `model` (moments as `state`): the losses
/// and the weights.
fn uninterrupted(model: &str, state: OptimState) -> (Vec<f32>, Vec<f32>) {
    Layout::ONE
        .run(model, state, |r| {
            r.init();
            (r.train(1..=STEPS), r.ex.download_params().unwrap())
        })
        .remove(0)
}

/// `model` on layout `first` trains 2 steps and saves (moments as `reference`'s, given
/// with it); resumed on each of `then`, it trains 2 more and saves: its losses and weights
/// are `reference`'s (one process's uninterrupted run), losses within 1e-5 and weights
/// within 1e-4 (GPT-2's key bias: its noise bound).
fn resumes_on(
    model: &str,
    first: Layout,
    then: &[Layout],
    (reference, state): (&(Vec<f32>, Vec<f32>), OptimState),
) {
    let tmp = tempfile::tempdir().unwrap();
    let opts = SaveOptions::default();
    let run = tmp.path().join("first");
    let out = first.run(model, state, |r| {
        r.init();
        (r.train(1..=2), r.save(&run, 2, &opts))
    });
    for (rank, (losses, _)) in out.iter().enumerate() {
        for (a, b) in losses.iter().zip(&reference.0) {
            assert!(
                rel(*a, *b) < 1e-5,
                "{model} on {first} rank {rank}: loss {a} vs {b} before the save"
            );
        }
    }
    let dir = out[0].1.clone();
    let whole = ParamLayout::new(&ModelSpec::preset(model).unwrap());
    for (k, &then) in then.iter().enumerate() {
        let what = format!("{model}: saved on {first}, resumed on {then}");
        let last = tmp.path().join(format!("then{k}"));
        let out = then.run(model, state, |r| {
            assert_eq!(r.resume(&dir).step, 2);
            let losses = r.train(3..=STEPS);
            (losses, r.save(&last, STEPS, &opts))
        });
        for (rank, (losses, _)) in out.iter().enumerate() {
            for (s, (a, b)) in losses.iter().zip(&reference.0[2..]).enumerate() {
                assert!(
                    rel(*a, *b) < 1e-5,
                    "{what} rank {rank} step {}: loss {a} vs {b}",
                    s + 3
                );
            }
        }
        let mut params = vec![0f32; whole.total];
        ckpt::load_params(&out[0].1, &whole, &mut params).unwrap();
        let bound = 2.0 * hparams(1).lr * STEPS as f32;
        common::key_biases_within_noise(&whole, &mut params, &reference.1, bound, &what);
        // Tensor ranks' gradients differ from one process's in the last bits; 8-bit
        // moments round a few of those to another level (a step moved by a share of lr,
        // taken out by `int8_flips_within`) and leave the rest within 1e-5 each, which
        // a small tensor's norm sees as up to ~1e-4 (ZeRO's data ranks likewise,
        // `dist_train.rs`).
        let mut most = 1e-4;
        if state == OptimState::Int8 && first.tensor.max(then.tensor) > 1 {
            common::int8_flips_within(&whole, &mut params, &reference.1, bound, &what);
            most = 1e-3;
        }
        let w = worst_tensor(&whole, &params, &reference.1);
        assert!(w < most, "{what}: weights differ by {w}");
    }
}

/// At ZeRO stage `zero`: a run saved on dp 2 × tp 2 resumes on one process, on tp 2 alone
/// and on dp 2 at that stage alone; runs saved on each of those resume on dp 2 × tp 2; all
/// train on as one process's uninterrupted run.
fn zero_with_tensor_ranks_resumes_on_every_layout(model: &str, zero: u8) {
    let reference = uninterrupted(model, OptimState::F32);
    let both = Layout::new(2, 2, zero);
    let others = [Layout::ONE, Layout::new(1, 2, 0), Layout::new(2, 1, zero)];
    resumes_on(model, both, &others, (&reference, OptimState::F32));
    for other in others {
        resumes_on(model, other, &[both], (&reference, OptimState::F32));
    }
}

#[test]
fn zero_1_with_tensor_ranks_resumes_on_every_layout_and_back() {
    zero_with_tensor_ranks_resumes_on_every_layout("gpt2-tiny", 1);
}

#[test]
fn zero_2_with_tensor_ranks_resumes_on_every_layout_and_back() {
    zero_with_tensor_ranks_resumes_on_every_layout("llama-tiny", 2);
}

#[test]
fn zero_3_with_tensor_ranks_resumes_on_every_layout_and_back() {
    zero_with_tensor_ranks_resumes_on_every_layout("gpt2-tiny", 3);
    zero_with_tensor_ranks_resumes_on_every_layout("llama-tiny", 3);
}

/// Pipeline stages (`--pp 2`, alone and with tensor and data ranks at ZeRO 1) save what one
/// process saves of their state: rank 0 gathers each tensor from the stage that owns it (a
/// tied embedding: the first stage's; the last's copy is equal), and the checkpoint loads
/// back on one process, on tensor ranks, and on the stages themselves.
#[test]
fn pipeline_stages_save_what_one_process_saves() {
    let one = [Layout::ONE, Layout::new(1, 2, 0)];
    for model in ["gpt2-tiny", "llama-tiny"] {
        let f = ckpt::DEFAULT_MAX_SHARD_BYTES;
        saves_what_every_layout_saves(model, Layout::staged(1, 1, 2, 0), OptimState::F32, f, &one);
    }
    saves_what_every_layout_saves(
        "llama-tiny",
        Layout::staged(2, 2, 2, 1),
        OptimState::Bf16,
        64 << 10,
        &[Layout::ONE, Layout::staged(1, 1, 2, 0)],
    );
}

/// A run saved on pipeline stages resumes on one process and the reverse, at ZeRO 3 with
/// tensor ranks too, training on as one uninterrupted process.
#[test]
fn pipeline_stages_resume_on_one_process_and_back() {
    let reference = uninterrupted("gpt2-tiny", OptimState::F32);
    let staged = Layout::staged(1, 1, 2, 0);
    resumes_on(
        "gpt2-tiny",
        staged,
        &[Layout::ONE],
        (&reference, OptimState::F32),
    );
    resumes_on(
        "gpt2-tiny",
        Layout::ONE,
        &[staged],
        (&reference, OptimState::F32),
    );
    let reference = uninterrupted("llama-tiny", OptimState::F32);
    let every = Layout::staged(2, 2, 2, 3);
    resumes_on(
        "llama-tiny",
        every,
        &[Layout::ONE, staged],
        (&reference, OptimState::F32),
    );
}

/// 8-bit moments on pipeline stages (whole tensors: their blocks are one process's), alone
/// and with data ranks at ZeRO 1 and 3: rank 0 gathers each tensor's block scales from the
/// stage (and the data rank) holding them and saves what one process saves; the checkpoint
/// loads back on one process and on the stages, which save it again byte for byte.
#[test]
fn pipeline_stages_save_int8_moments_as_one_process_does() {
    let f = ckpt::DEFAULT_MAX_SHARD_BYTES;
    let staged = Layout::staged(1, 1, 2, 0);
    saves_what_every_layout_saves("gpt2-tiny", staged, OptimState::Int8, f, &[Layout::ONE]);
    for zero in [1, 3] {
        let both = Layout::staged(2, 1, 2, zero);
        saves_what_every_layout_saves(
            "llama-tiny",
            both,
            OptimState::Int8,
            f,
            &[Layout::ONE, staged],
        );
    }
}

/// A run with 8-bit moments saved on pipeline stages resumes on one process and the
/// reverse (and on stages of data ranks at ZeRO 1), training on as one uninterrupted
/// process does.
#[test]
fn pipeline_stages_resume_int8_moments_on_one_process_and_back() {
    let int8 = OptimState::Int8;
    let staged = Layout::staged(1, 1, 2, 0);
    for model in ["gpt2-tiny", "llama-tiny"] {
        let reference = uninterrupted(model, int8);
        resumes_on(model, staged, &[Layout::ONE], (&reference, int8));
        resumes_on(model, Layout::ONE, &[staged], (&reference, int8));
    }
    let reference = uninterrupted("llama-tiny", int8);
    let both = Layout::staged(2, 1, 2, 1);
    resumes_on(
        "llama-tiny",
        both,
        &[Layout::ONE, staged],
        (&reference, int8),
    );
}

/// 8-bit moments on tensor ranks (their parts' blocks are the whole tensors', each block's
/// scale agreed among the ranks holding its values), alone and with data ranks at ZeRO 1
/// and 3: rank 0 gathers the codes from each part and the scales from tensor rank 0, and
/// saves what one process saves; the checkpoint loads back on one process, on tensor
/// ranks and on data ranks, which save it again byte for byte.
#[test]
fn tensor_ranks_save_int8_moments_as_one_process_does() {
    let f = ckpt::DEFAULT_MAX_SHARD_BYTES;
    let tp = Layout::new(1, 2, 0);
    saves_what_every_layout_saves("gpt2-tiny", tp, OptimState::Int8, f, &[Layout::ONE]);
    for (model, zero) in [("llama-tiny", 1), ("gpt2-tiny", 3)] {
        zero_and_tensor_ranks_save_as_every_layout(model, zero, OptimState::Int8, f);
    }
}

/// A run with 8-bit moments saved on tensor ranks resumes on one process and the reverse
/// (and on tensor and data ranks at ZeRO 1), training on as one uninterrupted process does.
#[test]
fn tensor_ranks_resume_int8_moments_on_one_process_and_back() {
    let int8 = OptimState::Int8;
    let tp = Layout::new(1, 2, 0);
    for model in ["gpt2-tiny", "llama-tiny"] {
        let reference = uninterrupted(model, int8);
        resumes_on(model, tp, &[Layout::ONE], (&reference, int8));
        resumes_on(model, Layout::ONE, &[tp], (&reference, int8));
    }
    let reference = uninterrupted("llama-tiny", int8);
    let both = Layout::new(2, 2, 1);
    resumes_on("llama-tiny", both, &[Layout::ONE, tp], (&reference, int8));
}
