//! LoRA as a plan transformation (`--lora R`): the family emits its layers as for full
//! fine-tuning, over the base model's parameter ranges; `apply` then freezes the base and
//! threads the adapters through the schedule.
//!
//! - **Frozen base.** Every op of the model is marked [`OpEntry::frozen`]: its parameter
//!   ranges are the base's, bound in the base's buffer (`params.base`), and it computes no
//!   gradient for them. A backward op still computes its input's gradient (the adapters
//!   below need it), but skips its weight-gradient GEMM: a frozen linear layer's backward
//!   is half its full cost, the LM head's two thirds. The embedding's backward, which only
//!   makes gradients, is dropped.
//! - **Adapters.** After each forward (or recomputed) linear layer whose weight holds an
//!   adapted tensor comes an [`Op::LoraForward`] adding `scale · (x Aᵀ) Bᵀ` into that
//!   tensor's columns of the layer's output (Llama's fused q|k|v and gate|up outputs carry
//!   up to three adapters, each its own columns), before anything reads the output (RoPE
//!   rotates q|k|v in place right after the projection). Its `h = scale · x Aᵀ` `[N, r]` is an
//!   activation like any other: recomputation re-emits it with its layer. After the layer's
//!   backward, which overwrote the input gradient, an [`Op::LoraBackward`] adds the adapter's
//!   share to it and accumulates `dA` and `dB`, reading the latest `h` of that layer in the
//!   micro-batch (the forward's, or its recomputation's).
//! - **Trainable state is the adapters'.** The plan's [`super::Plan::layout`] is the
//!   adapters' [`crate::model::lora::AdapterLayout::params`]: gradients, the gradient norm,
//!   AdamW and its moments, accumulation and checkpoints work on it as on any layout, and
//!   the base has none of them ([`super::Plan::lora`] keeps the base's layout).
//!
//! - **Dropout** (`--lora-dropout p`, PEFT's on the adapter's input): each adapter op of a
//!   training step masks its input into a workspace `[N, IC]` of its own
//!   ([`LoraDropout`]); the mask is a hash of (the step's seed, the adapter, the element's
//!   place in the step's batch), so the backward and a recomputed forward draw it again and
//!   nothing is kept between them. With p = 0 the plan has no such workspace.
//!
//! - **Tensor ranks** (`--tp`): each adapter is cut with its layer
//!   ([`crate::model::lora`]). On a column-parallel layer (`B` cut by output rows, `A`
//!   whole) the forward is local; the backward's `dB` is local, `dh` a partial sum over the
//!   rank's outputs, so `dA` is partial and its share `dh A` of the input gradient joins the
//!   layer's own partial one before the layer's all-reduce. On a row-parallel layer (`A` cut
//!   by input columns, `B` whole) `h` is partial and `h Bᵀ` joins the layer's partial output
//!   before its all-reduce; `dh`, `dA` and the input gradient are local, `dB` partial. The
//!   partial gradients of the whole matrices are summed over the tensor ranks once they are
//!   final (`sum_shared_grads`). Dropout masks a rank's columns of a row-parallel input as
//!   one process masks those columns ([`LoraDropout::cols`]).
//!
//! With `B = 0` (a fresh adapter) every `LoraForward` adds exact zeros, so the logits are the
//! base's.

use crate::dtype::DType;
use crate::dtype::GgmlType;
use crate::ir::builder::Builder;
use crate::ir::schedule::{
    LoraDropout, Op, OpEntry, Phase, Reduce, Segment, Segments, WeightLayout,
};
use crate::ir::{Axis, Cut, CutOf};
use crate::ir::{BaseQuant, BaseTypes};
use crate::ir::{BufId, Category};
use crate::model::lora::AdapterLayout;
use crate::model::{ModelSpec, ParamLayout, ParamTensor};
use anyhow::{Result, bail};
use std::collections::HashMap;
use std::ops::Range;

/// A LoRA plan's frozen base and its adapters.
#[derive(Clone, Debug)]
pub struct LoraPlan {
    /// The base model's parameters (what `params.base` holds, in this order).
    pub base: ParamLayout,
    /// The adapters (their `params` are the plan's trainable layout).
    pub adapters: AdapterLayout,
    /// Base tensors a kept GGUF base stores as q8_0 rather than as the file does: the parts of
    /// a fused projection whose types differ in the file (`unify_storage`), by name.
    pub requantized: Vec<String>,
}

