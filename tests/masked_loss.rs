//! The loss on trained tokens only (chat data): a batch of examples whose untrained targets
//! are marked ([`UNTRAINED`]) gives the mean of the unmasked per-token losses over the trained
//! targets, and that mean's gradients, for GPT-2 and Llama; accumulation and ranks give one
//! batch's; an all-untrained row adds nothing, and a step with nothing trained is a finite,
//! skipped step.

use memwall::backend::under_test as backend;
use memwall::data::examples::UNTRAINED;
use memwall::dist::{Comm, Local};
use memwall::exec::{Executor, OptimHparams};
use memwall::model::ModelSpec;
use memwall::plan::{Mode, StepConfig, build_plan};
use memwall::util::rng::Rng;
use std::sync::Arc;

const T: usize = 12;

fn gpt2() -> ModelSpec {
    memwall::model::gpt2::spec("micro", [61, 16, 16, 2, 2])
}

/// A Llama small enough for many plans: grouped-query attention, RoPE, SwiGLU, untied head.
fn llama() -> ModelSpec {
    let mut s = ModelSpec::preset("llama-tiny").unwrap();
    s.name = "micro-llama".into();
    (s.vocab_size, s.n_positions, s.n_embd, s.n_layer) = (61, 16, 16, 2);
    (s.n_head, s.n_kv_head, s.head_dim, s.mlp_hidden) = (4, 2, 4, 24);
    s.tied_embeddings = false;
    s.validate().unwrap();
    s
}

fn specs() -> [ModelSpec; 2] {
    [gpt2(), llama()]
}

/// An executor of `b` rows × `accum` of sequence `t`, parameters drawn with a spread that
/// puts every gradient well above f32 noise.
fn executor(spec: &ModelSpec, (b, accum, t): (usize, usize, usize)) -> Executor {
    executor_among(spec, (b, accum, t), Arc::new(memwall::dist::Single))
}

fn executor_among(
    spec: &ModelSpec,
    (b, accum, t): (usize, usize, usize),
    comm: Arc<dyn Comm>,
) -> Executor {
    let mut cfg = StepConfig::new(b, t, 1);
    cfg.grad_accum = accum;
    cfg.mesh = memwall::ir::Mesh::data_parallel(comm.size(), comm.rank());
    let plan = build_plan(spec, &cfg, Mode::Train, backend()).unwrap();
    let mut ex = Executor::among(plan, backend(), comm).unwrap();
    let layout = ex.plan.layout.clone();
    let mut rng = Rng::new(11);
    ex.with_params_mut(|p| {
        layout.init(p, 5);
        for x in p.iter_mut() {
            *x += 0.1 * rng.normal();
        }
    })
    .unwrap();
    ex
}

/// `rows` rows of T+1 random tokens below `v`.
fn tokens(rows: usize, v: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..rows * (T + 1))
        .map(|_| rng.below(v as u64) as u32)
        .collect()
}

/// `batch` with the tokens where `trained(row, position)` is false marked untrained.
fn mark(batch: &[u32], trained: impl Fn(usize, usize) -> bool) -> Vec<u32> {
    batch
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let (r, j) = (i / (T + 1), i % (T + 1));
            if trained(r, j) { x } else { x | UNTRAINED }
        })
        .collect()
}

/// (loss, gradients) of a masked batch.
fn masked(ex: &mut Executor, batch: &[u32]) -> (f32, Vec<f32>) {
    ex.upload_examples(batch).unwrap();
    let loss = ex.compute_gradients().unwrap();
    (loss, ex.download_grads().unwrap())
}

/// ‖a − b‖ / ‖b‖.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let n: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (d / n).sqrt()
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1e-6)
}

/// A chat-like mask: in each row a prompt (untrained), an answer (trained), then padding
/// (untrained); row 2 trains nothing.
fn chat_mask(r: usize, j: usize) -> bool {
    match r {
        0 => (4..9).contains(&j),
        1 => j >= 3 && j != 7,
        _ => false,
    }
}

