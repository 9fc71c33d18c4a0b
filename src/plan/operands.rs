//! What each op reads and writes, described once (`for_each_operand!`): the buffers it
//! names, and the parameter and gradient ranges it reaches through its entry's bindings,
//! each with its [`Access`]. Buffer lifetimes, the plan's verification, offload staging,
//! the ZeRO overlap, the time model's bytes and renaming all read this one description, so
//! a new op is described here once and nowhere else. Visiting allocates nothing.

use crate::ir::buffer::BufId;
use crate::ir::schedule::{
    BlockScales, LoraDropout, Op, OpEntry, OptimBufs, ParamSlice, TeacherLogits, VocabShare,
};
use std::ops::Range;

/// How an op uses one of its operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read, not written.
    Read,
    /// Overwritten without being read first.
    Write,
    /// Read, then written (accumulated into, or updated in place).
    ReadWrite,
}

impl Access {
    /// Whether the op reads the operand.
    pub fn reads(self) -> bool {
        self != Access::Write
    }

    /// Whether the op writes the operand.
    pub fn writes(self) -> bool {
        self != Access::Read
    }
}

/// One thing an op reads or writes.
#[derive(Clone, Copy, Debug)]
pub enum Operand<'a> {
    /// A buffer the op names.
    Buf(BufId),
    /// The parameters of these ranges, in the buffer [`OpEntry::params`] binds.
    Params(ParamRanges<'a>),
    /// The gradients of these ranges, in the buffer [`OpEntry::grads`] binds.
    Grads(ParamRanges<'a>),
}

/// Parameter ranges an op names, in parameter order: a tensor and perhaps a second one (a
/// bias, the learned positions), or an optimizer's tensors (possibly none: a rank that owns
/// none of a group's elements).
#[derive(Clone, Copy, Debug)]
pub enum ParamRanges<'a> {
    Tensor(&'a Range<usize>, Option<&'a Range<usize>>),
    Slices(&'a [ParamSlice]),
}

impl<'a> ParamRanges<'a> {
    /// The ranges, in order.
    pub fn iter(self) -> impl Iterator<Item = &'a Range<usize>> {
        let (first, second, slices) = match self {
            ParamRanges::Tensor(a, b) => (Some(a), b, &[][..]),
            ParamRanges::Slices(s) => (None, None, s),
        };
        let slices = slices.iter().map(|t| &t.range);
        first.into_iter().chain(second).chain(slices)
    }

    /// The number of elements the ranges hold.
    pub fn elems(self) -> usize {
        self.iter().map(|r| r.len()).sum()
    }
}