impl LoraPlan {
    /// One line for reports: rank, scale, targets and the share of the parameters trained.
    pub fn describe(&self) -> String {
        let s = &self.adapters.spec;
        let targets: Vec<&str> = s.targets.iter().map(|t| t.flag()).collect();
        let trained = self.adapters.params.total;
        let dropout = match s.dropout {
            0.0 => String::new(),
            p => format!(", dropout {p}"),
        };
        format!(
            "LoRA r {} (alpha {}, scale {}{dropout}) on {}: {} adapters, {:.2}M parameters trained ({:.2}% of the {:.1}M frozen)",
            s.r,
            s.alpha,
            s.scale(),
            targets.join(","),
            self.adapters.layers.len(),
            trained as f64 / 1e6,
            100.0 * trained as f64 / self.base.total as f64,
            self.base.total as f64 / 1e6,
        )
    }
}

/// Declares the frozen base's buffers for `base` (the model `spec`'s parameters) kept as
/// `quant`: one f32 buffer `params.base`, or runs of consecutive tensors of one storage,
/// `{group}.base.{dtype}` (`q4_0`, `q8_0`, `f32`; a group's second run of a storage `….2`),
/// quantized matrices apart from the f32 vectors (the vocabulary's matrices in q8_0 under a
/// 4-bit type): a buffer of blocks has dtype [`DType::Ggml`], its values as elements.
/// `per_group` (the base on the disk tier, read one group at a time) splits an f32 base by
/// group too. Returns the
/// segments and the longest quantized row (the decode tile's width), refusing a matrix whose
/// rows are not whole blocks and GPT-2's Conv1D layers, naming the tensor or the model. A
/// layer's bias is stored apart from its quantized weight ([`split_biases`]).
pub(super) fn base_buffers(
    g: &mut Builder,
    spec: &ModelSpec,
    base: &ParamLayout,
    (quant, types): (BaseQuant, Option<&BaseTypes>),
    per_group: bool,
) -> Result<(Segments, usize)> {
    if quant == BaseQuant::F32 && !per_group {
        let buf = g.persistent("params.base", Category::Param, DType::F32, base.total);
        let segments = vec![Segment {
            range: 0..base.total,
            buf,
        }];
        return Ok((Segments { segments }, 0));
    };
    if quant != BaseQuant::F32 && spec.family == crate::model::Family::Gpt2 {
        bail!(
            "--base-quant {quant}: {} stores its linear layers as Conv1D ([in, out]), which a \
             quantized base does not keep yet; use --base-quant fp32",
            spec.name
        );
    }
    let types = match (quant, types) {
        (BaseQuant::Keep, None) => bail!(
            "--base-quant keep takes the blocks of a GGUF --init; give a GGUF file to --init, \
             or --base-quant q8_0|q4_0|q4_1 to quantize this base"
        ),
        (_, t) => t,
    };
    // Quantized to one type, the vocabulary's rows follow llama-quantize's rules
    // (`llama_tensor_get_type`, as `export::mixing` applies them): the output (an untied head,
    // or the embedding a tied head reads) in Q6_K, Q8_0 under a Q8_0 base or where its rows
    // are not whole blocks of 256 (Q6_K's fallback); an untied embedding in the base's type.
    // Kept, each tensor is what the file holds (f32 as f32).
    let storage = |group: &str, t: &crate::model::ParamTensor| -> Result<DType> {
        if let (BaseQuant::Keep, Some(types)) = (quant, types) {
            // Vectors (norms) are decoded to f32 on load, whatever the file holds.
            if t.shape.len() != 2 {
                return Ok(DType::F32);
            }
            let Some(&ty) = types.get(&t.name) else {
                bail!(
                    "--base-quant keep: the GGUF --init has no tensor for {}",
                    t.name
                );
            };
            return Ok(match ty {
                GgmlType::F32 => DType::F32,
                ty => DType::Ggml(ty),
            });
        }
        let BaseQuant::Blocks(ty) = quant else {
            return Ok(DType::F32); // f32, by group
        };
        // By the whole tensor's shape: a tensor rank's part (`--tp`) is stored as one
        // process stores those rows (its vocabulary rows, or its columns of whole blocks).
        Ok(match (t.whole_shape(), t.shape.as_slice()) {
            ([rows, _], [_, cols])
                if *rows == spec.vocab_size && (spec.tied_embeddings || group != "embed") =>
            {
                DType::Ggml(output_type(ty, *cols))
            }
            (_, [_, _]) => DType::Ggml(ty),
            _ => DType::F32,
        })
    };
    let mut segments: Vec<Segment> = Vec::new();
    let mut widest = 0;
    for group in &base.groups {
        let mut run: Option<(DType, Range<usize>)> = None;
        let mut runs_of: HashMap<DType, usize> = HashMap::new();
        let mut close = |g: &mut Builder, run: Option<(DType, Range<usize>)>| {
            let Some((dtype, range)) = run else { return };
            let n = runs_of.entry(dtype).or_default();
            *n += 1;
            let name = match *n {
                1 => format!("{}.base.{dtype}", group.name),
                n => format!("{}.base.{dtype}.{n}", group.name),
            };
            // Of blocks, whole ones: every tensor of the run has rows of whole blocks.
            let buf = g.persistent(&name, Category::Param, dtype, range.len());
            segments.push(Segment { range, buf });
        };
        for t in &base.tensors[group.tensors.clone()] {
            let kind = storage(&group.name, t)?;
            if let Some(k) = kind.ggml() {
                let row = t.shape[1];
                if !(row as u64).is_multiple_of(k.block_size) {
                    bail!(
                        "--base-quant {quant}: {} has rows of {row} values, not a whole number \
                         of {k} blocks of {}; use --base-quant q8_0, q4_0 or q4_1 (blocks of \
                         32), or fp32",
                        t.name,
                        k.block_size
                    );
                }
                widest = widest.max(row);
            }
            run = match run {
                Some((k, r)) if k == kind => Some((k, r.start..t.range.end)),
                other => {
                    close(g, other);
                    Some((kind, t.range.clone()))
                }
            };
        }
        close(g, run);
    }
    Ok((Segments { segments }, widest))
}

