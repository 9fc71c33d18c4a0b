//! A micro-batch's blocks, whatever the family. Each block's forward is a sequence of stages
//! writing fresh buffers; the backward goes over the blocks in reverse, re-emitting first the
//! stages the block's [`BlockPolicy`] recomputes into fresh buffers (`h{l}.re.*`,
//! `Phase::Recompute`), which its backward then reads instead of the forward's. A family
//! describes its block ([`StagedBlock`]: its stages and how each is emitted, the block's
//! output and its backward) and emits the rest of the micro-batch (embedding, final norm,
//! head) around [`forward`] and [`backward`].
//!
//! Under tensor parallelism (`EmitOptions::tensor`) a family emits its rank's part of each
//! block (its heads and MLP channels) and joins the parts as [`super::tensor_join`] says:
//! after each row-parallel layer in the forward (the first rank alone adding the bias, so
//! the sum adds it once) and after each column-parallel layer's input gradient in the
//! backward (Megatron's f and g); with sequence parallelism the residual stream (each
//! block's input and output, `res_in`, `dres`) is the rank's rows of it. Everything else is
//! the same on every tensor rank, bitwise: the ring gives every rank the same sum.
//!
//! Under pipeline parallelism (`EmitOptions::stage`) a family emits its stage's blocks
//! (named by their index in the whole model) and, where the stage does not begin or end the
//! model, takes its input from the stage before ([`receive_from_stage`]) and hands its output
//! to the stage after ([`send_to_stage`]); the residual stream's gradient goes back the same
//! way.

use crate::ir::builder::Builder;
use crate::ir::schedule::{Op, Phase};
use crate::ir::strategy::{BlockPolicy, Recompute};
use crate::ir::{BufId, Category, Peer};
use std::ops::Range;

/// A family's block as stages. Implemented by the family's dimensions of one micro-batch,
/// which all its blocks share.
pub(crate) trait StagedBlock: Sized {
    /// One block's parameters.
    type Layer;
    /// A forward op (or a few) producing activations the backward reads.
    type Stage: Copy + 'static;
    /// The activations of one block that its backward reads.
    type Acts;
    /// The buffers written by the stages emitted so far (the rest come from the forward).
    type Partial: Default;
    /// Every stage, in forward order.
    const ALL_STAGES: &'static [Self::Stage];
    /// The stages selective recomputation re-emits: cheap ones with large outputs.
    const SELECTIVE_STAGES: &'static [Self::Stage];

    /// Emits stage `s` of `blk` into fresh buffers named `{pfx}…` (`pfx` is `h3.` or
    /// `h3.re.`), reading its inputs from `partial`, else `base` (the forward's buffers), and
    /// the block input.
    fn emit_stage(
        g: &mut Builder,
        blk: &Block<Self>,
        s: Self::Stage,
        base: Option<&Self::Acts>,
        partial: &mut Self::Partial,
        pfx: &str,
        phase: Phase,
    );
    /// The block's activations: those in `partial`, else `base`'s.
    fn acts(partial: Self::Partial, base: Option<&Self::Acts>) -> Self::Acts;
    /// Emits the forward op after the last stage; returns the block's output, the residual
    /// stream entering the next block `[N, C]` (the rank's rows: `[N/T, C]` under sequence
    /// parallelism, as every `[N, C]` of the stream here). What it writes that the backward reads goes
    /// into `a`.
    fn emit_output(g: &mut Builder, blk: &Block<Self>, a: &mut Self::Acts) -> BufId;
    /// Emits the backward of the block: reads `a` and the block input, accumulates into the
    /// residual gradient `dres` `[N, C]` (in place) and the parameter gradients.
    fn backward(g: &mut Builder, blk: &Block<Self>, a: &Self::Acts, dres: BufId);
}

/// One block of one micro-batch: its dimensions, parameters, name prefix and input.
pub(crate) struct Block<'a, F: StagedBlock> {
    pub d: &'a F,
    pub p: &'a F::Layer,
    /// Name prefix of its ops and buffers, e.g. `h3.` or `mb1.h3.`.
    pub name: String,
    /// Its index among the model's blocks.
    pub index: usize,
    /// The residual stream entering the block `[N, C]`.
    pub res_in: BufId,
}