/// The description: a `match` on `$op` (an `&Op` or an `&mut Op`, whose fields then bind as
/// `&` or `&mut`) that invokes `$buf!(id, access)` for every buffer field the op uses,
/// `$params!(ranges, access)` for the parameters it reads (or updates) and
/// `$grads!(ranges, access)` for the gradients it reads or accumulates into. Each op's arm
/// says what its kernel does with each field.
macro_rules! for_each_operand {
    ($op:expr, $buf:ident, $params:ident, $grads:ident) => {{
        use Access::{Read, ReadWrite, Write};
        use ParamRanges::{Slices, Tensor};
        match $op {
            Op::Zero { buf } => $buf!(buf, Write),
            Op::Encoder {
                tokens,
                positions,
                out,
                wte,
                wpe,
                ..
            } => {
                $buf!(tokens, Read);
                if let Some(p) = positions {
                    $buf!(p, Read);
                }
                $buf!(out, Write);
                $params!(Tensor(wte, wpe.as_ref()), Read);
            }
            Op::LayerNorm {
                inp,
                out,
                mean,
                rstd,
                w,
                b,
                ..
            } => {
                $buf!(inp, Read);
                $buf!(out, Write);
                $buf!(mean, Write);
                $buf!(rstd, Write);
                $params!(Tensor(w, Some(&*b)), Read);
            }
            Op::Matmul {
                inp,
                out,
                residual,
                w,
                b,
                ..
            } => {
                $buf!(inp, Read);
                if let Some(r) = residual {
                    $buf!(r, Read);
                }
                $buf!(out, Write);
                $params!(Tensor(w, b.as_ref()), Read);
            }
            Op::Attention {
                qkv,
                positions,
                out,
                lse,
                ws,
                ..
            } => {
                $buf!(qkv, Read);
                if let Some(p) = positions {
                    $buf!(p, Read);
                }
                $buf!(out, Write);
                $buf!(lse, Write);
                $buf!(ws, Write);
            }
            Op::RmsNorm {
                inp,
                out,
                residual,
                rstd,
                w,
                ..
            } => {
                $buf!(inp, Read);
                if let Some(r) = residual {
                    $buf!(r, Read);
                }
                $buf!(out, Write);
                $buf!(rstd, Write);
                $params!(Tensor(w, None), Read);
            }
            Op::QkNorm {
                inp, out, rstd, w, ..
            } => {
                $buf!(inp, Read);
                $buf!(out, Write);
                $buf!(rstd, Write);
                $params!(Tensor(w, None), Read);
            }
            Op::Rope { x, positions, .. } => {
                $buf!(x, ReadWrite);
                if let Some(p) = positions {
                    $buf!(p, Read);
                }
            }
            Op::AddBias { out, b, .. } => {
                $buf!(out, ReadWrite);
                $params!(Tensor(b, None), Read);
            }
            Op::Glu { inp, out, .. } | Op::Gelu { inp, out, .. } => {
                $buf!(inp, Read);
                $buf!(out, Write);
            }
            Op::LmHeadLoss {
                inp,
                targets,
                losses,
                logits,
                dinp,
                w,
                vocab,
                teacher,
                row_stats,
                ..
            } => {
                $buf!(inp, Read);
                $buf!(targets, Read);
                $buf!(losses, Write);
                if let Some(TeacherLogits {
                    hidden,
                    w: head,
                    logits: teacher_logits,
                    ..
                }) = teacher
                {
                    $buf!(hidden, Read);
                    $buf!(head, Read);
                    $buf!(teacher_logits, Write);
                }
                match vocab {
                    // The ranks' statistics, and the logits `Op::LmHeadStats` left.
                    Some(VocabShare {
                        stats, logits_kept, ..
                    }) => {
                        $buf!(stats, Read);
                        $buf!(logits, if *logits_kept { ReadWrite } else { Write });
                    }
                    None => $buf!(logits, Write),
                }
                $params!(Tensor(w, None), Read);
                // Training: the input's gradient, and the head's gradients accumulated (or
                // the rows' statistics, for the gradient taken after the backward).
                if let Some(d) = dinp {
                    $buf!(d, Write);
                    match row_stats {
                        Some(s) => $buf!(s, Write),
                        None => $grads!(Tensor(w, None), ReadWrite),
                    }
                }
            }
            Op::LmHeadWeightGrad {
                inp,
                targets,
                row_stats,
                logits,
                w,
                ..
            } => {
                $buf!(inp, Read);
                $buf!(targets, Read);
                $buf!(row_stats, Read);
                $buf!(logits, Write);
                $params!(Tensor(w, None), Read);
                $grads!(Tensor(w, None), ReadWrite);
            }
            Op::LmHeadStats {
                inp,
                targets,
                logits,
                stats,
                w,
                ..
            } => {
                $buf!(inp, Read);
                $buf!(targets, Read);
                $buf!(logits, Write);
                $buf!(stats, Write);
                $params!(Tensor(w, None), Read);
            }
            Op::LmHeadLast { inp, logits, w, .. } => {
                $buf!(inp, Read);
                $buf!(logits, Write);
                $params!(Tensor(w, None), Read);
            }
            Op::LayerNormBackward {
                dinp,
                dout,
                inp,
                mean,
                rstd,
                w,
                b,
                ..
            } => {
                $buf!(dout, Read);
                $buf!(inp, Read);
                $buf!(mean, Read);
                $buf!(rstd, Read);
                $buf!(dinp, ReadWrite);
                $params!(Tensor(w, None), Read);
                $grads!(Tensor(w, Some(&*b)), ReadWrite);
            }
            Op::MatmulBackward {
                dinp,
                dout,
                inp,
                w,
                b,
                ..
            } => {
                $buf!(dout, Read);
                $buf!(inp, Read);
                $buf!(dinp, Write);
                $params!(Tensor(w, None), Read);
                $grads!(Tensor(w, b.as_ref()), ReadWrite);
            }
            Op::LoraForward {
                inp,
                out,
                h,
                a,
                b,
                dropout,
                ..
            } => {
                $buf!(inp, Read);
                $buf!(out, ReadWrite);
                $buf!(h, Write);
                if let Some(LoraDropout { ws, .. }) = dropout {
                    $buf!(ws, Write);
                }
                $params!(Tensor(a, Some(&*b)), Read);
            }
            Op::LoraBackward {
                dinp,
                dout,
                inp,
                h,
                dh,
                a,
                b,
                dropout,
                ..
            } => {
                $buf!(dout, Read);
                $buf!(inp, Read);
                $buf!(h, Read);
                $buf!(dh, Write);
                if let Some(LoraDropout { ws, .. }) = dropout {
                    $buf!(ws, Write);
                }
                $buf!(dinp, ReadWrite);
                $params!(Tensor(a, Some(&*b)), Read);
                $grads!(Tensor(a, Some(&*b)), ReadWrite);
            }
            Op::AttentionBackward {
                dqkv,
                positions,
                dout,
                qkv,
                out,
                lse,
                ws,
                ..
            } => {
                if let Some(p) = positions {
                    $buf!(p, Read);
                }
                $buf!(dout, Read);
                $buf!(qkv, Read);
                $buf!(out, Read);
                $buf!(lse, Read);
                $buf!(dqkv, Write);
                $buf!(ws, Write);
            }
            Op::RmsNormBackward {
                dinp,
                dout,
                inp,
                rstd,
                w,
                ..
            } => {
                $buf!(dout, Read);
                $buf!(inp, Read);
                $buf!(rstd, Read);
                $buf!(dinp, ReadWrite);
                $params!(Tensor(w, None), Read);
                $grads!(Tensor(w, None), ReadWrite);
            }
            Op::QkNormBackward {
                d, inp, rstd, w, ..
            } => {
                $buf!(inp, Read);
                $buf!(rstd, Read);
                $buf!(d, ReadWrite);
                $params!(Tensor(w, None), Read);
                $grads!(Tensor(w, None), ReadWrite);
            }
            Op::GluBackward {
                dinp, dout, inp, ..
            } => {
                $buf!(dout, Read);
                $buf!(inp, Read);
                $buf!(dinp, Write);
            }
            Op::GeluBackward { d, inp, .. } => {
                $buf!(d, ReadWrite);
                $buf!(inp, Read);
            }
            Op::EncoderBackward {
                dout,
                tokens,
                positions,
                wte,
                wpe,
                ..
            } => {
                $buf!(dout, Read);
                $buf!(tokens, Read);
                if let Some(p) = positions {
                    $buf!(p, Read);
                }
                $grads!(Tensor(wte, wpe.as_ref()), ReadWrite);
            }
            Op::GradNorm { range, out, .. } => {
                $grads!(Tensor(range, None), Read);
                $buf!(out, Write);
            }
            Op::AdamW {
                tensors,
                state:
                    OptimBufs {
                        m,
                        v,
                        m_scale,
                        v_scale,
                        ..
                    },
                scales,
            } => {
                $buf!(m, ReadWrite);
                $buf!(v, ReadWrite);
                if let Some(s) = m_scale {
                    $buf!(s, ReadWrite);
                }
                if let Some(s) = v_scale {
                    $buf!(s, ReadWrite);
                }
                if let Some(BlockScales { buf, .. }) = scales {
                    $buf!(buf, Read);
                }
                $params!(Slices(tensors), ReadWrite);
                $grads!(Slices(tensors), Read);
            }
            Op::AdamWBlockMax {
                tensors,
                state:
                    OptimBufs {
                        m,
                        v,
                        m_scale,
                        v_scale,
                        ..
                    },
                out: BlockScales { buf, .. },
            } => {
                $buf!(m, Read);
                $buf!(v, Read);
                if let Some(s) = m_scale {
                    $buf!(s, Read);
                }
                if let Some(s) = v_scale {
                    $buf!(s, Read);
                }
                $buf!(buf, Write);
                $params!(Slices(tensors), Read);
                $grads!(Slices(tensors), Read);
            }
            Op::Transfer { from, to } => {
                $buf!(from, Read);
                $buf!(to, Write);
            }
            Op::AwaitTransfers { bufs } | Op::AwaitCollective { bufs } => {
                for b in bufs {
                    $buf!(b, ReadWrite);
                }
            }
            Op::AllReduce { buf, scratch, .. } => {
                $buf!(buf, ReadWrite);
                $buf!(scratch, Write);
            }
            Op::ReduceScatter {
                buf,
                shard,
                scratch,
                accumulate,
                residual,
                ..
            } => {
                $buf!(buf, ReadWrite);
                $buf!(shard, if *accumulate { ReadWrite } else { Write });
                $buf!(scratch, Write);
                if let Some(r) = residual {
                    $buf!(r, Read);
                }
            }
            Op::AllGather { buf, shard, .. } => {
                $buf!(buf, ReadWrite);
                if let Some(s) = shard {
                    $buf!(s, Read);
                }
            }
            Op::StageSend { buf, .. } => $buf!(buf, Read),
            Op::StageRecv { buf, .. } => $buf!(buf, Write),
        }
    }};
}