/// Where a base's storage splits what one frozen op reads: the parts of a fused projection
/// (Llama's q, k and v, or gate and up: one product in memwall) stored as different types in
/// a GGUF file kept as it is (`--base-quant keep`; Q4_K_M keeps some layers' attn_v as Q6_K
/// beside Q4_K attn_q and attn_k). Returns the types amended so that every part of such a
/// product is q8_0 (converted from the file's blocks on load: 8.5 bits a weight, more than
/// any of the 4- to 6-bit types it replaces) and the names of the tensors amended, or `None`
/// where every frozen op reads one storage. Other base storages never split a product.
pub(super) fn unify_storage(
    ops: &[OpEntry],
    base: &Segments,
    lora: &LoraPlan,
    (quant, types): (BaseQuant, Option<&BaseTypes>),
) -> Result<Option<(BaseTypes, Vec<String>)>> {
    let mut split = Vec::new();
    for e in ops.iter().filter(|e| e.frozen) {
        for r in e.op.param_ranges() {
            if base.find(&r).is_some() {
                continue;
            }
            let parts = (lora.base.tensors.iter())
                .filter(|t| t.range.start < r.end && r.start < t.range.end)
                .map(|t| t.name.clone());
            split.extend(parts);
        }
    }
    if split.is_empty() {
        return Ok(None);
    }
    let (BaseQuant::Keep, Some(types)) = (quant, types) else {
        bail!(
            "internal error: --base-quant {quant} stores the parts of {} apart",
            split.join(", ")
        );
    };
    let mut types = types.clone();
    split.sort();
    split.dedup();
    for name in &split {
        types.insert(name.clone(), GgmlType::Q8_0);
    }
    Ok(Some((types, split)))
}

