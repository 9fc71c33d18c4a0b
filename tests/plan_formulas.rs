//! The plan against published figures, exactly: every byte a rank's plan holds next to the
//! formula it is usually checked against, with each difference a named term whose bytes the
//! test computes from the model's dimensions (never from the plan), so any change of the
//! planner's buffers fails here and has to be explained.
//!
//! **Model state per rank** (`model_state_per_rank_is_megatrons_formula_with_every_difference_named`)
//! against Megatron-LM's `megatron/training/theoretical_memory_usage.py`
//! (`compute_weight_and_optimizer_memory`): a rank holds
//! `Ψ_M = (P_layers/pp + V·h)/tp` parameters (`+ V·h/tp` more when the LM head is untied), with
//! `P_layers = L·(2h·(f·g + n) + 2h²·(1 + k/a)·(q/h)) + n·h` (f the MLP width, g = 3/2 for
//! SwiGLU, n = 2 for LayerNorm's weight and bias and 1 for RMSNorm, k key/value heads of a
//! query heads, q = a·head size), at 18 bytes each (bf16 weights 2, fp32 gradients 4, fp32
//! master weights 4, Adam's two fp32 moments 8), or `6 + 12/dp` with the distributed
//! optimizer (the master weights and moments sharded over the data ranks). memwall's side is
//! the rank's bytes by category as `memwall plan --ranks N --tp T --zero K --json` prints them
//! (`plan::ranks::every_rank`: param or master, grad, optimizer_state; every buffer declared,
//! transient ones counted once), for GPT-2 (LayerNorm, biases, tied head, learned positions)
//! and a Llama with grouped-query attention (RMSNorm, SwiGLU, untied head), bf16 and fp32,
//! tp ∈ {1, 2, 4} on one stage and tp ∈ {1, 2} on two pipeline stages (each stage's ranks
//! against the formula's most loaded stage, the differences of each stage named), ZeRO 0–3,
//! dp ∈ {1, 2}. The differences are listed in [`param_terms`] and [`byte_terms`], each with
//! why.
//!
//! **Activations per layer** (`activations_per_layer_are_korthikantis_with_every_difference_named`)
//! against Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
//! Models" (arXiv:2205.05198), Table 2, 16-bit activations, bytes per layer: `sbh(34 +
//! 5as/h)` without parallelism, `sbh(10 + 24/t + 5as/(ht))` with tensor parallelism (t ranks),
//! `sbh(34/t + 5as/(ht))` with sequence parallelism too, `sbh(10 + 24/t)` and `sbh(34/t)` with
//! their selective recomputation (the attention core: QKᵀ, softmax, its dropout), and `2sbh`
//! with full recomputation (s sequence, b micro-batch, h hidden, a heads), every form checked
//! (t = 1 gives the first; sequence parallelism with `--sequence-parallel`). memwall's side
//! is the activation buffers of block l (`h{l}.*`) alive across the forward/backward boundary
//! (written before the first backward op, read at or after it), for a GPT-2 layer (the shapes
//! the paper assumes: MLP width 4h, head size h/a, GELU, LayerNorm), term by term in
//! [`korthikanti_rows`].

use memwall::backend::under_test as backend;
use memwall::ir::{Category, Mesh, Phase, Precision, Recompute, Zero};
use memwall::model::{Family, ModelSpec, Norm};
use memwall::plan::ranks::every_rank;
use memwall::plan::{Mode, Plan, StepConfig, build_plan};
use std::collections::BTreeMap;

/// Shard lengths are rounded up to this many elements (`ir::shard::SHARD_ALIGN`, ZeRO's
/// even cut): part of the plan's layout that the formulas know nothing of.
const SHARD_ALIGN: i128 = 16;

/// `a / b`, which the shapes chosen here make exact (a formula's division by t or dp).
fn exact(a: i128, b: i128) -> i128 {
    assert_eq!(
        a % b,
        0,
        "{a} / {b} is not whole: choose shapes that divide"
    );
    a / b
}

/// A named difference between memwall's figure and the formula's: its bytes (or
/// parameters); the comment where it is made says why it exists.
#[derive(Debug)]
struct Term {
    name: &'static str,
    value: i128,
}

