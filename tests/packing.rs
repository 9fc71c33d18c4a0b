//! Packed rows (chat data, the default for examples data sets): several examples in one row,
//! their positions restarting at each example's first token and attention kept within each
//! example, give the loss and every gradient of the same examples run one per row, for GPT-2
//! (learned positions) and Llama (RoPE, grouped-query attention) under every recompute
//! policy; and the loader packs rows first-fit, whole examples, marked as the executor reads
//! them.

use memwall::backend::under_test as backend;
use memwall::data::examples::{
    BitVec, EXAMPLE_START, Examples, UNTRAINED, fill_packed_rows, write_index, write_mask,
};
use memwall::data::shard::{Shard, write_shard};
use memwall::exec::Executor;
use memwall::ir::Recompute;
use memwall::model::ModelSpec;
use memwall::plan::{Mode, StepConfig, build_plan};
use memwall::util::rng::Rng;
use std::sync::Arc;

/// Rows of T + 1 = 97 tokens: long enough that examples cross the attention kernels' blocks
/// of 64 query rows.
const T: usize = 96;

fn gpt2() -> ModelSpec {
    memwall::model::gpt2::spec("micro", [61, 128, 16, 2, 2])
}

/// Grouped-query attention, RoPE, SwiGLU, untied head.
fn llama() -> ModelSpec {
    let mut s = ModelSpec::preset("llama-tiny").unwrap();
    s.name = "micro-llama".into();
    (s.vocab_size, s.n_positions, s.n_embd, s.n_layer) = (61, 128, 16, 2);
    (s.n_head, s.n_kv_head, s.head_dim, s.mlp_hidden) = (4, 2, 4, 24);
    s.tied_embeddings = false;
    s.validate().unwrap();
    s
}

/// An executor of `b` rows of T, rows packed or not, parameters drawn with a spread that
/// puts every gradient well above f32 noise.
fn executor(spec: &ModelSpec, b: usize, packed: bool, recompute: Recompute) -> Executor {
    let mut cfg = StepConfig::new(b, T, 1);
    cfg.packed = packed;
    cfg.recompute = recompute;
    let plan = build_plan(spec, &cfg, Mode::Train, backend()).unwrap();
    assert_eq!(plan.schedule.positions.len(), packed as usize);
    let mut ex = Executor::among(plan, backend(), Arc::new(memwall::dist::Single)).unwrap();
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

/// Examples of assorted lengths (one of a single token, one across the 64-row block edge),
/// each a prompt (untrained) then an answer (trained); tokens below `v`.
fn examples(v: usize) -> Vec<Vec<u32>> {
    let mut rng = Rng::new(3);
    [9, 1, 41, 17, 28]
        .iter()
        .map(|&len| {
            (0..len)
                .map(|j| {
                    let tok = rng.below(v as u64) as u32;
                    if j < len / 3 { tok | UNTRAINED } else { tok }
                })
                .collect()
        })
        .collect()
}

const PAD: u32 = 0;

/// One row of T + 1 tokens packing `ex` as the loader does: each example's first token
/// untrained, the later ones' (and the padding's) also `EXAMPLE_START`.
fn packed_row(ex: &[Vec<u32>]) -> Vec<u32> {
    let mut row = Vec::new();
    for e in ex {
        let at = row.len();
        row.extend(e);
        row[at] |= UNTRAINED;
        if at > 0 {
            row[at] |= EXAMPLE_START;
        }
    }
    assert!(row.len() < T + 1, "the examples fill the row");
    let at = row.len();
    row.resize(T + 1, PAD | UNTRAINED);
    row[at] |= EXAMPLE_START;
    row
}

/// The same examples one per row, padded.
fn unpacked_rows(ex: &[Vec<u32>]) -> Vec<u32> {
    let mut rows = Vec::new();
    for e in ex {
        let at = rows.len();
        rows.extend(e);
        rows[at] |= UNTRAINED;
        rows.resize(at + T + 1, PAD | UNTRAINED);
    }
    rows
}

const POLICIES: [Recompute; 4] = [
    Recompute::None,
    Recompute::Selective,
    Recompute::Full,
    Recompute::Every(2),
];

#[test]
fn a_packed_row_trains_as_its_examples_one_per_row() {
    for spec in [gpt2(), llama()] {
        let ex = examples(spec.vocab_size);
        let (packed, unpacked) = (packed_row(&ex), unpacked_rows(&ex));
        for policy in POLICIES {
            let what = format!("{} recompute {policy:?}", spec.name);
            let mut one = executor(&spec, 1, true, policy);
            one.upload_examples(&packed).unwrap();
            let loss = one.compute_gradients().unwrap();
            let (n, g) = (one.loss_tokens(), one.download_grads().unwrap());
            let mut many = executor(&spec, ex.len(), false, policy);
            many.upload_examples(&unpacked).unwrap();
            let want = many.compute_gradients().unwrap();
            let g_want = many.download_grads().unwrap();
            assert_eq!(n, many.loss_tokens(), "{what}: trained targets");
            assert!(
                (loss - want).abs() <= 1e-6 * want.abs(),
                "{what}: loss {loss} vs {want}"
            );
            let e = rel(&g, &g_want);
            assert!(e < 1e-6, "{what}: gradients differ by {e:e}");
            // Per-target losses: each example's, in place.
            let (per, per_want) = (one.target_losses().unwrap(), many.target_losses().unwrap());
            let mut at = 0;
            for (k, e) in ex.iter().enumerate() {
                for j in 0..e.len() - 1 {
                    let (a, b) = (per[at + j], per_want[k * T + j]);
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                        "{what}: example {k} target {j}: {a} vs {b}"
                    );
                }
                // The example's last token predicts the next example's first: untrained.
                assert_eq!(per[at + e.len() - 1], 0.0, "{what}: across examples");
                at += e.len();
            }
        }
    }
}