/// Splits each frozen linear layer whose bias is stored apart from its weight (a quantized
/// base: the weight in blocks, the bias among the f32 vectors, as Qwen2's q, k and v biases)
/// into its product without the bias and an [`Op::AddBias`] right after it; its backward,
/// which computes only the input's gradient, needs no bias.
pub(super) fn split_biases(g: &mut Builder, base: &Segments) {
    let apart = |w: &Range<usize>, b: &Range<usize>| {
        base.find(&(w.start.min(b.start)..w.end.max(b.end)))
            .is_none()
    };
    let old = std::mem::take(&mut g.ops);
    for mut e in old {
        let mut bias = None;
        match &mut e.op {
            Op::Matmul {
                out,
                w,
                b,
                rows,
                oc,
                ..
            } if e.frozen => {
                if let Some(br) = b.take_if(|br| apart(w, br)) {
                    bias = Some(OpEntry {
                        name: format!("{}.bias", e.name),
                        phase: e.phase,
                        op: Op::AddBias {
                            out: *out,
                            b: br,
                            rows: *rows,
                            oc: *oc,
                        },
                        flops: (rows.n() * *oc) as u64,
                        params: None,
                        grads: None,
                        micro: e.micro,
                        frozen: true,
                    });
                }
            }
            Op::MatmulBackward { w, b, .. } if e.frozen => {
                b.take_if(|br| apart(w, br));
            }
            _ => {}
        }
        g.ops.push(e);
        g.ops.extend(bias);
    }
}

/// The type of the output tensor (rows of `cols` values) in a base quantized to `ty`:
/// llama-quantize's Q6_K (`new_type = GGML_TYPE_Q6_K` for `output.weight` unless the file is
/// Q8_0), falling back to Q8_0 where the rows are not whole 256-value blocks
/// (`tensor_type_fallback`).
fn output_type(ty: GgmlType, cols: usize) -> GgmlType {
    let q6_k = GgmlType::Q6_K;
    if ty == GgmlType::Q8_0 || !(cols as u64).is_multiple_of(q6_k.block_size) {
        GgmlType::Q8_0
    } else {
        q6_k
    }
}

/// One adapter as the transformation places it.
struct Placed {
    /// The base weight it adapts (its element range in the base's layout).
    weight: Range<usize>,
    a: Range<usize>, // [r, in]
    b: Range<usize>, // [out, r]
    out: usize,
    flag: &'static str,
    /// Its input's place in one process's (`LoraDropout::cols`): `Some((width, offset))`
    /// where a tensor rank holds columns of it (a row-parallel layer), `None` where whole.
    cols: Option<(usize, usize)>,
}

