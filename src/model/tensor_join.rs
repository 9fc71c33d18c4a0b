//! Where the tensor ranks' parts of a layer meet, whatever the family (Megatron's f and g).
//!
//! Without sequence parallelism every tensor rank holds the whole residual stream `[N, C]`:
//! a row-parallel layer's output (each rank's partial sum, the first rank adding the bias
//! and the residual) and a column-parallel layer's input gradient are all-reduced in place
//! ([`join_tensor_parts`]). With it ([`TensorSplit::cuts_rows`]) each rank holds its run of
//! N/T rows of the stream (`[N/T, C]`, [`crate::ir::Rows::own`]), on which the norms and the
//! residual adds run:
//!
//! - a column-parallel layer reads the rows gathered from every rank ([`gather_rows`]: an
//!   all-gather into a fresh `{name}.all` `[N, C]`, which lives only until that layer's
//!   GEMMs: the backward gathers again rather than keep it, as Megatron does);
//! - a row-parallel layer writes its partial sum into a fresh `{name}.part` `[N, C]`, and a
//!   reduce-scatter gives each rank its rows of the sum, plus the residual's
//!   ([`RowParallel`]);
//! - in the backward a row-parallel layer reads the stream's gradient gathered, and a
//!   column-parallel layer's input gradient (`{name}.part`) is reduce-scattered to each
//!   rank's rows ([`InputGrad`]).
//!
//! On one rank all of these emit nothing and every buffer is the whole stream's.

use crate::ir::builder::Builder;
use crate::ir::schedule::{Op, Phase, Reduce};
use crate::ir::{Axis, BufId, Category, Cut, CutOf, TensorSplit};

/// Joins the tensor-parallel ranks' parts of `buf` (`len` elements; a row-parallel layer's
/// output, a column-parallel layer's input gradient): it becomes its sum over the tensor
/// axis, awaited at once (the next op reads it). Its scratch is `{name}.comm`. Nothing on
/// one rank.
pub(crate) fn join_tensor_parts(
    g: &mut Builder,
    split: TensorSplit,
    (buf, len): (BufId, usize),
    name: &str,
    phase: Phase,
) {
    if !split.is_split() {
        return;
    }
    let cut = Cut::even(len, split.size);
    let scratch = g.act(
        format!("{name}.comm"),
        Category::Communication,
        cut.scratch(),
    );
    g.op(
        format!("{name}.all_reduce"),
        phase,
        0,
        Op::AllReduce {
            buf,
            scratch,
            cut: CutOf::Even,
            axis: Axis::Tensor,
            elems: None,
            reduce: Reduce::Sum,
        },
    );
    await_collective(g, name, "all_reduce", vec![buf, scratch], phase);
}

/// Elements of the residual stream a rank holds, of the whole stream's `len` = N·C.
pub(crate) fn own_len(split: TensorSplit, len: usize) -> usize {
    match split.cuts_rows() {
        true => len / split.size,
        false => len,
    }
}

/// The rows `x` (the rank's of a `len` = N·C stream, of `category`) gathered from every
/// tensor rank into a fresh `{name}.all` `[N, C]`, awaited at once; `x` itself when the
/// rank holds every row.
pub(crate) fn gather_rows(
    g: &mut Builder,
    split: TensorSplit,
    (x, len): (BufId, usize),
    (name, category): (&str, Category),
    phase: Phase,
) -> BufId {
    if !split.cuts_rows() {
        return x;
    }
    let all = g.act(format!("{name}.all"), category, len); // [N, C]
    g.op(
        format!("{name}.all_gather"),
        phase,
        0,
        Op::AllGather {
            buf: all,
            shard: Some(x),
            cut: CutOf::Even,
            axis: Axis::Tensor,
        },
    );
    await_collective(g, name, "all_gather", vec![all, x], phase);
    all
}

/// A row-parallel layer's output (or the vocabulary-parallel embedding's): the buffer its
/// GEMM writes and what the GEMM adds, then ([`RowParallel::join`]) the residual stream's
/// buffer holding the ranks' sum.
pub(crate) struct RowParallel {
    split: TensorSplit,
    /// What the GEMM writes: the stream's `{name}` `[N, C]`, or under sequence parallelism
    /// the rank's partial sum `{name}.part` `[N, C]`.
    pub out: BufId,
    /// The residual the GEMM adds (the first tensor rank's, without sequence parallelism).
    pub residual: Option<BufId>,
    /// Whether the GEMM adds the bias (the first tensor rank alone: the sum adds it once).
    pub bias: bool,
    /// Under sequence parallelism: the residual the reduce-scatter adds.
    scatter_residual: Option<BufId>,
    name: String,
    len: usize,
}