/// Without marks a packed plan trains a row as one sequence: its positions are the row's.
#[test]
fn a_packed_plan_on_one_example_a_row_is_the_unpacked_plan() {
    for spec in [gpt2(), llama()] {
        let ex = examples(spec.vocab_size);
        let rows = unpacked_rows(&ex);
        let mut a = executor(&spec, ex.len(), true, Recompute::None);
        a.upload_examples(&rows).unwrap();
        let la = a.compute_gradients().unwrap();
        let mut b = executor(&spec, ex.len(), false, Recompute::None);
        b.upload_examples(&rows).unwrap();
        let lb = b.compute_gradients().unwrap();
        assert_eq!(la.to_bits(), lb.to_bits(), "{}: loss", spec.name);
        assert!(
            a.download_grads().unwrap() == b.download_grads().unwrap(),
            "{}: gradients",
            spec.name
        );
    }
}

/// A split of `lens` examples (token `i` of example `k` is `100·k + i`; every token trained)
/// in `dir`.
fn split(dir: &std::path::Path, lens: &[usize]) -> Examples {
    let tokens: Vec<u32> = lens
        .iter()
        .enumerate()
        .flat_map(|(k, &n)| (0..n).map(move |i| (100 * k + i) as u32))
        .collect();
    let path = dir.join("train.bin");
    write_shard(&path, &tokens, 10_000).unwrap();
    let mut offsets = vec![0u64];
    for &n in lens {
        offsets.push(offsets.last().unwrap() + n as u64);
    }
    write_index(&dir.join("train.idx"), &offsets).unwrap();
    let mut bits = BitVec::default();
    for _ in 0..tokens.len() {
        bits.push(1);
    }
    write_mask(&dir.join("train.mask"), bits.bytes(), bits.len()).unwrap();
    Examples::open(dir, "train", Arc::new(Shard::open(&path).unwrap())).unwrap()
}

#[test]
fn the_loader_packs_whole_examples_first_fit_and_marks_them() {
    let dir = tempfile::tempdir().unwrap();
    // Lengths 3..=40 and one longer than a row (cut, alone in its row).
    let mut lens: Vec<usize> = (3..=40).collect();
    lens.push(150);
    let ex = split(dir.path(), &lens);
    let (b, t, pad) = (6, 63, 7777);
    let mut whole = vec![0u32; b * (t + 1)];
    fill_packed_rows(&ex, (b, t), (5, 9), (0, b), pad, &mut whole).unwrap();
    // Drawn again: the same rows; two ranks' parts are the whole batch's rows.
    let mut again = vec![0u32; b * (t + 1)];
    fill_packed_rows(&ex, (b, t), (5, 9), (0, b), pad, &mut again).unwrap();
    assert_eq!(whole, again);
    let mut parts = vec![0u32; b * (t + 1)];
    for (r, part) in parts.chunks_mut(b / 2 * (t + 1)).enumerate() {
        fill_packed_rows(&ex, (b / 2, t), (5, 9), (r * b / 2, b), pad, part).unwrap();
    }
    assert_eq!(whole, parts);
    let mut filled = 0;
    for row in whole.chunks(t + 1) {
        // Split the row at its marks; each piece is an example's first tokens (whole, or cut
        // at the row's end when longer than the row), or padding.
        let mut starts: Vec<usize> = (1..t + 1)
            .filter(|&i| row[i] & EXAMPLE_START != 0)
            .collect();
        starts.insert(0, 0);
        starts.push(t + 1);
        for w in starts.windows(2) {
            let piece = &row[w[0]..w[1]];
            assert_ne!(
                piece[0] & UNTRAINED,
                0,
                "an example's first token is untrained"
            );
            let id = |x: u32| x & !(UNTRAINED | EXAMPLE_START);
            if id(piece[0]) == pad {
                assert_eq!(w[1], t + 1, "padding ends the row");
                assert!(piece.iter().all(|&x| id(x) == pad && x & UNTRAINED != 0));
                continue;
            }
            filled += piece.len();
            let k = id(piece[0]) as usize / 100;
            let want = lens[k].min(t + 1);
            assert_eq!(piece.len(), want, "example {k} whole (or cut to the row)");
            for (i, &x) in piece.iter().enumerate() {
                assert_eq!(id(x) as usize, 100 * k + i);
                assert_eq!(x & UNTRAINED != 0, i == 0, "example {k} token {i}");
            }
        }
    }
    // First-fit leaves little room: at most a short gap per row.
    assert!(
        filled * 10 >= 9 * b * (t + 1),
        "rows {filled} of {} tokens filled",
        b * (t + 1)
    );
}