/// Freezes the base ops of `g` and inserts the adapters' forward and backward (see the
/// module docs). Runs on the emitted micro-batches, before gradients are zeroed and bound.
pub(super) fn apply(g: &mut Builder, lora: &LoraPlan) {
    let ad = &lora.adapters;
    let placed: Vec<Placed> = ad
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| Placed {
            weight: lora.base.tensors[l.base_tensor].range.clone(),
            a: ad.params.tensors[2 * i].range.clone(),
            b: ad.params.tensors[2 * i + 1].range.clone(),
            out: l.out_features,
            flag: l.target.flag(),
            // A row-parallel layer's input features are one range of the whole's.
            cols: ad.params.tensors[2 * i]
                .part
                .as_ref()
                .map(|p| (p.whole[1], p.ranges[0].start)),
        })
        .collect();
    let (r, scale, p) = (ad.spec.r, ad.spec.scale(), ad.spec.dropout);
    // An adapter's input dropout in op `name` of micro-batch `micro` (`n` rows of `ic`
    // columns), with its workspace.
    let dropout_of = |g: &mut Builder, name: &str, adapter: usize, micro: usize, (n, ic)| {
        (p > 0.0).then(|| LoraDropout {
            p,
            // Its index among the whole model's adapters (a pipeline stage holds some).
            adapter: ad.whole_index[adapter],
            micro,
            ws: g.f32(format!("{name}_xd"), Category::Workspace, n * ic), // [N, IC]
            cols: placed[adapter].cols.unwrap_or((ic, 0)),
        })
    };
    // The adapters inside a linear layer's weight, with their first output column.
    let inside = |w: &Range<usize>, layout: WeightLayout, ic: usize| -> Vec<(usize, usize)> {
        placed
            .iter()
            .enumerate()
            .filter(|(_, p)| w.start <= p.weight.start && p.weight.end <= w.end)
            .map(|(i, p)| match layout {
                // Rows of an [OC, IC] weight are output columns.
                WeightLayout::OutIn => (i, (p.weight.start - w.start) / ic),
                // An [IC, OC] weight is one tensor (GPT-2's Conv1D): the whole output.
                WeightLayout::InOut => (i, 0),
            })
            .collect()
    };
    // The latest `h` of (micro-batch, adapter): the forward's, then its recomputation's.
    let mut h_of: HashMap<(usize, usize), BufId> = HashMap::new();
    let old = std::mem::take(&mut g.ops);
    let mut ops = Vec::with_capacity(old.len() * 2);
    for mut e in old {
        if !e.op.param_ranges().is_empty() {
            e.frozen = true;
        }
        let (micro, phase) = (e.micro, e.phase);
        let mut after = Vec::new();
        match &e.op {
            Op::Matmul {
                inp,
                out,
                w,
                layout,
                rows,
                ic,
                oc,
                ..
            } => {
                for (i, col) in inside(w, *layout, *ic) {
                    let p = &placed[i];
                    let name = format!("{}.{}.lora", e.name, p.flag);
                    let h = g.act(format!("{name}_h"), Category::Activation, rows.n() * r);
                    h_of.insert((micro, i), h);
                    let dropout = dropout_of(g, &name, i, micro, (rows.n(), *ic));
                    after.push((
                        name,
                        phase,
                        lora_flops(rows.n(), *ic, p.out, r),
                        Op::LoraForward {
                            inp: *inp,
                            out: *out,
                            h,
                            a: p.a.clone(),
                            b: p.b.clone(),
                            rows: *rows,
                            ic: *ic,
                            oc: p.out,
                            r,
                            col,
                            ldo: *oc,
                            scale,
                            dropout,
                        },
                    ));
                }
            }
            Op::MatmulBackward {
                dinp,
                dout,
                inp,
                w,
                layout,
                rows,
                ic,
                oc,
                ..
            } => {
                // The weight-gradient GEMM (half the op) is not run.
                e.flops /= 2;
                for (i, col) in inside(w, *layout, *ic) {
                    let p = &placed[i];
                    let name = format!("{}.{}.lora", e.name, p.flag);
                    let h = *h_of
                        .get(&(micro, i))
                        .expect("internal error: an adapter's backward before its forward");
                    let dh = g.f32(format!("{name}_dh"), Category::Workspace, rows.n() * r);
                    let dropout = dropout_of(g, &name, i, micro, (rows.n(), *ic));
                    after.push((
                        name,
                        phase,
                        2 * lora_flops(rows.n(), *ic, p.out, r),
                        Op::LoraBackward {
                            dinp: *dinp,
                            dout: *dout,
                            inp: *inp,
                            h,
                            dh,
                            a: p.a.clone(),
                            b: p.b.clone(),
                            rows: *rows,
                            ic: *ic,
                            oc: p.out,
                            r,
                            col,
                            ldo: *oc,
                            scale,
                            dropout,
                        },
                    ));
                }
            }
            // Logits, the input gradient, not the weight gradient: two of three GEMMs.
            Op::LmHeadLoss { dinp: Some(_), .. } => e.flops = e.flops / 3 * 2,
            _ => {}
        }
        ops.push(e);
        for (name, phase, flops, op) in after {
            ops.push(OpEntry {
                name,
                phase,
                op,
                flops,
                params: None,
                grads: None,
                micro,
                frozen: false,
            });
        }
    }
    g.ops = ops;
}