impl Op {
    /// Calls `f` with every operand of the op and how the op uses it (see the module docs):
    /// each buffer it names, and its parameter and gradient ranges (each kind once, as one
    /// [`ParamRanges`], when the op has that kind of operand).
    pub fn operands<'a>(&'a self, mut f: impl FnMut(Operand<'a>, Access)) {
        macro_rules! buf {
            ($id:expr, $access:expr) => {
                f(Operand::Buf(*$id), $access)
            };
        }
        macro_rules! params {
            ($ranges:expr, $access:expr) => {
                f(Operand::Params($ranges), $access)
            };
        }
        macro_rules! grads {
            ($ranges:expr, $access:expr) => {
                f(Operand::Grads($ranges), $access)
            };
        }
        for_each_operand!(self, buf, params, grads)
    }

    /// Calls `f` with every buffer field of the op, to rename it (the fields
    /// [`Op::operands`] visits as [`Operand::Buf`]).
    fn bufs_mut(&mut self, mut f: impl FnMut(&mut BufId)) {
        macro_rules! buf {
            ($id:expr, $access:expr) => {{
                let _: Access = $access;
                f($id)
            }};
        }
        macro_rules! ranges {
            ($ranges:expr, $access:expr) => {{
                let _: (ParamRanges, Access) = ($ranges, $access);
            }};
        }
        for_each_operand!(self, buf, ranges, ranges)
    }