/// What the blocks' forward leaves for their backward.
pub(crate) struct Blocks<A> {
    /// Residual stream entering each block, then the last block's output.
    pub residuals: Vec<BufId>,
    pub acts: Vec<A>,
}

impl<A> Blocks<A> {
    /// The last block's output `[N, C]`.
    pub fn out(&self) -> BufId {
        *self.residuals.last().expect("residuals")
    }
}

/// Emits the forward of the blocks `layers`, the model's blocks `first..` (named
/// `{pfx}h{l}.`), the first reading `res`.
pub(crate) fn forward<F: StagedBlock>(
    g: &mut Builder,
    d: &F,
    (layers, first): (&[F::Layer], usize),
    pfx: &str,
    res: BufId,
) -> Blocks<F::Acts> {
    let mut residuals = vec![res];
    let mut acts = Vec::with_capacity(layers.len());
    for (l, p) in layers.iter().enumerate() {
        let blk = block(d, p, pfx, first + l, residuals[l]);
        let mut a = emit_stages(g, &blk, F::ALL_STAGES, None, &blk.name, Phase::Forward);
        residuals.push(F::emit_output(g, &blk, &mut a));
        acts.push(a);
    }
    Blocks { residuals, acts }
}

/// Emits, per block in reverse, the recompute ops its policy under `recompute` asks for
/// (names `{block}re.*`), then its backward reading them, accumulating into `dres`.
pub(crate) fn backward<F: StagedBlock>(
    g: &mut Builder,
    d: &F,
    (layers, first): (&[F::Layer], usize),
    pfx: &str,
    fwd: &Blocks<F::Acts>,
    recompute: Recompute,
    dres: BufId,
) {
    for (l, p) in layers.iter().enumerate().rev() {
        let blk = block(d, p, pfx, first + l, fwd.residuals[l]);
        let stages = match recompute.block(first + l) {
            BlockPolicy::KeepAll => &[],
            BlockPolicy::Selective => F::SELECTIVE_STAGES,
            BlockPolicy::Full => F::ALL_STAGES,
        };
        let re = format!("{}re.", blk.name);
        let base = Some(&fwd.acts[l]);
        let acts = emit_stages(g, &blk, stages, base, &re, Phase::Recompute);
        F::backward(g, &blk, &acts, dres);
    }
}

/// Block `l` of the micro-batch named by `pfx`.
fn block<'a, F: StagedBlock>(
    d: &'a F,
    p: &'a F::Layer,
    pfx: &str,
    l: usize,
    res_in: BufId,
) -> Block<'a, F> {
    let name = format!("{pfx}h{l}.");
    Block {
        d,
        p,
        name,
        index: l,
        res_in,
    }
}

/// Emits `stages` of `blk` over `base`; returns the activations the backward reads.
fn emit_stages<F: StagedBlock>(
    g: &mut Builder,
    blk: &Block<F>,
    stages: &[F::Stage],
    base: Option<&F::Acts>,
    pfx: &str,
    phase: Phase,
) -> F::Acts {
    let mut partial = F::Partial::default();
    for &s in stages {
        F::emit_stage(g, blk, s, base, &mut partial, pfx, phase);
    }
    F::acts(partial, base)
}

/// The gradient of the residual stream `{pfx}d.residual` `[N, C]` (`len` = N·C), zeroed: the
/// final norm's backward and every block's accumulate into it.
pub(crate) fn residual_grad(g: &mut Builder, pfx: &str, len: usize) -> BufId {
    let dres = g.act(format!("{pfx}d.residual"), Category::ActivationGrad, len);
    g.op(
        format!("{pfx}zero d.residual"),
        Phase::Backward,
        0,
        Op::Zero { buf: dres },
    );
    dres
}

/// Receives `{pfx}{name}` (`len` elements in the storage type, of `category`) from the
/// neighbouring pipeline stage `from`: the stage before's output in the forward, the stage
/// after's input gradient in the backward. Awaited at once (the next op reads it).
pub(crate) fn receive_from_stage(
    g: &mut Builder,
    (pfx, name): (&str, &str),
    (category, len): (Category, usize),
    from: Peer,
    phase: Phase,
) -> BufId {
    let buf = g.act(format!("{pfx}{name}"), category, len);
    g.op(
        format!("{pfx}{name}.recv"),
        phase,
        0,
        Op::StageRecv { buf, from },
    );
    g.op(
        format!("{pfx}{name}.recv.await"),
        phase,
        0,
        Op::AwaitCollective { bufs: vec![buf] },
    );
    buf
}

