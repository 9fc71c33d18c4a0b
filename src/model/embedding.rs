//! The token embedding of a micro-batch, whatever the family: the table's gather (plus the
//! learned positions where the family has them) and its scatter into the gradients.
//!
//! Under tensor parallelism each rank holds its rows of the vocabulary
//! ([`crate::ir::TensorSplit::vocab_part`], Megatron's vocabulary-parallel embedding): it
//! gathers the tokens it holds (zero rows for the others), the first rank alone adds the
//! positions, and one all-reduce on the tensor axis sums the parts, so every rank holds the
//! whole embedding, as one process does (under sequence parallelism a reduce-scatter, so
//! each holds its rows of it). In the backward every rank has the same gradient (gathered
//! from the ranks' rows under sequence parallelism) and scatters it into its own rows (and
//! the positions', whole on every rank).

use super::tensor_join::{RowParallel, gather_rows};
use crate::ir::builder::Builder;
use crate::ir::schedule::{Op, Phase, Rows};
use crate::ir::{BufId, Category, TensorSplit};
use std::ops::Range;

/// A micro-batch's embedding: what it reads, and its names.
pub(crate) struct Embedding<'a> {
    /// Token ids `[B, T]` (u32).
    pub tokens: BufId,
    /// Packed rows: each row's place in its example `[B, T]` (u32).
    pub positions: Option<BufId>,
    /// The rank's rows of the token table `[Vpart, C]`, of the vocabulary's token ids
    /// `split.vocab_part(V)`.
    pub wte: Range<usize>,
    /// Learned positions `[maxT, C]` (GPT-2), whole on every rank.
    pub wpe: Option<Range<usize>>,
    /// The model's vocabulary.
    pub vocab: usize,
    pub rows: Rows,
    pub c: usize,
    pub split: TensorSplit,
    /// The token rows' factor (Gemma's √C, 1 elsewhere).
    pub scale: f32,
    /// The micro-batch's name prefix (`mb1.` or empty).
    pub pfx: &'a str,
    /// Its op's name (`encoder`, `embed`); the backward's is `{op}.bwd`.
    pub op: &'a str,
}

impl Embedding<'_> {
    /// The token id of the rank's first row of the table.
    fn first_token(&self) -> usize {
        self.split.vocab_part(self.vocab).start
    }

    /// Emits the forward into a fresh buffer `{pfx}{out}` `[N, C]` of the storage type (the
    /// rank's rows under sequence parallelism).
    pub fn forward(&self, g: &mut Builder, out: &str) -> BufId {
        let (pfx, n, c) = (self.pfx, self.rows.n(), self.c);
        let res = RowParallel::new(g, self.split, (&format!("{pfx}{out}"), n * c), None);
        let name = format!("{pfx}{}", self.op);
        g.op(
            name.clone(),
            Phase::Forward,
            0,
            Op::Encoder {
                tokens: self.tokens,
                positions: self.positions,
                out: res.out,
                wte: self.wte.clone(),
                // Added once to the ranks' sum.
                wpe: self.wpe.clone().filter(|_| res.bias),
                first_token: self.first_token(),
                rows: self.rows,
                c,
                scale: self.scale,
            },
        );
        res.join(g, &name, Phase::Forward)
    }

    /// Emits the backward reading the gradient of the output `dout` `[N, C]` (the rank's
    /// rows under sequence parallelism, gathered first).
    pub fn backward(&self, g: &mut Builder, dout: BufId) {
        let (pfx, n, c) = (self.pfx, self.rows.n(), self.c);
        let name = format!("{pfx}{}.bwd.dout", self.op);
        let cat = (name.as_str(), Category::ActivationGrad);
        let dout = gather_rows(g, self.split, (dout, n * c), cat, Phase::Backward);
        g.op(
            format!("{}{}.bwd", self.pfx, self.op),
            Phase::Backward,
            0,
            Op::EncoderBackward {
                dout,
                tokens: self.tokens,
                positions: self.positions,
                wte: self.wte.clone(),
                wpe: self.wpe.clone(),
                first_token: self.first_token(),
                rows: self.rows,
                c: self.c,
                scale: self.scale,
            },
        );
    }
}