    /// The parameter ranges whose values the op's kernel reads (the optimizer's also writes
    /// them), in parameter order within the op.
    pub fn param_ranges(&self) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        self.operands(|o, _| {
            if let Operand::Params(rs) = o {
                out.extend(rs.iter().cloned());
            }
        });
        out
    }

    /// The parameter ranges whose gradients the op's kind reads or writes (backward ops
    /// with weights, a training LM head, the optimizer's ops), in parameter order within
    /// the op. A frozen op computes none of them: [`OpEntry::grad_ranges`].
    pub fn grad_ranges(&self) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        self.operands(|o, _| {
            if let Operand::Grads(rs) = o {
                out.extend(rs.iter().cloned());
            }
        });
        out
    }
}

impl OpEntry {
    /// [`Op::operands`] as this entry runs them: a frozen op ([`OpEntry::frozen`]) has no
    /// gradient operands.
    pub fn operands<'a>(&'a self, mut f: impl FnMut(Operand<'a>, Access)) {
        self.op.operands(|o, access| {
            if !(self.frozen && matches!(o, Operand::Grads(_))) {
                f(o, access)
            }
        });
    }

    /// The parameter ranges whose gradients the op reads or writes: its kind's
    /// ([`Op::grad_ranges`]), none when it is frozen.
    pub fn grad_ranges(&self) -> Vec<Range<usize>> {
        if self.frozen {
            Vec::new()
        } else {
            self.op.grad_ranges()
        }
    }

    /// Calls `f` with every buffer the op reads or writes and how: those it names, and the
    /// buffers its bindings hold for its parameter and gradient operands (where bound). A
    /// buffer used as two operands is visited twice.
    pub fn buffers(&self, mut f: impl FnMut(BufId, Access)) {
        self.operands(|o, access| {
            let id = match o {
                Operand::Buf(id) => Some(id),
                Operand::Params(_) => self.params.map(|b| b.buf),
                Operand::Grads(_) => self.grads.map(|b| b.buf),
            };
            if let Some(id) = id {
                f(id, access);
            }
        });
    }

