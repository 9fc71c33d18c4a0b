//! One-op plans on any backend, and the comparisons the checks share.
//!
//! A [`Rig`] declares the buffers one check needs (each persistent, so packing keeps them all
//! apart and the plan verifies), a parameter space for the ops' parameter ranges, and the ops
//! themselves; [`Rig::start`] packs them into a [`Plan`] and starts it on a `&dyn Backend`.
//! The [`Started`] plan is then driven only through the [`Device`] seam: [`Started::put`]
//! (`Device::upload`), [`Started::run`] (`Device::run` inside `Device::scope`),
//! [`Started::get`] (`Device::download`).
//!
//! The parameter space starts at [`PARAM_BASE`] (ops are bound with that base, so a backend
//! that ignores a binding's base reads the wrong elements) and leaves [`GAP`] elements before
//! every tensor: the checks compare the whole parameter and gradient buffers, so an op that
//! writes outside its ranges is caught there.

use memwall::backend::{Backend, Device, StepCtx};
use memwall::dist::{Comm, Single};
use memwall::dtype::DType;
use memwall::ir::schedule::{Binding, ImplicitBufs, OpEntry, Segment, Segments};
use memwall::ir::{
    BufId, Buffer, Category, Op, Phase, Placement, Precision, Schedule, Tier, TierSize,
};
use memwall::model::{ModelSpec, ParamLayout};
use memwall::plan::{Mode, Plan, StepConfig, packing};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

/// Worker threads of every rig's plan (more than one, so work is partitioned).
pub const THREADS: usize = 2;
/// The parameter element at index 0 of the rig's parameter and gradient buffers.
pub const PARAM_BASE: usize = 1000;
/// Elements before every tensor of the parameter space that no op may touch.
const GAP: usize = 3;

/// The sequences of most checks: B = 2, T = 5 (N = 10 rows).
pub const B: usize = 2;
pub const T: usize = 5;

/// Which of an op's bindings to set (the checks name them; the plan builder would derive them).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Bind {
    None,
    Params,
    Grads,
    Both,
    /// The parameters, as a frozen op's ([`OpEntry::frozen`]: a LoRA plan's base): no
    /// gradients.
    Frozen,
}

/// A one-op (or few-op) plan being declared.
pub struct Rig {
    pub precision: Precision,
    buffers: Vec<Buffer>,
    ops: Vec<OpEntry>,
    /// Parameter space declared so far (elements, gaps included).
    space: usize,
    params: BufId,
    grads: BufId,
    /// Buffers on the tier beneath the compute tier (checks of transfers).
    beneath: Vec<BufId>,
    /// The disk tier's directory (transfers on the CPU), removed when the plan is dropped.
    disk: Option<tempfile::TempDir>,
    /// Ranks, this rank, and the cut of parameter group 0 (checks of collectives).
    ranks: Option<(usize, usize, memwall::ir::Cut)>,
    /// The ranks are pipeline stages (their mesh's pipeline axis), not data ranks.
    stages: bool,
}

impl Rig {
    pub fn new(precision: Precision) -> Rig {
        let mut rig = Rig {
            precision,
            buffers: Vec::new(),
            ops: Vec::new(),
            space: GAP,
            params: BufId(0),
            grads: BufId(0),
            beneath: Vec::new(),
            disk: None,
            ranks: None,
            stages: false,
        };
        // Sized in `start`, once the parameter space is known.
        rig.params = rig.buf("params", DType::F32, 0);
        let dt = rig.storage();
        rig.grads = rig.buf("grads", dt, 0);
        rig
    }

    /// The element type of activations and gradients.
    pub fn storage(&self) -> DType {
        self.precision.storage()
    }

    /// A buffer of `elems` elements of `dtype` in the host tier.
    pub fn buf(&mut self, name: &str, dtype: DType, elems: usize) -> BufId {
        self.buffers.push(Buffer {
            name: name.into(),
            category: Category::Activation,
            dtype,
            elems,
            bytes: dtype.bytes_for(elems as u64).expect("whole elements"),
            persistent: true,
            first_op: 0,
            last_op: 0,
            placement: Placement::HOST,
            align: packing::ALIGN,
        });
        BufId(self.buffers.len() - 1)
    }

    /// A buffer in the storage type.
    pub fn act(&mut self, name: &str, elems: usize) -> BufId {
        let dt = self.storage();
        self.buf(name, dt, elems)
    }

    pub fn f32(&mut self, name: &str, elems: usize) -> BufId {
        self.buf(name, DType::F32, elems)
    }

    pub fn u32(&mut self, name: &str, elems: usize) -> BufId {
        self.buf(name, DType::U32, elems)
    }