#[test]
fn loss_is_the_mean_of_the_unmasked_losses_over_the_trained_targets() {
    for spec in specs() {
        let name = spec.name.clone();
        let mut ex = executor(&spec, (3, 1, T));
        let raw = tokens(3, spec.vocab_size, 1);
        // Everything trained: the per-target losses.
        ex.upload_batch(&raw).unwrap();
        let mean_all = ex.compute_gradients().unwrap();
        let all = ex.target_losses().unwrap();
        let g_all = ex.download_grads().unwrap();
        assert_eq!(all.len(), 3 * T);
        assert_eq!(ex.loss_tokens(), 3 * T);
        // The same batch with marks.
        let batch = mark(&raw, chat_mask);
        let (loss, g_s) = masked(&mut ex, &batch);
        let trained: Vec<usize> = (0..3 * T)
            .filter(|&i| chat_mask(i / T, i % T + 1))
            .collect();
        assert_eq!(ex.loss_tokens(), trained.len());
        let want = trained.iter().map(|&i| all[i] as f64).sum::<f64>() / trained.len() as f64;
        assert!(close(loss, want as f32), "{name}: {loss} vs {want}");
        // Untrained targets have no loss; trained ones the unmasked loss (rows are causal:
        // marks change no forward value).
        let per = ex.target_losses().unwrap();
        for i in 0..3 * T {
            let w = if trained.contains(&i) { all[i] } else { 0.0 };
            assert!(close(per[i], w), "{name}: target {i}: {} vs {w}", per[i]);
        }
        // Gradients: trained and untrained targets together are the whole batch's.
        let complement = mark(&raw, |r, j| j > 0 && !chat_mask(r, j));
        let (loss_c, g_c) = masked(&mut ex, &complement);
        let (k, n) = (trained.len() as f64, (3 * T) as f64);
        let sum: Vec<f32> = g_s
            .iter()
            .zip(&g_c)
            .map(|(&s, &c)| ((s as f64 * k + c as f64 * (n - k)) / n) as f32)
            .collect();
        let e = rel(&sum, &g_all);
        assert!(e < 1e-6, "{name}: gradients of the two halves: {e}");
        let l = (loss as f64 * k + loss_c as f64 * (n - k)) / n;
        assert!(close(l as f32, mean_all), "{name}: {l} vs {mean_all}");
    }
}

#[test]
fn a_trained_prefix_has_the_gradients_of_the_shorter_sequence_unmasked() {
    for spec in specs() {
        let name = spec.name.clone();
        let j = 7;
        let raw = tokens(3, spec.vocab_size, 2);
        // Row 0 trained on its first j targets; rows 1 and 2 nothing (all-untrained rows).
        let batch = mark(&raw, |r, p| r == 0 && p <= j);
        let (loss, g) = masked(&mut executor(&spec, (3, 1, T)), &batch);
        // The reference: row 0's first j + 1 tokens as a batch of one, sequence j, unmasked.
        let mut short = executor(&spec, (1, 1, j));
        short.upload_batch(&raw[..j + 1]).unwrap();
        let want = short.compute_gradients().unwrap();
        let g_ref = short.download_grads().unwrap();
        assert!(close(loss, want), "{name}: {loss} vs {want}");
        let e = rel(&g, &g_ref);
        assert!(e < 1e-6, "{name}: {e}");
    }
}