    /// Whether the op reads or writes buffer `id`.
    pub fn touches(&self, id: BufId) -> bool {
        let mut hit = false;
        self.buffers(|b, _| hit |= b == id);
        hit
    }

    /// Whether the two ops share a buffer that one of them writes (so neither may run while
    /// the other is in flight).
    pub fn conflicts(&self, other: &OpEntry) -> bool {
        let mut clash = false;
        self.buffers(|a, x| {
            other.buffers(|b, y| clash |= a == b && (x.writes() || y.writes()));
        });
        clash
    }

    /// Replaces buffer `from` by `to` wherever the op names it or is bound to it.
    pub fn rename(&mut self, from: BufId, to: BufId) {
        self.op.bufs_mut(|id| {
            if *id == from {
                *id = to;
            }
        });
        for b in [&mut self.params, &mut self.grads].into_iter().flatten() {
            if b.buf == from {
                b.buf = to;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::schedule::{Binding, Phase, Rows, WeightLayout};
    use crate::ir::strategy::OptimState;

    fn entry(op: Op, params: Option<usize>, grads: Option<usize>) -> OpEntry {
        let bind = |b: Option<usize>| {
            b.map(|b| Binding {
                buf: BufId(b),
                base: 0,
            })
        };
        OpEntry {
            name: "op".into(),
            phase: Phase::Backward,
            op,
            flops: 0,
            params: bind(params),
            grads: bind(grads),
            micro: 0,
            frozen: false,
        }
    }

    fn visited(e: &OpEntry) -> Vec<(usize, Access)> {
        let mut out = Vec::new();
        e.buffers(|id, a| out.push((id.0, a)));
        out
    }

    #[test]
    fn an_update_of_no_tensors_still_uses_its_bound_state() {
        // A rank that owns none of a group's elements updates no tensor, but its bound
        // parameters and gradients are the op's all the same (their lifetimes include it).
        let state = OptimBufs {
            format: OptimState::F32,
            m: BufId(1),
            v: BufId(2),
            m_scale: None,
            v_scale: None,
            base: 0,
            block_base: 0,
        };
        let e = entry(
            Op::AdamW {
                tensors: vec![],
                state,
                scales: None,
            },
            Some(5),
            Some(6),
        );
        use Access::*;
        assert_eq!(
            visited(&e),
            [(1, ReadWrite), (2, ReadWrite), (5, ReadWrite), (6, Read)]
        );
        assert!(e.op.param_ranges().is_empty());
    }

    #[test]
    fn renaming_reaches_every_named_buffer_and_binding() {
        let rows = Rows { b: 1, t: 4 };
        let ops = [
            entry(
                Op::Matmul {
                    inp: BufId(1),
                    out: BufId(2),
                    residual: Some(BufId(3)),
                    w: 0..8,
                    b: Some(8..10),
                    layout: WeightLayout::InOut,
                    rows,
                    ic: 4,
                    oc: 2,
                },
                Some(10),
                None,
            ),
            entry(
                Op::ReduceScatter {
                    buf: BufId(1),
                    shard: BufId(2),
                    scratch: BufId(3),
                    accumulate: true,
                    cut: crate::ir::CutOf::Group(0),
                    axis: crate::ir::Axis::Data,
                    residual: None,
                },
                None,
                None,
            ),
            entry(
                Op::AwaitTransfers {
                    bufs: vec![BufId(1), BufId(2)],
                },
                None,
                None,
            ),
            entry(
                Op::EncoderBackward {
                    dout: BufId(1),
                    tokens: BufId(2),
                    positions: Some(BufId(3)),
                    wte: 0..8,
                    wpe: None,
                    first_token: 0,
                    rows,
                    c: 2,
                    scale: 1.0,
                },
                None,
                Some(10),
            ),
        ];
        for e in ops {
            let before = visited(&e);
            for &(id, _) in &before {
                let mut renamed = e.clone();
                renamed.rename(BufId(id), BufId(99));
                let expected: Vec<_> = before
                    .iter()
                    .map(|&(b, a)| (if b == id { 99 } else { b }, a))
                    .collect();
                assert_eq!(visited(&renamed), expected, "{:?}", e.op);
            }
        }
    }
}