fn term(name: &'static str, value: i128) -> Term {
    Term { name, value }
}

/// The terms as lines `name: value`, for failure messages.
fn listing<'a>(terms: impl IntoIterator<Item = &'a Term>) -> String {
    terms
        .into_iter()
        .map(|t| format!("\n  {}: {}", t.name, t.value))
        .collect()
}

fn sum(terms: &[Term]) -> i128 {
    terms.iter().map(|t| t.value).sum()
}

/// The model dimensions the formulas take, read from the spec.
struct Dims {
    v: i128,
    /// Learned position embeddings (0 with rotary positions).
    positions: i128,
    h: i128,
    l: i128,
    a: i128,
    kv: i128,
    head: i128,
    ffn: i128,
    /// Weight and bias (LayerNorm) or weight (RMSNorm).
    norm: i128,
    swiglu: bool,
    tied: bool,
    gpt2: bool,
}

fn dims(spec: &ModelSpec) -> Dims {
    let gpt2 = spec.family == Family::Gpt2;
    Dims {
        v: spec.vocab_size as i128,
        positions: if gpt2 { spec.n_positions as i128 } else { 0 },
        h: spec.n_embd as i128,
        l: spec.n_layer as i128,
        a: spec.n_head as i128,
        kv: spec.n_kv_head as i128,
        head: spec.head_dim as i128,
        ffn: spec.mlp_hidden as i128,
        norm: if spec.norm == Norm::LayerNorm { 2 } else { 1 },
        swiglu: !gpt2,
        tied: spec.tied_embeddings,
        gpt2,
    }
}

/// A pipeline stage: `s` of `pp`.
#[derive(Clone, Copy, Debug)]
struct Stage {
    pp: i128,
    s: i128,
}

impl Stage {
    fn first(self) -> bool {
        self.s == 0
    }
    fn last(self) -> bool {
        self.s + 1 == self.pp
    }
    /// Its layers of `l` (`PipelineStage::layers`: as even as they divide).
    fn layers(self, l: i128) -> i128 {
        l / self.pp + i128::from(self.s < l % self.pp)
    }
}

/// Megatron's parameters on the most loaded rank: `(P_layers/pp + V·h)/tp`, plus `V·h/tp` for
/// an untied head when pp = 1 (the first stage, with the embedding, is the most loaded; the
/// last holds the head, or a copy of a tied embedding, in its place: the same count). Its
/// formula has no biases and no position embeddings, and divides everything (norms
/// included) by tp and pp.
fn megatron_params(d: &Dims, tp: i128, pp: i128) -> i128 {
    let q = d.a * d.head;
    // 2h·(f·g + n) with g = 3/2 for SwiGLU: written as 2h·f·g = 3h·f.
    let mlp = if d.swiglu {
        3 * d.h * d.ffn
    } else {
        2 * d.h * d.ffn
    };
    let norms = 2 * d.h * d.norm;
    // 2h²·(1 + k/a)·(q/h) = 2h·q + 2h·q·k/a.
    let attn = 2 * d.h * q + exact(2 * d.h * q * d.kv, d.a);
    let block = d.l * (mlp + norms + attn) + d.norm * d.h;
    let emb = d.v * d.h;
    exact(exact(block, pp) + emb, tp) + if d.tied || pp > 1 { 0 } else { exact(emb, tp) }
}

/// Rows of the vocabulary tensor rank `tr` of `tp` holds (`TensorSplit::vocab_part`: whole
/// rows, as even as they divide, none padded).
fn vocab_rows(d: &Dims, tp: i128, tr: i128) -> i128 {
    (tr + 1) * d.v / tp - tr * d.v / tp
}