    /// A buffer that is one end of transfers: aligned for direct I/O, and on the tier
    /// beneath the backend's compute tier when `beneath` (the CPU's disk, in a fresh
    /// temporary directory; a GPU's pinned host RAM).
    pub fn io_buf(&mut self, name: &str, dtype: DType, elems: usize, beneath: bool) -> BufId {
        let id = self.buf(name, dtype, elems);
        self.buffers[id.0].align = packing::IO_ALIGN;
        if beneath {
            self.beneath.push(id);
        }
        id
    }

    /// The next tensor of `elems` elements in the parameter space (after a gap).
    pub fn param(&mut self, elems: usize) -> Range<usize> {
        let start = PARAM_BASE + self.space;
        self.space += elems + GAP;
        start..start + elems
    }

    /// The whole parameter space: one parameter group, as `AdamW` and `GradNorm` see it.
    pub fn space(&self) -> Range<usize> {
        PARAM_BASE..PARAM_BASE + self.space
    }

    /// Makes the plan one rank of `ranks` (`rank`), parameter group 0 cut by `cut`.
    pub fn among(&mut self, ranks: usize, rank: usize, cut: memwall::ir::Cut) {
        self.ranks = Some((ranks, rank, cut));
    }

    /// As [`Rig::among`], the ranks being the stages of a pipeline.
    pub fn among_stages(&mut self, ranks: usize, rank: usize, cut: memwall::ir::Cut) {
        self.ranks = Some((ranks, rank, cut));
        self.stages = true;
    }

    /// Appends `op` with the bindings `bind` names; returns its index.
    pub fn op(&mut self, op: Op, bind: Bind) -> usize {
        let params = Binding {
            buf: self.params,
            base: PARAM_BASE,
        };
        let grads = Binding {
            buf: self.grads,
            base: PARAM_BASE,
        };
        self.ops.push(OpEntry {
            name: format!("{}#{}", kind(&op), self.ops.len()),
            phase: Phase::Forward,
            op,
            flops: 0,
            params: matches!(bind, Bind::Params | Bind::Both | Bind::Frozen).then_some(params),
            grads: matches!(bind, Bind::Grads | Bind::Both).then_some(grads),
            micro: 0,
            frozen: bind == Bind::Frozen,
        });
        self.ops.len() - 1
    }

    /// Op `i`, to change after it was appended (a field set by a variant of a check).
    pub fn op_mut(&mut self, i: usize) -> &mut Op {
        &mut self.ops[i].op
    }

    /// Packs the buffers into a plan and starts it on `backend` as one process; panics
    /// naming what failed.
    pub fn start(self, backend: &dyn Backend) -> Started {
        self.start_among(backend, Arc::new(Single))
    }