/// Sends `buf` (named `{pfx}{name}`) to the neighbouring pipeline stage `to`, which
/// receives it with [`receive_from_stage`]. Awaited at once: the buffer's life ends there.
pub(crate) fn send_to_stage(
    g: &mut Builder,
    buf: BufId,
    (pfx, name): (&str, &str),
    to: Peer,
    phase: Phase,
) {
    g.op(
        format!("{pfx}{name}.send"),
        phase,
        0,
        Op::StageSend { buf, to },
    );
    g.op(
        format!("{pfx}{name}.send.await"),
        phase,
        0,
        Op::AwaitCollective { bufs: vec![buf] },
    );
}

/// The name prefix of run `k` of a stage's `v` runs of blocks (`c1.`; none for one run).
fn run_name(k: usize, v: usize) -> String {
    match v {
        1 => String::new(),
        _ => format!("c{k}."),
    }
}

/// Emits the forward of a pipeline stage's runs of blocks `chunks` (the model's layers;
/// `layers` their blocks, in order) of one micro-batch. The first run reads `input` (the
/// embedding's output, on the first stage), every other run receives its input from the
/// stage before (the last stage, for a later run under the interleaved schedule), and each
/// run hands its output to the stage after unless it `ends` the model (the last run of the
/// last stage). `len`: elements of the residual stream, `[N, C]`.
pub(crate) fn stage_forward<F: StagedBlock>(
    g: &mut Builder,
    d: &F,
    (layers, chunks): (&[F::Layer], &[Range<usize>]),
    pfx: &str,
    input: Option<BufId>,
    (len, ends): (usize, bool),
) -> Vec<Blocks<F::Acts>> {
    let v = chunks.len();
    let (mut out, mut at) = (Vec::with_capacity(v), 0);
    for (k, run) in chunks.iter().enumerate() {
        let name = run_name(k, v);
        let res = match (k, input) {
            (0, Some(res)) => res,
            _ => {
                let act = (Category::Activation, len);
                let input = name.clone() + "stage.in";
                receive_from_stage(g, (pfx, &input), act, Peer::Prev, Phase::Forward)
            }
        };
        let blocks = forward(g, d, (&layers[at..at + run.len()], run.start), pfx, res);
        at += run.len();
        if !(ends && k + 1 == v) {
            let name = name + "stage.out";
            send_to_stage(g, blocks.out(), (pfx, &name), Peer::Next, Phase::Forward);
        }
        out.push(blocks);
    }
    out
}

/// Emits the backward of the runs [`stage_forward`] emitted (`fwd`), the last run first:
/// each accumulates into the residual stream's gradient `dres` (the head's, on the last
/// stage's last run) or one received from the stage after, and sends it back to the stage
/// before, unless it `begins` the model (the first stage's first run): that gradient is
/// returned, for the embedding's backward.
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_backward<F: StagedBlock>(
    g: &mut Builder,
    d: &F,
    (layers, chunks): (&[F::Layer], &[Range<usize>]),
    pfx: &str,
    fwd: &[Blocks<F::Acts>],
    recompute: Recompute,
    dres: Option<BufId>,
    (len, begins): (usize, bool),
) -> Option<BufId> {
    let v = chunks.len();
    let mut at = layers.len();
    for (k, run) in chunks.iter().enumerate().rev() {
        let name = run_name(k, v);
        let grad = match (k + 1 == v, dres) {
            (true, Some(dres)) => dres,
            _ => {
                let grad = (Category::ActivationGrad, len);
                let name = name.clone() + "d.residual";
                receive_from_stage(g, (pfx, &name), grad, Peer::Next, Phase::Backward)
            }
        };
        at -= run.len();
        let blocks = (&layers[at..at + run.len()], run.start);
        backward(g, d, blocks, pfx, &fwd[k], recompute, grad);
        if begins && k == 0 {
            return Some(grad);
        }
        let name = name + "d.stage.in";
        send_to_stage(g, grad, (pfx, &name), Peer::Prev, Phase::Backward);
    }
    None
}