/// The parameter groups of tensor rank `tr` of stage `st` as memwall lays them out (the
/// embeddings on the first stage, and a tied one's copy on the last; the stage's blocks; the
/// final norm and an untied head on the last), their sizes from the dimensions: its rows of
/// the vocabulary, norms, positions and the row-parallel biases whole, the rest 1/tp.
fn memwall_groups(d: &Dims, tp: i128, tr: i128, st: Stage) -> Vec<i128> {
    let (h, q, kvw) = (d.h, d.a * d.head, d.kv * d.head);
    let block = if d.gpt2 {
        // ln_1, c_attn (w, b: column), c_proj (w: row, b whole), ln_2, c_fc (column),
        // mlp c_proj (w: row, b whole).
        2 * h
            + exact(3 * h * h + 3 * h, tp)
            + exact(h * h, tp)
            + h
            + 2 * h
            + exact(d.ffn * h + d.ffn, tp)
            + exact(d.ffn * h, tp)
            + h
    } else {
        // input norm, q/k/v (rows), o (columns), post-attention norm, gate/up (rows), down.
        h + exact((q + 2 * kvw) * h, tp) + exact(q * h, tp) + h + exact(3 * d.ffn * h, tp)
    };
    let rows = vocab_rows(d, tp, tr);
    let mut groups = Vec::new();
    if st.first() || (st.last() && d.tied) {
        // GPT-2's last stage keeps the whole `embed` group (wte and wpe).
        groups.push(rows * h + d.positions * h);
    }
    groups.extend((0..st.layers(d.l)).map(|_| block));
    if st.last() {
        groups.push(d.norm * h);
        if !d.tied {
            groups.push(rows * h);
        }
    }
    groups
}

/// memwall's parameters on tensor rank `tr` of stage `st` minus Megatron's, term by term.
fn param_terms(d: &Dims, tp: i128, tr: i128, st: Stage) -> Vec<Term> {
    let h = d.h;
    // The stage's tensors of vocabulary rows: one (an embedding, a head, a tied copy), or
    // both an untied model's in one stage.
    let heads = if d.tied || st.pp > 1 { 1 } else { 2 };
    let layers = st.layers(d.l);
    let mut t = vec![
        // Both cut the embedding (and an untied head) by vocabulary rows; the formula
        // divides V·h by tp, memwall gives each rank whole rows (GPT-2's 50257 among 2 or 4
        // ranks: one more on some), where Megatron would pad the vocabulary.
        term(
            "whole rows of the vocabulary: (rows − V/tp)·h each",
            heads * (vocab_rows(d, tp, tr) * h - exact(d.v * h, tp)),
        ),
        // Megatron's formula divides every norm by tp and pp; Megatron itself (and memwall)
        // keeps them whole on every tensor rank, and each stage holds its own (the last the
        // final norm).
        term(
            "the stage's norms whole, not (2L + 1)·n·h/(pp·tp)",
            (2 * layers + i128::from(st.last())) * d.norm * h
                - exact((2 * d.l + 1) * d.norm * h, st.pp * tp),
        ),
    ];
    if d.gpt2 {
        // The formula counts no position embedding (GPT-2's wpe, whole on every rank; the
        // last stage keeps it beside the tied embedding, in the group summed between the
        // two ends, its gradient zero there).
        t.push(term("learned positions: P·h", d.positions * h));
        // Nor any bias: column-parallel ones (c_attn 3h, c_fc f) are cut with their
        // weights, row-parallel ones (the two c_proj, h each) whole on every tensor rank.
        t.push(term(
            "biases: L_stage·((3h + f)/tp + 2h)",
            layers * (exact(3 * h + d.ffn, tp) + 2 * h),
        ));
    }
    t
}

/// Which part of the model state a byte term belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Part {
    /// Weights: memwall's `param` (fp32) or `master` (mixed precision) buffers; Megatron's
    /// bf16 weights and fp32 master weights.
    Weights,
    Grads,
    Moments,
}

/// One configuration of ranks and precision.
#[derive(Clone, Copy, Debug)]
struct Job {
    tp: usize,
    pp: usize,
    dp: usize,
    zero: u8,
    precision: Precision,
}

/// The rank's ZeRO cut: each group of n elements in `dp` chunks of S = ⌈n/dp⌉ rounded up to
/// [`SHARD_ALIGN`] (`ir::Sharding::even`), whenever the plan is sharded (dp > 1 or a stage).
/// Returns each group's padded length dp·S (n when not sharded).
fn padded(groups: &[i128], job: Job) -> Vec<i128> {
    let dp = job.dp as i128;
    if job.dp == 1 && job.zero == 0 {
        return groups.to_vec();
    }
    let shard = |n: i128| ((n + dp - 1) / dp + SHARD_ALIGN - 1) / SHARD_ALIGN * SHARD_ALIGN;
    groups.iter().map(|&n| dp * shard(n)).collect()
}