    /// [`Rig::start`] as one rank of `comm` (the plan's collectives run among its ranks).
    pub fn start_among(mut self, backend: &dyn Backend, comm: Arc<dyn Comm>) -> Started {
        let precision = self.precision;
        for id in [self.params, self.grads] {
            let b = &mut self.buffers[id.0];
            b.elems = self.space;
            b.bytes = b
                .dtype
                .bytes_for(self.space as u64)
                .expect("whole elements");
        }
        // The mixed-precision GEMM tiles, as the planner declares them (sized by the backend).
        let gemm_ws = (precision != Precision::F32).then(|| {
            let elems = backend.mixed_gemm_workspace_elems();
            self.buf("gemm.mixed_tiles", DType::F32, elems.max(1))
        });
        // The backend's own scratch, as the planner declares it.
        let scratch = backend.scratch_bytes(&self.ops, precision.storage());
        let scratch =
            (scratch > 0).then(|| self.buf("backend.scratch", DType::U8, scratch as usize));
        let n_ops = self.ops.len();
        for b in &mut self.buffers {
            b.last_op = n_ops.saturating_sub(1);
        }
        // Buffers declared in the host arena go to the backend's compute tier (a GPU's memory),
        // as the planner places them; the disk tier's stay there.
        let tiers = backend.tiers();
        for b in &mut self.buffers {
            if b.placement.tier == Tier::Host {
                b.placement.tier = tiers[0];
            }
        }
        if !self.beneath.is_empty() {
            let tier = *tiers
                .get(1)
                .expect("the backend has a tier beneath its compute tier");
            for id in &self.beneath {
                self.buffers[id.0].placement.tier = tier;
            }
            if tier == Tier::Nvme {
                self.disk = Some(tempfile::tempdir().expect("a temporary directory"));
            }
        }
        let tier_sizes: Vec<TierSize> = tiers
            .iter()
            .map(|&tier| TierSize {
                tier,
                bytes: packing::pack(&mut self.buffers, tier),
            })
            .collect();
        let arena_bytes = tier_sizes[0].bytes;
        packing::verify(&self.buffers).expect("a rig's buffers are packed apart");
        let spec = ModelSpec::preset("gpt2-tiny").expect("a preset");
        let mut cfg = StepConfig::new(B, T, THREADS);
        cfg.precision = precision;
        cfg.offload.dir = self.disk.as_ref().map(|d| PathBuf::from(d.path()));
        let mut cuts = Vec::new();
        if let Some((ranks, rank, cut)) = self.ranks.take() {
            cfg.mesh = match self.stages {
                true => memwall::ir::Mesh::new(ranks, 1, ranks, rank),
                false => memwall::ir::Mesh::data_parallel(ranks, rank),
            };
            cuts.push(cut);
        }
        let segments = |buf| Segments {
            segments: vec![Segment {
                range: PARAM_BASE..PARAM_BASE + self.space,
                buf,
            }],
        };
        let implicit = ImplicitBufs {
            params: segments(self.params),
            base: None,
            quant_ws: None,
            gemm_ws,
            grads: Some(segments(self.grads)),
            optim: None,
            scratch,
        };
        let plan = Plan {
            layout: ParamLayout::new(&spec),
            lora: None,
            spec,
            cfg,
            mode: Mode::Train,
            schedule: Schedule {
                ops: self.ops,
                implicit,
                tokens: vec![],
                positions: vec![],
                targets: vec![],
                losses: vec![],
                logits: None,
                teacher_hidden: vec![],
                teacher_head: None,
                deferred_update: false,
            },
            buffers: self.buffers,
            peak_live_bytes: arena_bytes,
            peak_op: 0,
            external_bytes: 0,
            tiers: tier_sizes,
            cuts,
        };
        let comms = memwall::dist::Comms::new(comm, &plan.cfg.mesh).expect("the rig's mesh");
        let dev = backend
            .start(&plan.program(), comms)
            .unwrap_or_else(|e| panic!("the backend refused a {precision} plan: {e:#}"));
        Started {
            plan,
            dev,
            _disk: self.disk,
        }
    }
}

/// A rig's plan started on a backend.
pub struct Started {
    pub plan: Plan,
    pub dev: Box<dyn Device>,
    _disk: Option<tempfile::TempDir>,
}

impl Started {
    /// The fp32 parameter buffer: parameter element `i` at index `i - PARAM_BASE`.
    pub fn params(&self) -> BufId {
        self.plan.schedule.implicit.params.segments[0].buf
    }

    /// The gradient buffer, in the storage type, indexed as [`Started::params`].
    pub fn grads(&self) -> BufId {
        let grads = self.plan.schedule.implicit.grads.as_ref();
        grads.expect("a rig has gradients").segments[0].buf
    }

    /// Fills buffer `id` (f32, bf16 or f16) with `x` rounded to its type; returns the values
    /// as stored (what a reference must compute from).
    pub fn put(&mut self, id: BufId, x: &[f32]) -> Vec<f32> {
        let dt = self.plan.buffer(id).dtype;
        let stored: Vec<f32> = x.iter().map(|&v| round(dt, v)).collect();
        let bytes = encode(dt, &stored);
        self.put_bytes(id, &bytes);
        stored
    }

    pub fn put_u32(&mut self, id: BufId, x: &[u32]) {
        assert_eq!(self.plan.buffer(id).dtype, DType::U32);
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.put_bytes(id, &bytes);
    }

    /// Fills buffer `id` with `bytes` (exactly its size).
    pub fn put_bytes(&mut self, id: BufId, bytes: &[u8]) {
        let name = self.plan.buffer(id).name.clone();
        self.dev
            .upload(&[id], &mut |bufs| {
                assert_eq!(bufs[0].len(), bytes.len(), "upload of {name}: size");
                bufs[0].copy_from_slice(bytes);
            })
            .unwrap_or_else(|e| panic!("upload of {name}: {e:#}"));
    }

    /// Fills buffer `id` with values drawn uniformly from `lo..hi`; returns them as stored.
    pub fn fill(&mut self, id: BufId, rng: &mut Rng, lo: f32, hi: f32) -> Vec<f32> {
        let x = rng.uniform(self.plan.buffer(id).elems, lo, hi);
        self.put(id, &x)
    }

    /// The values of buffer `id` (f32, bf16 or f16), widened to f32.
    pub fn get(&self, id: BufId) -> Vec<f32> {
        decode(self.plan.buffer(id).dtype, &self.get_bytes(id))
    }