/// Under tensor parallelism (`--tp`), sums over the tensor ranks the gradients of the
/// tensors every rank holds whole but computes only a share of the gradient of (`shared`):
/// the adapters' whole tensors (`A` of a column-parallel layer, `B` of a row-parallel one:
/// each rank's is a partial sum over its output features of `dh`, or its input features of
/// `h`), and in full fine-tuning the [`crate::model::ParamTensor::partial_grad`] ones
/// (Qwen3's q/k norms). After the last op writing a group's gradients (`grads`, one
/// buffer per group of `layout`), each run of such tensors in the group is
/// all-reduced on [`Axis::Tensor`] in place ([`Op::AllReduce`] over those `elems` of the
/// group's buffer, its scratch `{group}.grad.tensor_sum{j}.comm`) and awaited at once, before
/// the group's norm share and any data-axis collective on it. With `per_micro` (ZeRO 2 and
/// 3 over several micro-batches, whose gradients are reduce-scattered on the data axis
/// micro-batch by micro-batch, `zero::reduce_scatter_each_micro_batch`) the sum runs after
/// each micro-batch's last write instead, on that micro-batch's gradients. Nothing on one
/// tensor rank.
pub(super) fn sum_shared_grads(
    g: &mut Builder,
    layout: &ParamLayout,
    grads: &Segments,
    shared: fn(&ParamTensor) -> bool,
    per_micro: bool,
) {
    let split = layout.split;
    if !split.is_split() {
        return;
    }
    let update = |p: Phase| matches!(p, Phase::Optimizer | Phase::DeferredUpdate);
    // Each group's last gradient write: of the step, or of each micro-batch.
    let mut last: Vec<std::collections::BTreeMap<usize, usize>> =
        vec![Default::default(); grads.segments.len()];
    for (i, e) in g.ops.iter().enumerate() {
        if update(e.phase) {
            continue;
        }
        for r in e.grad_ranges() {
            let k = grads.segments.partition_point(|s| s.range.end <= r.start);
            last[k].insert(if per_micro { e.micro } else { 0 }, i);
        }
    }
    let mut after: Vec<Vec<OpEntry>> = vec![Vec::new(); g.ops.len()];
    for (k, (seg, group)) in grads.segments.iter().zip(&layout.groups).enumerate() {
        for (&m, &at) in &last[k] {
            let mb = match per_micro {
                true => format!("mb{m}."),
                false => String::new(),
            };
            sum_runs(g, layout, (seg, group), at, &mb, shared, &mut after[at]);
        }
    }
    let mut ops = Vec::with_capacity(g.ops.len());
    for (e, then) in std::mem::take(&mut g.ops).into_iter().zip(after) {
        ops.push(e);
        ops.extend(then);
    }
    g.ops = ops;
}

/// The all-reduces (and their awaits) of group `group`'s runs of `shared` tensors in its
/// gradient buffer `seg`, to go after op `at` (its micro-batch's), named with prefix `mb`.
fn sum_runs(
    g: &mut Builder,
    layout: &ParamLayout,
    (seg, group): (&crate::ir::schedule::Segment, &crate::model::ParamGroup),
    at: usize,
    mb: &str,
    shared: fn(&ParamTensor) -> bool,
    after: &mut Vec<OpEntry>,
) {
    let split = layout.split;
    // Runs of consecutive tensors held whole, as elements of the group's buffer.
    let mut runs: Vec<Range<usize>> = Vec::new();
    for t in layout.tensors[group.tensors.clone()]
        .iter()
        .filter(|t| shared(t))
    {
        let r = t.range.start - seg.range.start..t.range.end - seg.range.start;
        match runs.last_mut() {
            Some(l) if l.end == r.start => l.end = r.end,
            _ => runs.push(r),
        }
    }
    let micro = g.ops[at].micro;
    for (j, elems) in runs.into_iter().enumerate() {
        let name = format!("{mb}{}.grad.tensor_sum{j}", group.name);
        let cut = Cut::even(elems.len(), split.size);
        let scratch = g.act(
            format!("{name}.comm"),
            Category::Communication,
            cut.scratch(),
        );
        let entry = |name: String, op| OpEntry {
            name,
            phase: Phase::Backward,
            op,
            flops: 0,
            params: None,
            grads: None,
            micro,
            frozen: false,
        };
        after.push(entry(
            format!("{name}.all_reduce"),
            Op::AllReduce {
                buf: seg.buf,
                scratch,
                cut: CutOf::Even,
                axis: Axis::Tensor,
                elems: Some(elems),
                reduce: Reduce::Sum,
            },
        ));
        after.push(entry(
            format!("{name}.all_reduce.await"),
            Op::AwaitCollective {
                bufs: vec![seg.buf, scratch],
            },
        ));
    }
}

/// FLOPs of one adapter's forward over `n` rows: `x Aᵀ` and `h Bᵀ`.
fn lora_flops(n: usize, ic: usize, oc: usize, r: usize) -> u64 {
    2 * (n * r * (ic + oc)) as u64
}