/// Megatron's model-state bytes per rank, by part, at `psi` parameters: bf16 weights 2 and
/// fp32 master weights 4, fp32 gradients 4, moments 8; with the distributed optimizer (the
/// counterpart of ZeRO ≥ 1) the master weights and moments over dp.
fn megatron_bytes(psi: i128, job: Job) -> BTreeMap<Part, i128> {
    let d = if job.zero >= 1 { job.dp as i128 } else { 1 };
    BTreeMap::from([
        (Part::Weights, 2 * psi + exact(4 * psi, d)),
        (Part::Grads, 4 * psi),
        (Part::Moments, exact(8 * psi, d)),
    ])
}

/// memwall's bytes minus Megatron's, by part, term by term (`psi` memwall's parameters on
/// the rank, `delta` those beyond Megatron's count, `groups` the rank's groups, of stage
/// `st`).
fn byte_terms(
    psi: i128,
    delta: i128,
    (groups, tied, st): (&[i128], bool, Stage),
    job: Job,
) -> Vec<(Part, Term)> {
    let dp = job.dp as i128;
    let d = if job.zero >= 1 { dp } else { 1 };
    let g: i128 = if job.precision == Precision::F32 {
        4
    } else {
        2
    };
    let each = padded(groups, job);
    let whole: i128 = each.iter().sum();
    let (pad, s) = (whole - psi, exact(whole, dp));
    let mut t = vec![
        // The parameters Megatron's formula does not count, or splits where memwall does
        // not ([`param_terms`]), at the formula's bytes for each part.
        (
            Part::Weights,
            term(
                "layout (params beyond the formula's) × (2 + 4/d)",
                2 * delta + exact(4 * delta, d),
            ),
        ),
        (Part::Grads, term("layout × 4", 4 * delta)),
        (Part::Moments, term("layout × 8/d", exact(8 * delta, d))),
        // memwall keeps one copy of the weights, fp32 (master under mixed precision, which
        // kernels read and round per tile); Megatron keeps a bf16 copy beside its fp32
        // master weights (and its formula counts 18 bytes whatever the precision).
        (
            Part::Weights,
            term("no 2-byte working copy of the weights", -2 * psi),
        ),
        // memwall stores gradients in the storage type (bf16 under mixed precision);
        // Megatron accumulates fp32 main gradients.
        (
            Part::Grads,
            term("gradients in the storage type, not fp32", (g - 4) * psi),
        ),
    ];
    if job.dp > 1 || job.zero >= 1 {
        // ZeRO's even cut pads each group's gradients (and, at stages 1–3, its weights)
        // to dp·S, so the ring collectives run in place.
        t.push((Part::Grads, term("padding of the whole gradients", g * pad)));
    }
    match job.zero {
        0 => {}
        1 | 2 => {
            // Stages 1 and 2 keep the fp32 weights whole (padded) on every data rank: the
            // updated shard is all-gathered into them. Megatron's distributed optimizer
            // shards its fp32 master weights and keeps its bf16 ones whole.
            t.push((
                Part::Weights,
                term(
                    "fp32 weights whole, not a 1/dp master shard",
                    4 * psi - exact(4 * psi, dp),
                ),
            ));
            t.push((Part::Weights, term("padding of the whole weights", 4 * pad)));
        }
        _ => {
            // Stage 3 keeps a shard of the weights; Megatron's bf16 weights whole are the
            // 2-byte copy already counted away above.
            t.push((
                Part::Weights,
                term("padding of the weight shard", 4 * s - exact(4 * psi, dp)),
            ));
            // And gathers each group whole (padded) for each span of ops that uses it, a
            // transient copy in the weights' category: a block or the final norm twice (its
            // forward, its backward); a tied embedding in one stage twice (the encoder, then
            // the LM head's forward and backward); an untied embedding, or either end's copy
            // of a tied one, once (the encoder's backward reads no weights), and an untied
            // head once (its forward and backward).
            let one_stage = st.pp == 1;
            let embed = st.first() || tied;
            let spans = |k: usize| match k {
                0 if embed => 1 + i128::from(tied && one_stage),
                k if k == each.len() - 1 && st.last() && !tied => 1,
                _ => 2,
            };
            let copies = each
                .iter()
                .enumerate()
                .map(|(k, &n)| spans(k) * 4 * n)
                .sum();
            t.push((
                Part::Weights,
                term("stage 3: gathered copies, one per span", copies),
            ));
        }
    }
    if job.zero >= 1 {
        // The rank's reduce-scattered gradients go to a buffer of their own
        // (`{group}.grad.shard`); Megatron reduce-scatters within its whole gradient buffer.
        // With one micro-batch stage 2 declares the buffers stage 1 does (each group's whole
        // gradients are freed once reduce-scattered at both).
        t.push((Part::Grads, term("gradient shard buffer", g * s)));
        t.push((
            Part::Moments,
            term("padding of the moment shards", 8 * s - exact(8 * psi, dp)),
        ));
    }
    t
}