    pub fn get_bytes(&self, id: BufId) -> Vec<u8> {
        let name = &self.plan.buffer(id).name;
        let mut out = Vec::new();
        self.dev
            .download(&[id], &mut |bufs| out = bufs[0].to_vec())
            .unwrap_or_else(|e| panic!("download of {name}: {e:#}"));
        assert_eq!(out.len() as u64, self.plan.buffer(id).bytes, "{name}: size");
        out
    }

    /// Runs op `i` where the backend issues its ops from ([`Device::scope`]).
    pub fn run(&self, i: usize, ctx: &StepCtx) {
        let e = &self.plan.schedule.ops[i];
        let mut out = None;
        self.dev.scope(&mut || out = Some(self.dev.run(e, ctx)));
        out.expect("scope runs its closure")
            .unwrap_or_else(|err| panic!("{}: {err:#}", e.name))
    }

    /// The values of the f64 buffer `id` (step scalars).
    pub fn get_f64(&self, id: BufId) -> Vec<f64> {
        let b = self.get_bytes(id);
        b.chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

/// A step's context for forward and backward ops: training, loss scale 1, the plan's rows.
pub fn ctx() -> StepCtx {
    StepCtx {
        seq: None,
        training: true,
        loss_scale: 1.0,
        update: None,
        dropout_seed: 0,
        first_micro: 0,
        loss_tokens: 1,
    }
}

/// `x` as stored in a buffer of `dt` (rounded to nearest even), widened back exactly.
pub fn round(dt: DType, x: f32) -> f32 {
    match dt {
        DType::F32 => x,
        DType::Bf16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        other => panic!("no float values in a {other:?} buffer"),
    }
}

fn encode(dt: DType, x: &[f32]) -> Vec<u8> {
    match dt {
        DType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::Bf16 => x
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => x
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        other => panic!("no float values in a {other:?} buffer"),
    }
}

fn decode(dt: DType, b: &[u8]) -> Vec<f32> {
    match dt {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::Bf16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => panic!("no float values in a {other:?} buffer"),
    }
}

/// SplitMix64: deterministic inputs, a fixed seed per check.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In `lo..hi`.
    pub fn f32(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    pub fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(lo, hi)).collect()
    }

    /// In `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// How far an output may be from its reference: `|got − want| ≤ rel·|want| +
/// of_max·max|want| + abs`, element by element.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rel: f64,
    pub of_max: f64,
    pub abs: f64,
}

impl Tol {
    pub const fn rel(rel: f64, abs: f64) -> Tol {
        Tol {
            rel,
            of_max: 0.0,
            abs,
        }
    }

    /// Twice the bound: an output rounded to the storage type twice on its way (an
    /// intermediate stored, then a product of it).
    pub fn twice(self) -> Tol {
        Tol {
            rel: 2.0 * self.rel,
            of_max: 2.0 * self.of_max,
            abs: 2.0 * self.abs,
        }
    }
}

/// The unit roundoff of a reduced storage type: the most rounding to nearest moves a value,
/// relative (bf16 keeps 8 significant bits: 2^-8; f16 11: 2^-11). f32 is not used this way:
/// its checks allow a few f32 operations' errors instead.
pub fn unit_roundoff(p: Precision) -> f64 {
    match p {
        Precision::F32 => 2f64.powi(-24),
        Precision::Bf16 => 2f64.powi(-8),
        Precision::F16 => 2f64.powi(-11),
    }
}

/// An output stored in the storage type and computed elementwise in f32, rounded once: in
/// bf16/f16 the unit roundoff, with 1/64 of it for the f32 arithmetic before the rounding;
/// in f32 about 30 units of f32 roundoff (several operations, an `exp`); and 1e-6 absolute
/// for values that cancel to near zero.
pub fn rounded(p: Precision) -> Tol {
    match p {
        Precision::F32 => Tol::rel(2e-6, 1e-6),
        _ => Tol::rel(unit_roundoff(p) * (1.0 + 1.0 / 64.0), 1e-6),
    }
}

/// An output that is a sum of products over a reduced dimension (matmuls, the LM head,
/// attention, the norms' backward): rounded once as [`rounded`], and the backend may round
/// its operands to the storage type (the fp32 weights included) before an f32 accumulation.
/// That error is at most the unit roundoff times the sum of the terms' magnitudes, which for
/// the checks' shapes (at most 13 terms of values in [-1, 1]) is about the largest output's
/// magnitude: allowed as two unit roundoffs of it. In f32, a few f32 roundings of the
/// largest output.
pub fn reduced(p: Precision) -> Tol {
    match p {
        Precision::F32 => Tol {
            rel: 1e-6,
            of_max: 2e-6,
            abs: 1e-7,
        },
        _ => Tol {
            rel: unit_roundoff(p) * (1.0 + 1.0 / 64.0),
            of_max: 2.0 * unit_roundoff(p),
            abs: 1e-6,
        },
    }
}