#[test]
fn accumulation_and_ranks_give_one_batch() {
    for spec in specs() {
        let name = spec.name.clone();
        let raw = tokens(2, spec.vocab_size, 3);
        // Row 0 a chat example, row 1 nothing trained: micro-batches and ranks of unequal
        // trained counts.
        let batch = mark(&raw, |r, j| r == 0 && chat_mask(r, j));
        let (loss, g) = masked(&mut executor(&spec, (2, 1, T)), &batch);
        let (loss_acc, g_acc) = masked(&mut executor(&spec, (1, 2, T)), &batch);
        assert!(close(loss_acc, loss), "{name}: {loss_acc} vs {loss}");
        let e = rel(&g_acc, &g);
        assert!(e < 1e-6, "{name}: accumulation {e}");

        // Ranks: each rank's gradients are padded for the collectives, so the step is
        // compared by its loss and its gradient norm (all-reduced: a wrong divisor or a lost
        // rank's share would change it), to 1e-6, and the weights it updates (AdamW's first
        // step is about lr·sign(g), which tiny gradients' last bits can flip: 1e-3).
        let mut one = executor(&spec, (2, 1, T));
        one.upload_examples(&batch).unwrap();
        let s1 = one.train_step(&hp(1)).unwrap();
        let p1 = one.download_params().unwrap();
        let group: Vec<Arc<dyn Comm>> = Local::group(2)
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Comm>)
            .collect();
        let w = T + 1;
        let outs: Vec<(f32, f32, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .enumerate()
                .map(|(rank, comm)| {
                    let (spec, batch) = (&spec, &batch);
                    s.spawn(move || {
                        let mut ex = executor_among(spec, (1, 1, T), comm);
                        ex.upload_examples(&batch[rank * w..(rank + 1) * w])
                            .unwrap();
                        assert_eq!(ex.loss_tokens(), 5, "every rank's trained targets");
                        let st = ex.train_step(&hp(1)).unwrap();
                        (st.loss, st.grad_norm, ex.download_params().unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (l, norm, p)) in outs.iter().enumerate() {
            assert!(
                close(*l, s1.loss),
                "{name}: rank {rank}: {l} vs {}",
                s1.loss
            );
            assert!(
                close(*norm, s1.grad_norm),
                "{name}: rank {rank}: gradient norm {norm} vs {}",
                s1.grad_norm
            );
            let e = rel(p, &p1);
            assert!(e < 1e-3, "{name}: rank {rank}: weights {e}");
        }
    }
}

fn hp(step: u64) -> OptimHparams {
    OptimHparams {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        grad_clip: 0.0,
        step,
    }
}

#[test]
fn a_step_with_nothing_trained_is_finite_and_skipped() {
    for spec in specs() {
        let name = spec.name.clone();
        let mut ex = executor(&spec, (2, 1, T));
        let before = ex.download_params().unwrap();
        let batch = mark(&tokens(2, spec.vocab_size, 4), |_, _| false);
        ex.upload_examples(&batch).unwrap();
        assert_eq!(ex.loss_tokens(), 0);
        let s = ex.train_step(&hp(1)).unwrap();
        assert_eq!(s.loss, 0.0, "{name}");
        assert_eq!(s.loss_tokens, 0);
        assert!(s.skipped && s.grad_norm == 0.0, "{name}: {s:?}");
        assert!(
            ex.download_grads().unwrap().iter().all(|&g| g == 0.0),
            "{name}"
        );
        assert_eq!(
            ex.download_params().unwrap(),
            before,
            "{name}: nothing updated"
        );
        assert_eq!(ex.eval_loss().unwrap(), 0.0);
        // The next batch with something trained trains as usual.
        let batch = mark(&tokens(2, spec.vocab_size, 5), chat_mask);
        ex.upload_examples(&batch).unwrap();
        let s = ex.train_step(&hp(1)).unwrap();
        assert!(
            s.loss > 0.0 && s.loss.is_finite() && !s.skipped,
            "{name}: {s:?}"
        );
        assert_ne!(ex.download_params().unwrap(), before);
    }
}

/// With the gradients on the disk tier the update is deferred to the next step's forward:
/// an empty step leaves none pending either.
#[test]
fn an_empty_step_defers_no_update() {
    let dir = tempfile::tempdir().unwrap();
    let spec = gpt2();
    let mut cfg = StepConfig::new(2, T, 1);
    cfg.offload.set = "grads".parse::<memwall::plan::OffloadSet>().unwrap();
    cfg.offload.dir = Some(dir.path().to_path_buf());
    let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
    assert!(plan.schedule.deferred_update);
    let mut ex = Executor::on(plan, backend()).unwrap();
    let layout = ex.plan.layout.clone();
    ex.with_params_mut(|p| layout.init(p, 5)).unwrap();
    let before = ex.download_params().unwrap();
    let batch = mark(&tokens(2, spec.vocab_size, 6), |_, _| false);
    ex.upload_examples(&batch).unwrap();
    let s = ex.train_step(&hp(1)).unwrap();
    assert!(s.skipped && s.loss == 0.0 && s.loss_tokens == 0, "{s:?}");
    ex.finish_update().unwrap();
    assert_eq!(ex.download_params().unwrap(), before, "nothing updated");
    let batch = mark(&tokens(2, spec.vocab_size, 7), chat_mask);
    ex.upload_examples(&batch).unwrap();
    let s = ex.train_step(&hp(2)).unwrap();
    assert!(!s.skipped && s.loss > 0.0, "{s:?}");
    ex.finish_update().unwrap();
    assert_ne!(ex.download_params().unwrap(), before);
}