impl RowParallel {
    /// The output `{name}` of `len` = N·C elements, plus `residual` (the rank's rows of the
    /// stream) when given.
    pub(crate) fn new(
        g: &mut Builder,
        split: TensorSplit,
        (name, len): (&str, usize),
        residual: Option<BufId>,
    ) -> RowParallel {
        let once = split.adds_once();
        let rows = split.cuts_rows();
        let out = match rows {
            true => g.act(format!("{name}.part"), Category::Activation, len),
            false => g.act(name.to_string(), Category::Activation, len),
        };
        RowParallel {
            split,
            out,
            residual: residual.filter(|_| once && !rows),
            bias: once,
            scatter_residual: residual.filter(|_| rows),
            name: name.to_string(),
            len,
        }
    }

    /// Emits the join after the GEMM `op` (its name, for the collectives'); returns the
    /// stream's buffer: [`RowParallel::out`] all-reduced, or under sequence parallelism the
    /// rank's rows of the sum (plus the residual) in a fresh `{name}` `[N/T, C]`.
    pub(crate) fn join(self, g: &mut Builder, op: &str, phase: Phase) -> BufId {
        let stream = (self.name.as_str(), Category::Activation);
        let (buf, res) = ((self.out, self.len), self.scatter_residual);
        join_rows(g, self.split, buf, stream, res, (op, phase))
    }
}

/// A column-parallel layer's input gradient: the buffer its backward GEMM writes, then
/// ([`InputGrad::join`]) the rank's gradient of the stream it read.
pub(crate) struct InputGrad {
    split: TensorSplit,
    /// What the GEMM writes `[N, C]`: `{name}`, or under sequence parallelism the rank's
    /// partial sum `{name}.part`.
    pub buf: BufId,
    name: String,
    len: usize,
}

impl InputGrad {
    /// The gradient `{name}` of a `len` = N·C input.
    pub(crate) fn new(g: &mut Builder, split: TensorSplit, (name, len): (&str, usize)) -> Self {
        let buf = match split.cuts_rows() {
            true => g.act(format!("{name}.part"), Category::ActivationGrad, len),
            false => g.act(name.to_string(), Category::ActivationGrad, len),
        };
        InputGrad {
            split,
            buf,
            name: name.to_string(),
            len,
        }
    }

    /// Emits the join after the backward GEMM `op`; returns the gradient of the rank's
    /// rows: [`InputGrad::buf`] all-reduced, or its rows of the sum in a fresh `{name}`
    /// `[N/T, C]`.
    pub(crate) fn join(self, g: &mut Builder, op: &str, phase: Phase) -> BufId {
        let grad = (self.name.as_str(), Category::ActivationGrad);
        join_rows(g, self.split, (self.buf, self.len), grad, None, (op, phase))
    }
}

/// The tensor ranks' parts `buf` (`len` = N·C elements) joined after op `op`: `buf` itself
/// all-reduced, or under sequence parallelism reduce-scattered to the rank's rows (plus
/// `residual`) in a fresh `{name}` of `category` `[N/T, C]` (scratch `{op}.comm`), awaited
/// at once; returns the joined buffer.
fn join_rows(
    g: &mut Builder,
    split: TensorSplit,
    (buf, len): (BufId, usize),
    (name, category): (&str, Category),
    residual: Option<BufId>,
    (op, phase): (&str, Phase),
) -> BufId {
    if !split.cuts_rows() {
        join_tensor_parts(g, split, (buf, len), op, phase);
        return buf;
    }
    let rows = g.act(name.to_string(), category, own_len(split, len));
    let scratch = g.act(
        format!("{op}.comm"),
        Category::Communication,
        Cut::even(len, split.size).scratch(),
    );
    g.op(
        format!("{op}.reduce_scatter"),
        phase,
        0,
        Op::ReduceScatter {
            buf,
            shard: rows,
            scratch,
            accumulate: false,
            cut: CutOf::Even,
            axis: Axis::Tensor,
            residual,
        },
    );
    let mut bufs = vec![buf, rows, scratch];
    bufs.extend(residual);
    await_collective(g, op, "reduce_scatter", bufs, phase);
    rows
}

/// Awaits the collective `{name}.{what}` on `bufs` (its own buffer first).
fn await_collective(g: &mut Builder, name: &str, what: &str, bufs: Vec<BufId>, phase: Phase) {
    g.op(
        format!("{name}.{what}.await"),
        phase,
        0,
        Op::AwaitCollective { bufs },
    );
}