/// The first element out of tolerance, described; `None` when all are within it.
pub fn mismatch(got: &[f32], want: &[f64], tol: Tol) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{} values, expected {}", got.len(), want.len()));
    }
    let max = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    // How many times its allowance each element is off (NaN is never within it).
    let excess = |i: usize| {
        let err = (got[i] as f64 - want[i]).abs();
        let allowed = tol.rel * want[i].abs() + tol.of_max * max + tol.abs;
        if err <= allowed {
            0.0
        } else if err.is_nan() || allowed == 0.0 {
            f64::INFINITY
        } else {
            err / allowed
        }
    };
    let bad: Vec<(usize, f64)> = (0..got.len())
        .map(|i| (i, excess(i)))
        .filter(|&(_, e)| e > 0.0)
        .collect();
    let &(i, worst) = bad.iter().max_by(|a, b| a.1.total_cmp(&b.1))?;
    Some(format!(
        "{} of {} values out of tolerance; worst at [{i}]: got {}, expected {} ({worst:.1}x \
         the allowance of {tol:?}, max |expected| {max:.3e})",
        bad.len(),
        got.len(),
        got[i],
        want[i],
    ))
}

/// Panics (naming `what`) when `got` is not within `tol` of `want`. The reference must not
/// be all zero: such a check would also pass on a backend that wrote nothing.
pub fn check(what: &str, got: &[f32], want: &[f64], tol: Tol) {
    assert!(
        want.iter().any(|&w| w != 0.0),
        "{what}: an all-zero reference checks nothing"
    );
    if let Some(m) = mismatch(got, want, tol) {
        panic!("{what}: does not match the reference: {m}");
    }
}

/// Panics unless `got` is bitwise `want` (values an op must leave alone, or copies).
pub fn same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: does not match the reference: [{i}] is {}, expected {} (bitwise)",
            got[i], want[i]
        );
    }
}

/// f32 values widened to f64 (references start from what is stored).
pub fn wide(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// The op kind's name. The match has no wildcard: a new [`Op`] variant stops this suite
/// compiling until it is named here, and then it needs a check (or a line in the suite's
/// list of kinds not covered, with the reason).
pub fn kind(op: &Op) -> &'static str {
    match op {
        Op::Zero { .. } => "zero",
        Op::Encoder { .. } => "encoder",
        Op::LayerNorm { .. } => "layernorm",
        Op::Matmul { .. } => "matmul",
        Op::Attention { .. } => "attention",
        Op::RmsNorm { .. } => "rmsnorm",
        Op::QkNorm { .. } => "qk_norm",
        Op::Rope { .. } => "rope",
        Op::Glu { .. } => "glu",
        Op::Gelu { .. } => "gelu",
        Op::LmHeadLoss { .. } => "lm_head_loss",
        Op::LmHeadStats { .. } => "lm_head_stats",
        Op::LmHeadLast { .. } => "lm_head_last",
        Op::LmHeadWeightGrad { .. } => "lm_head_weight_grad",
        Op::LayerNormBackward { .. } => "layernorm_backward",
        Op::MatmulBackward { .. } => "matmul_backward",
        Op::LoraForward { .. } => "lora_forward",
        Op::LoraBackward { .. } => "lora_backward",
        Op::AddBias { .. } => "add_bias",
        Op::AttentionBackward { .. } => "attention_backward",
        Op::RmsNormBackward { .. } => "rmsnorm_backward",
        Op::QkNormBackward { .. } => "qk_norm_backward",
        Op::GluBackward { .. } => "glu_backward",
        Op::GeluBackward { .. } => "gelu_backward",
        Op::EncoderBackward { .. } => "encoder_backward",
        Op::GradNorm { .. } => "grad_norm",
        Op::AdamW { .. } => "adamw",
        Op::AdamWBlockMax { .. } => "adamw_block_max",
        Op::Transfer { .. } => "transfer",
        Op::AwaitTransfers { .. } => "await_transfers",
        Op::AllReduce { .. } => "all_reduce",
        Op::ReduceScatter { .. } => "reduce_scatter",
        Op::AllGather { .. } => "all_gather",
        Op::StageSend { .. } => "stage_send",
        Op::StageRecv { .. } => "stage_recv",
        // Checked with the collectives (`state::run_collective`).
        Op::AwaitCollective { .. } => "await_collective",
    }
}