/// A GPT-2-shaped model (the `gpt2` preset: 124M, 12 heads, so tp 4 divides) and a Llama
/// with grouped-query attention and an untied head (12 query heads of 22 channels over 4
/// key/value heads, SwiGLU width 688, Llama 2's vocabulary). GPT-2's groups divide evenly
/// among 2 data ranks in shards of 16; the Llama's width (264) does not, so ZeRO's padding
/// is exercised.
fn models() -> Vec<ModelSpec> {
    let llama = ModelSpec::from_hf_config_str(
        r#"{"model_type": "llama", "vocab_size": 32000, "hidden_size": 264,
            "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 12,
            "num_key_value_heads": 4, "max_position_embeddings": 128,
            "tie_word_embeddings": false, "hidden_act": "silu"}"#,
        "llama-gqa",
    )
    .unwrap();
    vec![ModelSpec::preset("gpt2").unwrap(), llama]
}

/// Bytes of category `name` in a rank's figures (0 when it has none).
fn cat(by: &BTreeMap<String, u64>, name: &str) -> i128 {
    by.get(name).copied().unwrap_or(0) as i128
}

#[test]
fn model_state_per_rank_is_megatrons_formula_with_every_difference_named() {
    let mut checked = 0;
    for spec in models() {
        let d = dims(&spec);
        for precision in [Precision::Bf16, Precision::F32] {
            for (tp, pp) in [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)] {
                for zero in 0..=3u8 {
                    for dp in [1, 2] {
                        let job = Job {
                            tp,
                            pp,
                            dp,
                            zero,
                            precision,
                        };
                        let t = job.tp as i128;
                        let mut cfg = StepConfig::new(1, 64, 1);
                        cfg.mesh = Mesh {
                            data: dp,
                            tensor: tp,
                            pipeline: job.pp,
                            rank: 0,
                        };
                        cfg.zero = Zero(zero);
                        cfg.precision = precision;
                        let ranks = every_rank(&spec, &cfg, backend(), 0).unwrap();
                        assert_eq!(ranks.len(), tp * dp * pp);

                        // Bytes, part by part: Megatron's at its count plus the named terms.
                        let megatron = megatron_params(&d, t, pp as i128);
                        let formula = megatron_bytes(megatron, job);
                        let per_param = if zero >= 1 {
                            6 * megatron + exact(12 * megatron, dp as i128)
                        } else {
                            18 * megatron
                        };
                        assert_eq!(formula.values().sum::<i128>(), per_param);
                        for r in &ranks {
                            // Parameters: Megatron's count plus the named terms.
                            let tr = r.coords.tp as i128;
                            let st = Stage {
                                pp: pp as i128,
                                s: r.coords.pp as i128,
                            };
                            let pterms = param_terms(&d, t, tr, st);
                            let psi = megatron + sum(&pterms);
                            let groups = memwall_groups(&d, t, tr, st);
                            assert_eq!(groups.iter().sum::<i128>(), psi, "{}: groups", spec.name);
                            let tied = (&groups[..], d.tied, st);
                            let bterms = byte_terms(psi, sum(&pterms), tied, job);
                            let want = |part: Part| {
                                formula[&part]
                                    + bterms
                                        .iter()
                                        .filter(|(p, _)| *p == part)
                                        .map(|(_, t)| t.value)
                                        .sum::<i128>()
                            };
                            let by = &r.by_category;
                            let got = BTreeMap::from([
                                (Part::Weights, cat(by, "param") + cat(by, "master")),
                                (Part::Grads, cat(by, "grad")),
                                (Part::Moments, cat(by, "optimizer_state")),
                            ]);
                            let ctx = || {
                                format!(
                                    "{} {job:?} rank {}: memwall {got:?}\nMegatron {formula:?} \
                                     (Ψ_M {megatron})\nparameter terms:{}\nbyte terms:{}",
                                    spec.name,
                                    r.rank,
                                    listing(&pterms),
                                    listing(bterms.iter().map(|(_, t)| t)),
                                )
                            };
                            assert_eq!(r.num_params as i128, psi, "{}", ctx());
                            for part in [Part::Weights, Part::Grads, Part::Moments] {
                                assert_eq!(got[&part], want(part), "{part:?}: {}", ctx());
                            }
                            // Under mixed precision the weights are master, else param.
                            let (whole, none) = match precision {
                                Precision::F32 => ("param", "master"),
                                _ => ("master", "param"),
                            };
                            assert!(cat(by, whole) > 0 && cat(by, none) == 0, "{}", ctx());
                            // And the whole: Megatron's bytes per parameter, plus every term.
                            let total: i128 = got.values().sum();
                            let terms: i128 = bterms.iter().map(|(_, t)| t.value).sum();
                            assert_eq!(total, per_param + terms, "{}", ctx());
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, 2 * 2 * 5 * 4 * 2);
}

/// One row of Korthikanti's per-layer table beside memwall's buffer for it: the paper's
/// bytes, memwall's buffer (name after `h{l}.`) and its bytes.
#[derive(Debug)]
struct Row {
    what: &'static str,
    paper: i128,
    buffer: Option<&'static str>,
    memwall: i128,
}

fn row(what: &'static str, paper: i128, buffer: Option<&'static str>, memwall: i128) -> Row {
    Row {
        what,
        paper,
        buffer,
        memwall,
    }
}

/// Korthikanti's Table 2 rows for one layer under tensor parallelism (16-bit activations, t
/// ranks, with sequence parallelism or not) and memwall's counterpart of each, for a GPT-2
/// layer of `s` positions, `b` rows, width `h`, `a` heads under `recompute`.
fn korthikanti_rows(
    (s, b, h, a): (i128, i128, i128, i128),
    (t, sp): (i128, bool),
    recompute: Recompute,
) -> Vec<Row> {
    let sbh = s * b * h;
    // What sequence parallelism cuts among the t ranks (the norms, their inputs and
    // outputs, the dropouts outside the attention core): whole without it.
    let q = if sp { t } else { 1 };
    let (keep_all, selective) = (
        recompute == Recompute::None,
        recompute == Recompute::Selective,
    );
    // What the paper keeps under each policy: everything; all but the attention core
    // (selective); the layer's input alone (full).
    let paper = |v: i128, core: bool| match recompute {
        Recompute::None => v,
        Recompute::Selective if !core => v,
        _ => 0,
    };
    // What memwall keeps: everything; all but the layer norms' outputs and statistics and
    // GELU's output (its selective); the layer's input alone (full).
    let mem = |v: i128, recomputed_by_selective: bool| {
        if keep_all || (selective && !recomputed_by_selective) {
            v
        } else {
            0
        }
    };
    let at = exact(a, t);
    vec![
        // The input of the layer's first layer norm: memwall's block output `h{l}.out` is
        // the next block's input, kept for its ln_1 backward (one per layer; full
        // recomputation keeps only it, as the paper's 2sbh does).
        row(
            "LN1 input 2sbh",
            exact(2 * sbh, q),
            Some("out"),
            exact(2 * sbh, q),
        ),
        // Under sequence parallelism the norm's output is kept as the rank's rows and
        // gathered again in the backward (memwall and Megatron alike).
        row(
            "QKV input 2sbh",
            paper(exact(2 * sbh, q), false),
            Some("ln1"),
            mem(exact(2 * sbh, q), true),
        ),
        // Q and K (4sbh/t) and V (2sbh/t): memwall's fused q|k|v.
        row(
            "Q, K 4sbh/t + V 2sbh/t",
            paper(exact(6 * sbh, t), false),
            Some("qkv"),
            mem(exact(6 * sbh, t), false),
        ),
        // The attention core: memwall's attention is flash-style under every policy: it
        // keeps no s×s softmax, dropout mask or dropout output, only a log-sum-exp per
        // head and row (f32), which the paper has no row for.
        row("softmax 2as²b/t", paper(2 * at * s * s * b, true), None, 0),
        row(
            "softmax dropout mask as²b/t",
            paper(at * s * s * b, true),
            None,
            0,
        ),
        row(
            "softmax dropout output 2as²b/t",
            paper(2 * at * s * s * b, true),
            None,
            0,
        ),
        row(
            "(no row) log-sum-exp 4·as·b/t",
            0,
            Some("attn.lse"),
            mem(4 * at * s * b, false),
        ),
        row(
            "projection input 2sbh/t",
            paper(exact(2 * sbh, t), false),
            Some("attn"),
            mem(exact(2 * sbh, t), false),
        ),
        // No dropout in memwall's layers (only LoRA's input dropout, its mask hashed).
        row(
            "attention dropout mask sbh",
            paper(exact(sbh, q), false),
            None,
            0,
        ),
        row(
            "LN2 input 2sbh",
            paper(exact(2 * sbh, q), false),
            Some("res_attn"),
            mem(exact(2 * sbh, q), false),
        ),
        row(
            "MLP input 2sbh",
            paper(exact(2 * sbh, q), false),
            Some("ln2"),
            mem(exact(2 * sbh, q), true),
        ),
        row(
            "fc output 8sbh/t",
            paper(exact(8 * sbh, t), false),
            Some("fc"),
            mem(exact(8 * sbh, t), false),
        ),
        row(
            "GELU output 8sbh/t",
            paper(exact(8 * sbh, t), false),
            Some("fc.gelu"),
            mem(exact(8 * sbh, t), true),
        ),
        row("MLP dropout mask sbh", paper(exact(sbh, q), false), None, 0),
        // The paper's layer norms keep their input only; memwall's also keep the mean and
        // 1/σ of each row (f32) for the backward, recomputed with the norm by its selective.
        row(
            "(no row) LN1 mean 4sb",
            0,
            Some("ln1.mean"),
            mem(exact(4 * s * b, q), true),
        ),
        row(
            "(no row) LN1 rstd 4sb",
            0,
            Some("ln1.rstd"),
            mem(exact(4 * s * b, q), true),
        ),
        row(
            "(no row) LN2 mean 4sb",
            0,
            Some("ln2.mean"),
            mem(exact(4 * s * b, q), true),
        ),
        row(
            "(no row) LN2 rstd 4sb",
            0,
            Some("ln2.rstd"),
            mem(exact(4 * s * b, q), true),
        ),
    ]
}

/// Korthikanti's closed forms (Table 2, tensor parallelism with sequence parallelism or
/// not), in bytes per layer.
fn korthikanti_closed(
    (s, b, h, a): (i128, i128, i128, i128),
    (t, sp): (i128, bool),
    re: Recompute,
) -> i128 {
    let sbh = s * b * h;
    match (re, sp) {
        // sbh(10 + 24/t + 5as/(ht))
        (Recompute::None, false) => 10 * sbh + exact(24 * sbh, t) + exact(5 * a * s * s * b, t),
        // sbh(34/t + 5as/(ht))
        (Recompute::None, true) => exact(34 * sbh, t) + exact(5 * a * s * s * b, t),
        // sbh(10 + 24/t)
        (Recompute::Selective, false) => 10 * sbh + exact(24 * sbh, t),
        // sbh(34/t)
        (Recompute::Selective, true) => exact(34 * sbh, t),
        // 2sbh: the layer's input, which sequence parallelism cuts too (the paper's row is
        // given without it).
        (_, false) => 2 * sbh,
        (_, true) => exact(2 * sbh, t),
    }
}

/// The activation buffers of block `l` alive across the forward/backward boundary: name
/// (after `h{l}.`) and bytes.
fn kept_for_backward(plan: &Plan, l: usize) -> BTreeMap<String, i128> {
    let ops = &plan.schedule.ops;
    let boundary = ops
        .iter()
        .position(|e| e.phase == Phase::Backward)
        .expect("a training plan has a backward");
    assert!(ops[..boundary].iter().all(|e| e.phase == Phase::Forward));
    let pfx = format!("h{l}.");
    plan.buffers
        .iter()
        .filter(|b| b.category == Category::Activation && b.name.starts_with(&pfx))
        .filter(|b| b.first_op < boundary && b.last_op >= boundary)
        .map(|b| (b.name[pfx.len()..].to_string(), b.bytes as i128))
        .collect()
}

#[test]
fn activations_per_layer_are_korthikantis_with_every_difference_named() {
    let spec = ModelSpec::preset("gpt2").unwrap();
    let (b, s) = (2usize, 64usize);
    let shape = (
        s as i128,
        b as i128,
        spec.n_embd as i128,
        spec.n_head as i128,
    );
    // The paper's assumptions: MLP width 4h, heads of h/a, hidden size h = a·head.
    assert_eq!(spec.mlp_hidden, 4 * spec.n_embd);
    assert_eq!(spec.n_head * spec.head_dim, spec.n_embd);
    for precision in [Precision::Bf16, Precision::F16] {
        let meshes = [(1, false), (2, false), (4, false), (2, true), (4, true)];
        for (tp, sp) in meshes {
            for re in [Recompute::None, Recompute::Selective, Recompute::Full] {
                let mut cfg = StepConfig::new(b, s, 1);
                cfg.mesh = Mesh {
                    data: 1,
                    tensor: tp,
                    pipeline: 1,
                    rank: 0,
                };
                cfg.sequence_parallel = sp;
                cfg.precision = precision;
                cfg.recompute = re;
                let plan = build_plan(&spec, &cfg, Mode::Train, backend()).unwrap();
                let rows = korthikanti_rows(shape, (tp as i128, sp), re);
                let paper: i128 = rows.iter().map(|r| r.paper).sum();
                assert_eq!(
                    paper,
                    korthikanti_closed(shape, (tp as i128, sp), re),
                    "{re:?} tp {tp} sp {sp}"
                );
                let want: BTreeMap<String, i128> = rows
                    .iter()
                    .filter(|r| r.memwall > 0)
                    .map(|r| (r.buffer.expect("a buffer").to_string(), r.memwall))
                    .collect();
                for l in 0..spec.n_layer {
                    let got = kept_for_backward(&plan, l);
                    assert_eq!(
                        got,
                        want,
                        "{precision} tp {tp} sp {sp} {re:?} layer {l}: memwall's kept buffers against \
                         the rows (paper, memwall):{}",
                        rows.iter()
                            .map(|r| format!(
                                "\n  {}: {} {:?} {}",
                                r.what, r.paper, r.buffer, r.memwall
                            ))
                            .collect::<String>()
                    );
                    // The whole: the paper's closed form plus the differences, in closed form.
                    let (s, b, h, a) = shape;
                    let (t, sbh) = (tp as i128, s * b * h);
                    // What sequence parallelism cuts (the norms and the dropouts).
                    let q = if sp { t } else { 1 };
                    let diff = match re {
                        // No dropout masks (2 × sbh), no attention core (5as²b/t), a
                        // log-sum-exp per head and row (4asb/t), two norms' statistics (16sb).
                        Recompute::None => {
                            -exact(2 * sbh, q) - exact(5 * a * s * s * b, t)
                                + exact(4 * a * s * b, t)
                                + exact(16 * s * b, q)
                        }
                        // No dropout masks, the norms' outputs (2 × 2sbh) and GELU's (8sbh/t)
                        // recomputed, the log-sum-exp kept.
                        Recompute::Selective => {
                            -exact(2 * sbh, q) - exact(4 * sbh, q) - exact(8 * sbh, t)
                                + exact(4 * a * s * b, t)
                        }
                        _ => 0,
                    };
                    let what = format!("{re:?} tp {tp} sp {sp}");
                    assert_eq!(got.values().sum::<i128>(), paper + diff, "{what}");
                }
            }
        }
    }
}
