//! Predicted step time: every op's seconds from a machine's [`Calibration`], and the disk
//! transfers overlapped with them as the schedule allows.
//!
//! Each op kind (`matmul/f32`, `attention_bwd/bf16`, `adamw.int8/bf16`, …) costs
//! `s_per_flop · flops + s_per_byte · bytes + s_per_op`: arithmetic at the calibrated rate,
//! memory traffic at the calibrated bandwidth, and a fixed cost per call, fitted on ops the
//! machine actually ran (`exec::calibrate`). Without a calibration, [`Calibration::estimate`]
//! derives the same coefficients from the machine's FMA peak, and says so.
//!
//! Transfers run on one I/O thread in schedule order, collectives on one communication
//! thread; [`predict`] walks a step's ops with three clocks, compute, I/O and
//! communication: a `Transfer` (a collective) starts when both its thread is free and the
//! compute clock has issued it, an `AwaitTransfers` (`AwaitCollective`) moves the compute
//! clock to the end of what it waits for. The step ends when every clock has. Like the plan, this needs no
//! backend: the calibration is data.
//!
//! Collectives are priced per kind (`all_reduce/f32`, …) by what `mpirun -np N memwall
//! calibrate` measured among N ranks ([`Transport`], `exec::calibrate_transport`; used only by
//! plans for that N), else at [`NOMINAL_COLLECTIVE_BYTES_PER_S`], and the plan says which; the
//! disk, without a measured one, at 1 GB/s. `memwall plan` prints the predicted step time and
//! its bound (compute or disk), `bench` reports it next to the measured median
//! (`predicted_step_s`, `time_error_pct`), and `plan.json` records it. `--fit`
//! ([`super::search`]) ranks plans by it.

use super::Plan;
use super::operands::Operand;
use crate::ir::schedule::{GluAct, Op, OpEntry, Phase};
use crate::ir::{BufId, OptimState, Tier};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The cost of one op kind: `s_per_flop · flops + s_per_byte · bytes + s_per_op` seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    pub s_per_flop: f64,
    pub s_per_byte: f64,
    pub s_per_op: f64,
    /// Ops the coefficients were fitted on (0: derived from the FMA peak).
    #[serde(default)]
    pub samples: usize,
    /// Root-mean-square relative error of the fit on those ops (percent).
    #[serde(default)]
    pub fit_error_pct: f64,
}

impl Cost {
    /// Seconds for an op of `flops` and `bytes`.
    pub fn seconds(&self, flops: u64, bytes: u64) -> f64 {
        self.s_per_flop * flops as f64 + self.s_per_byte * bytes as f64 + self.s_per_op
    }

    /// Refuses coefficients no fit produces (negative, NaN or infinite: they predict negative
    /// or infinite times), naming the field of `kinds.{kind}`.
    pub fn check(&self, kind: &str) -> Result<(), String> {
        for (field, x) in [
            ("s_per_flop", self.s_per_flop),
            ("s_per_byte", self.s_per_byte),
            ("s_per_op", self.s_per_op),
            ("fit_error_pct", self.fit_error_pct),
        ] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(format!(
                    "kinds.\"{kind}\".{field} is {x}; it must be a finite number, 0 or more"
                ));
            }
        }
        Ok(())
    }
}

/// Refuses a rate that is not a finite positive number, naming `field`.
fn check_positive(field: &str, x: f64) -> Result<(), String> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(format!(
            "{field} is {x}; it must be a finite number above 0"
        ))
    }
}

/// How fast a tier beneath the compute tier moves bytes: `read` into the compute tier (the
/// CPU's disk tier: the offload directory's sequential direct I/O; a GPU's pinned RAM: host
/// to device over the bus), `write` out of it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bandwidth {
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
}

/// Where a calibration's figures come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// `memwall calibrate` ran on this machine (when, as RFC 3339 UTC).
    Measured { at: String },
    /// No calibration was found: coefficients derived from the FMA peak measured just now
    /// (and a nominal disk); good to tens of percent.
    Estimate,
}

/// What a machine does per second, per op kind, at a thread count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub source: Source,
    /// The processor measured: the CPU's model name (a calibration taken on another CPU is
    /// not used), or with `gpu` the GPU's (`NVIDIA H200`).
    pub cpu: String,
    /// Whether the ops ran on a GPU (`memwall calibrate --device cuda`): the costs are the
    /// GPU's, kept apart from the CPU's ([`crate::exec::calibrate::gpu_cache_file`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gpu: bool,
    pub threads: usize,
    /// The f32 FMA ceiling of these threads (GFLOP/s).
    pub fma_peak_gflops: f64,
    /// Fitted costs by op kind ([`op_kind`]).
    pub kinds: BTreeMap<String, Cost>,
    /// The offload directory's disk, if it was measured.
    pub disk: Option<Bandwidth>,
    /// A GPU's bus to pinned host RAM (`calibrate --device cuda`), if it was measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bus: Option<Bandwidth>,
    /// The offload directory that was measured.
    #[serde(default)]
    pub disk_dir: Option<std::path::PathBuf>,
    /// The collectives among the plan's ranks, if they were measured (a file of their own per
    /// rank count, attached when a plan for ranks is timed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<Transport>,
}

/// What the collectives cost among `ranks` processes, measured by
/// `mpirun -np N memwall calibrate`: per kind (`all_reduce/f32`, `all_gather/bf16`, …),
/// seconds from the bytes one rank sends (`s_per_byte · bytes + s_per_op`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Transport {
    /// When it was measured (RFC 3339 UTC).
    pub at: String,
    pub ranks: usize,
    /// The transport's description (`MPI (Open MPI 4.1.4)`, …).
    pub transport: String,
    /// The CPU's model name (a measurement taken on another CPU is not used).
    pub cpu: String,
    pub kinds: BTreeMap<String, Cost>,
}

impl Transport {
    /// Refuses what `mpirun -np N memwall calibrate` never writes: fewer than 2 ranks, a
    /// coefficient negative, NaN or infinite.
    pub fn check(&self) -> Result<(), String> {
        if self.ranks < 2 {
            return Err(format!(
                "ranks is {}; collectives are measured among 2 or more",
                self.ranks
            ));
        }
        for (kind, cost) in &self.kinds {
            cost.check(kind)?;
        }
        Ok(())
    }
}

/// Assumed bandwidth of a collective (bytes one rank sends per second) when the transport
/// was not measured: processes of one machine move bytes through shared memory at about a
/// quarter of the copy bandwidth each way.
pub const NOMINAL_COLLECTIVE_BYTES_PER_S: f64 = 5e9;

/// Whether an op kind (`all_reduce/f32`) is a collective.
pub fn is_collective(kind: &str) -> bool {
    let base = kind.split('/').next().unwrap_or(kind);
    matches!(
        base,
        "all_reduce" | "reduce_scatter" | "all_gather" | "send" | "recv"
    )
}

/// Assumed disk bandwidth when none was measured (a SATA-class SSD's).
pub const NOMINAL_DISK: Bandwidth = Bandwidth {
    read_bytes_per_s: 1e9,
    write_bytes_per_s: 1e9,
};

/// Assumed bandwidth of a GPU's bus to pinned host RAM when none was measured, each way: a
/// PCIe 4.0 x16 link's pinned copies (about 25 GB/s; PCIe 5.0 and NVLink-C2C are faster,
/// which `memwall calibrate --device cuda` measures).
pub const NOMINAL_BUS: Bandwidth = Bandwidth {
    read_bytes_per_s: 25e9,
    write_bytes_per_s: 25e9,
};

impl Calibration {
    /// Refuses what `memwall calibrate` never writes (a hand-edited or damaged file): a
    /// coefficient negative, NaN or infinite, no threads, an FMA peak or disk rate not a
    /// finite positive number, a transport that does not check.
    pub fn check(&self) -> Result<(), String> {
        if self.threads == 0 {
            return Err("threads is 0; it must be at least 1".into());
        }
        if !(self.fma_peak_gflops.is_finite() && self.fma_peak_gflops >= 0.0) {
            return Err(format!(
                "fma_peak_gflops is {}; it must be a finite number, 0 or more",
                self.fma_peak_gflops
            ));
        }
        for (kind, cost) in &self.kinds {
            cost.check(kind)?;
        }
        if let Some(d) = &self.disk {
            check_positive("disk.read_bytes_per_s", d.read_bytes_per_s)?;
            check_positive("disk.write_bytes_per_s", d.write_bytes_per_s)?;
        }
        if let Some(b) = &self.bus {
            check_positive("bus.read_bytes_per_s", b.read_bytes_per_s)?;
            check_positive("bus.write_bytes_per_s", b.write_bytes_per_s)?;
        }
        if let Some(t) = &self.transport {
            t.check().map_err(|e| format!("transport.{e}"))?;
        }
        Ok(())
    }

    /// Coefficients derived from an FMA peak of `fma_peak_gflops` on `threads` threads:
    /// matmuls at 0.7 of it, attention at 0.4, memory-bound ops at 20 GB/s, 10 µs a call.
    pub fn estimate(cpu: String, threads: usize, fma_peak_gflops: f64) -> Calibration {
        Calibration {
            source: Source::Estimate,
            cpu,
            threads,
            fma_peak_gflops,
            gpu: false,
            kinds: BTreeMap::new(),
            disk: None,
            bus: None,
            disk_dir: None,
            transport: None,
        }
    }

    /// The fitted cost of `kind` on this machine, if it was measured: a collective's on the
    /// transport measured among `ranks` ranks, any other from the op suite.
    pub fn fitted(&self, kind: &str, ranks: usize) -> Option<Cost> {
        if is_collective(kind) {
            let t = self.transport.as_ref().filter(|t| t.ranks == ranks)?;
            t.kinds.get(kind).copied()
        } else if let Some(c) = self.kinds.get(kind) {
            Some(*c)
        } else if let Some(forward) = kind.strip_prefix("matmul_bwd_input/") {
            // A frozen layer's backward (one GEMM: the input gradient) runs at the rate of
            // the forward's GEMM, per FLOP, when the calibration has no fit of its own.
            self.kinds.get(&format!("matmul/{forward}")).copied()
        } else if let Some(rest) = kind.strip_prefix("geglu") {
            // GeGLU (Gemma) where the suite measured only SwiGLU: the same traffic, an
            // exponential a value either way.
            self.kinds.get(&format!("swiglu{rest}")).copied()
        } else if let Some((_, storage)) = kind
            .strip_prefix("host_adamw.")
            .and_then(|rest| rest.split_once('/'))
        {
            // The host's update with moments in another format: the f32 state's rate, per
            // byte (`op_bytes` counts the format's bytes).
            self.kinds
                .get(&format!("host_adamw.{}/{storage}", OptimState::F32))
                .copied()
        } else if let Some(rest) = kind.strip_prefix("adamw_block_max") {
            // The tensor ranks' 8-bit block maxima: AdamW's arithmetic on its bytes read
            // (`op_bytes`), per byte.
            self.kinds.get(&format!("adamw{rest}")).copied()
        } else if let Some(rest) = kind.strip_prefix("lm_head_weight_grad") {
            // A slice of the head's weight gradient (`--update in-backward`): the training
            // head's GEMMs and softmax, per FLOP.
            self.kinds.get(&format!("lm_head_loss{rest}")).copied()
        } else {
            // A tensor-parallel head's statistics: the evaluating head's GEMM and reduction.
            let rest = kind.strip_prefix("lm_head_stats")?;
            self.kinds.get(&format!("lm_head_eval{rest}")).copied()
        }
    }

    /// The cost of `kind` among `ranks` ranks: fitted ([`Calibration::fitted`]), or else
    /// derived from the FMA peak (a collective's from [`NOMINAL_COLLECTIVE_BYTES_PER_S`]).
    pub fn cost(&self, kind: &str, ranks: usize) -> Cost {
        if let Some(c) = self.fitted(kind, ranks) {
            return c;
        }
        let peak = self.fma_peak_gflops.max(1.0) * 1e9;
        let base = kind.split('/').next().unwrap_or(kind);
        let efficiency = match base {
            "matmul"
            | "matmul_bwd"
            | "matmul_bwd_input"
            | "lm_head_loss"
            | "lm_head_eval"
            | "lm_head_stats"
            | "lm_head_last"
            | "lm_head_weight_grad" => 0.7,
            "matmul_q" | "matmul_bwd_input_q" | "lm_head_loss_q" | "lm_head_eval_q"
            | "lm_head_stats_q" => 0.6,
            // Rank-r GEMMs: thin, so further from the peak.
            "attention" | "attention_bwd" | "lora" | "lora_bwd" => 0.4,
            _ => 0.0,
        };
        Cost {
            s_per_flop: if efficiency > 0.0 {
                1.0 / (efficiency * peak)
            } else {
                0.0
            },
            s_per_byte: if is_collective(kind) {
                1.0 / NOMINAL_COLLECTIVE_BYTES_PER_S
            } else {
                1.0 / 20e9
            },
            s_per_op: 10e-6,
            samples: 0,
            fit_error_pct: 0.0,
        }
    }

    /// Disk bandwidth: measured, or [`NOMINAL_DISK`].
    pub fn disk_rates(&self) -> Bandwidth {
        self.disk.unwrap_or(NOMINAL_DISK)
    }

    /// The bandwidth of transfers between the compute tier and `beneath`: the disk's, or a
    /// GPU's bus to pinned RAM (measured, or [`NOMINAL_BUS`]).
    pub fn rates_to(&self, beneath: Tier) -> Bandwidth {
        match beneath {
            Tier::Nvme => self.disk_rates(),
            _ => self.bus.unwrap_or(NOMINAL_BUS),
        }
    }

    /// Where the collectives' figures come from, for a plan among `ranks` ranks.
    pub fn describe_transport(&self, ranks: usize) -> String {
        match &self.transport {
            Some(t) if t.ranks == ranks => format!(
                "measured among {} ranks over {} at {}",
                t.ranks, t.transport, t.at
            ),
            _ => format!(
                "at {:.0} GB/s assumed: `mpirun -np {ranks} memwall calibrate` measures the transport",
                NOMINAL_COLLECTIVE_BYTES_PER_S / 1e9
            ),
        }
    }

    /// One line saying where the figures come from.
    pub fn describe(&self) -> String {
        let disk = match (&self.disk, &self.disk_dir) {
            (Some(d), dir) => format!(
                "disk{} read {:.2} GB/s, write {:.2} GB/s",
                dir.as_ref()
                    .map(|p| format!(" at {}", p.display()))
                    .unwrap_or_default(),
                d.read_bytes_per_s / 1e9,
                d.write_bytes_per_s / 1e9
            ),
            (None, _) => "disk not measured (1 GB/s assumed)".to_string(),
        };
        match &self.source {
            Source::Measured { at } if self.gpu => format!(
                "calibrated {at} on the GPU {} (`memwall calibrate --device cuda`; {} op kinds; {})",
                self.cpu,
                self.kinds.len(),
                match &self.bus {
                    Some(b) => format!(
                        "pinned RAM to device {:.1} GB/s, back {:.1} GB/s",
                        b.read_bytes_per_s / 1e9,
                        b.write_bytes_per_s / 1e9
                    ),
                    None => format!(
                        "bus not measured ({:.0} GB/s assumed)",
                        NOMINAL_BUS.read_bytes_per_s / 1e9
                    ),
                }
            ),
            Source::Measured { at } => format!(
                "calibrated {at} on {} ({} op kinds, FMA peak {:.0} GFLOP/s; {disk})",
                crate::util::count(self.threads as u64, "thread"),
                self.kinds.len(),
                self.fma_peak_gflops
            ),
            Source::Estimate => format!(
                "estimated from the FMA peak ({:.0} GFLOP/s on {}; {disk}): run `memwall calibrate` for a measured figure",
                self.fma_peak_gflops,
                crate::util::count(self.threads as u64, "thread")
            ),
        }
    }
}

/// The kind of op `e` for costing (the kernel it runs and its storage type), or `None` for
/// the transfers and waits, which [`predict`] times on the I/O clock.
pub fn op_kind(plan: &Plan, e: &OpEntry) -> Option<String> {
    // The storage type as plan.json spells it (`f32`, `bf16`, `f16`).
    let storage = plan.cfg.precision.storage();
    let base = match &e.op {
        Op::Zero { .. } => "zero",
        Op::Encoder { .. } => "encoder",
        Op::LayerNorm { .. } => "layernorm",
        Op::Matmul { .. } => "matmul",
        Op::Attention { .. } => "attention",
        Op::RmsNorm { .. } => "rmsnorm",
        Op::QkNorm { .. } => "qk_norm",
        Op::Rope { .. } => "rope",
        Op::AddBias { .. } => "add_bias",
        Op::Glu {
            act: GluAct::Silu, ..
        } => "swiglu",
        Op::Glu {
            act: GluAct::GeluTanh,
            ..
        } => "geglu",
        Op::Gelu { .. } => "gelu",
        Op::LmHeadLoss { dinp: Some(_), .. } => "lm_head_loss",
        Op::LmHeadLoss { dinp: None, .. } => "lm_head_eval",
        Op::LmHeadStats { .. } => "lm_head_stats",
        Op::LmHeadWeightGrad { .. } => "lm_head_weight_grad",
        Op::LmHeadLast { .. } => "lm_head_last",
        Op::LayerNormBackward { .. } => "layernorm_bwd",
        Op::MatmulBackward { .. } if e.frozen => "matmul_bwd_input",
        Op::MatmulBackward { .. } => "matmul_bwd",
        Op::LoraForward { .. } => "lora",
        Op::LoraBackward { .. } => "lora_bwd",
        Op::AttentionBackward { .. } => "attention_bwd",
        Op::RmsNormBackward { .. } => "rmsnorm_bwd",
        Op::QkNormBackward { .. } => "qk_norm_bwd",
        Op::GluBackward {
            act: GluAct::Silu, ..
        } => "swiglu_bwd",
        Op::GluBackward {
            act: GluAct::GeluTanh,
            ..
        } => "geglu_bwd",
        Op::GeluBackward { .. } => "gelu_bwd",
        Op::EncoderBackward { .. } => "encoder_bwd",
        Op::GradNorm { .. } => "grad_norm",
        // An update on the host's cores, where its state is (beneath a GPU).
        Op::AdamW { state, .. } if e.runs_on_host(&plan.buffers, plan.compute_tier()) => {
            return Some(format!("host_adamw.{}/{storage}", state.format));
        }
        Op::AdamW { state, .. } => {
            return Some(format!("adamw.{}/{storage}", state.format));
        }
        Op::AdamWBlockMax { state, .. } => {
            return Some(format!("adamw_block_max.{}/{storage}", state.format));
        }
        Op::Transfer { .. } | Op::AwaitTransfers { .. } | Op::AwaitCollective { .. } => {
            return None;
        }
        Op::AllReduce { buf, .. } => return Some(collective_kind("all_reduce", plan, *buf)),
        Op::ReduceScatter { buf, .. } => {
            return Some(collective_kind("reduce_scatter", plan, *buf));
        }
        Op::AllGather { buf, .. } => return Some(collective_kind("all_gather", plan, *buf)),
        Op::StageSend { buf, .. } => return Some(collective_kind("send", plan, *buf)),
        Op::StageRecv { buf, .. } => return Some(collective_kind("recv", plan, *buf)),
    };
    // A frozen op on a quantized base decodes its weight's blocks: a kind of its own.
    let quant = if e
        .params
        .is_some_and(|b| plan.buffer(b.buf).dtype.ggml().is_some())
    {
        "_q"
    } else {
        ""
    };
    Some(format!("{base}{quant}/{storage}"))
}

/// A collective's kind: its name and the element type it moves.
fn collective_kind(name: &str, plan: &Plan, buf: BufId) -> String {
    format!("{name}/{}", plan.buffer(buf).dtype)
}

/// Bytes of AdamW state per parameter in `format` (int8: one code per moment plus a share
/// of the block scales).
fn state_bytes(format: OptimState) -> f64 {
    match format {
        OptimState::F32 => 8.0,
        OptimState::Bf16 => 4.0,
        OptimState::Int8 => 2.0 + 8.0 / crate::ir::strategy::QBLOCK as f64,
    }
}

/// The memory traffic of op `e` (bytes read plus bytes written, roughly): the buffers it
/// names, its parameter ranges (f32) and its gradient ranges (storage type).
pub fn op_bytes(plan: &Plan, e: &OpEntry) -> u64 {
    let g = plan.cfg.precision.storage_size() as f64;
    let bytes = match &e.op {
        Op::AdamW { tensors, state, .. } => {
            let n: usize = tensors.iter().map(|t| t.range.len()).sum();
            // Parameters read and written, gradients read, moments read and written.
            n as f64 * (8.0 + g + 2.0 * state_bytes(state.format))
        }
        Op::AdamWBlockMax { tensors, state, .. } => {
            let n: usize = tensors.iter().map(|t| t.range.len()).sum();
            // Parameters, gradients and moments read.
            n as f64 * (4.0 + g + state_bytes(state.format))
        }
        Op::GradNorm { range, .. } => range.len() as f64 * g,
        // A gather (or scatter) of N rows of the table: twice the activation's bytes.
        Op::Encoder { out: a, .. } | Op::EncoderBackward { dout: a, .. } => {
            2.0 * plan.buffer(*a).bytes as f64
        }
        Op::Transfer { .. } | Op::AwaitTransfers { .. } | Op::AwaitCollective { .. } => 0.0,
        // What the rank sends (and receives as much): its time is bandwidth.
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => {
            plan.comm_bytes(e) as f64
        }
        _ => {
            let (mut ids, mut params, mut grads) = (Vec::new(), 0, 0);
            e.operands(|o, _| match o {
                Operand::Buf(id) => ids.push(id),
                Operand::Params(rs) => params += rs.elems(),
                Operand::Grads(rs) => grads += rs.elems(),
            });
            ids.sort_by_key(|b| b.0);
            ids.dedup();
            let named: u64 = ids.iter().map(|&b| plan.buffer(b).bytes).sum();
            named as f64 + 4.0 * params as f64 + g * grads as f64
        }
    };
    bytes as u64
}

/// Which way a transfer moves bytes (into the compute tier: a read), how many, and the tier
/// beneath it moves them to or from.
fn transfer(plan: &Plan, from: BufId, to: BufId) -> (bool, u64, Tier) {
    let (f, t) = (plan.buffer(from), plan.buffer(to));
    if t.placement.tier == plan.compute_tier() {
        (true, f.padded_bytes(), f.placement.tier)
    } else {
        (false, t.padded_bytes(), t.placement.tier)
    }
}

/// Whether a step is bounded by arithmetic, by the transfers (the disk, or a GPU's bus), or
/// by the update on the host's cores beneath a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    Compute,
    Io,
    Host,
}

/// A step's predicted time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Predicted seconds of one training step (compute plus waits for the disk).
    pub step_s: f64,
    /// Seconds of the ops themselves.
    pub compute_s: f64,
    /// Seconds the I/O thread is busy.
    pub io_s: f64,
    /// Seconds the compute waits for transfers.
    pub stall_s: f64,
    /// Seconds the communication thread is busy with collectives (ranks).
    pub comm_s: f64,
    /// Seconds the compute waits for collectives: communication not hidden.
    pub comm_wait_s: f64,
    /// Seconds of the update's ops (`Optimizer` and `DeferredUpdate` phases) on the compute
    /// tier, in `compute_s`.
    pub update_s: f64,
    /// Seconds of the ops on the host's cores beside a GPU (updates of state in pinned RAM,
    /// [`OpEntry::runs_on_host`]), not in `compute_s`: the host runs them while the GPU
    /// works through what was queued before them.
    #[serde(default)]
    pub host_s: f64,
    /// Seconds a pipeline stage idles while the pipeline fills and drains (1F1B's bubble:
    /// (p − 1)/m of its forward and backward, stages taken as balanced; (p − 1)/(V·m) under
    /// the interleaved schedule of V runs per stage), in `step_s`.
    pub bubble_s: f64,
    pub bound: Bound,
    /// Seconds by op kind, largest first.
    pub by_kind: Vec<(String, f64)>,
    /// Whether the calibration was an estimate ([`Source::Estimate`]) or lacked some of the
    /// plan's op kinds (then derived from the FMA peak).
    pub estimated: bool,
}

impl StepTime {
    /// Seconds a step spends once whatever its number of micro-batches: its update, on the
    /// compute tier and on the host.
    pub fn once_s(&self) -> f64 {
        self.update_s + self.host_s
    }
}

/// Predicts the time of one training step of `plan` on the calibrated machine: the ops a
/// step runs ([`crate::ir::Schedule::in_step`]) in order, transfers on the I/O clock.
///
/// Beneath a GPU, the host issues ops in order without waiting for them, except the ops it
/// runs itself ([`OpEntry::runs_on_host`]): each waits for the transfers into or out of its
/// buffers, and nothing after it starts before it ends (the host clock `th`).
pub fn predict(plan: &Plan, cal: &Calibration) -> StepTime {
    let mut estimated = cal.source == Source::Estimate;
    let (mut tc, mut ti, mut stall, mut busy) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let (mut th, mut host_s) = (0.0f64, 0.0f64);
    let compute = plan.compute_tier();
    // The communication thread's clock, its busy seconds, and the compute clock's waits
    // for it.
    let (mut tcomm, mut comm_s, mut comm_wait) = (0.0f64, 0.0f64, 0.0f64);
    // End time of the last transfer into or out of each staging buffer.
    let mut done: Vec<f64> = vec![0.0; plan.buffers.len()];
    let mut by_kind: BTreeMap<String, f64> = BTreeMap::new();
    let mut costs: BTreeMap<String, Cost> = BTreeMap::new();
    let mut update_s = 0.0;
    // The forward's seconds and arithmetic (the rate a distillation teacher runs at).
    let (mut forward_s, mut forward_flops) = (0.0f64, 0u64);
    for e in &plan.schedule.ops {
        if !plan.schedule.in_step(e.phase) {
            continue;
        }
        match &e.op {
            Op::Transfer { from, to } => {
                let (read, bytes, beneath) = transfer(plan, *from, *to);
                let rates = cal.rates_to(beneath);
                let rate = if read {
                    rates.read_bytes_per_s
                } else {
                    rates.write_bytes_per_s
                };
                let d = bytes as f64 / rate;
                ti = ti.max(tc).max(th) + d;
                busy += d;
                done[from.0] = ti;
                done[to.0] = ti;
            }
            Op::AwaitTransfers { bufs } => {
                let until = bufs.iter().map(|b| done[b.0]).fold(tc, f64::max);
                stall += until - tc;
                tc = until;
            }
            Op::AwaitCollective { bufs } => {
                let until = done[bufs[0].0].max(tc);
                comm_wait += until - tc;
                tc = until;
            }
            _ => {
                let kind = op_kind(plan, e).expect("ops other than transfers have a kind");
                let cost = *costs.entry(kind.clone()).or_insert_with(|| {
                    let fitted = cal.fitted(&kind, plan.cfg.mesh.data);
                    estimated |= fitted.is_none();
                    fitted.unwrap_or_else(|| cal.cost(&kind, plan.cfg.mesh.data))
                });
                let s = cost.seconds(e.flops, op_bytes(plan, e));
                *by_kind.entry(kind).or_default() += s;
                if e.runs_on_host(&plan.buffers, compute) {
                    let mut ready = th;
                    e.buffers(|b, _| ready = ready.max(done[b.0]));
                    th = ready + s;
                    host_s += s;
                } else if let Some(buf) = e.op.collective_buf() {
                    tcomm = tcomm.max(tc) + s;
                    done[buf.0] = tcomm;
                    comm_s += s;
                } else {
                    tc = tc.max(th) + s;
                    if matches!(e.phase, Phase::Optimizer | Phase::DeferredUpdate) {
                        update_s += s;
                    }
                    if e.phase == Phase::Forward {
                        forward_s += s;
                        forward_flops += e.flops;
                    }
                }
            }
        }
    }
    // A distillation teacher's forward over each row of the step, before the step's own
    // (`exec::teacher`), at the rate of the student's forward.
    if let Some(d) = plan
        .cfg
        .distill
        .filter(|d| d.teacher_flops > 0 && forward_flops > 0)
    {
        let rows = (plan.schedule.teacher_hidden.len() * plan.cfg.batch) as f64;
        let s = rows * d.teacher_flops as f64 * forward_s / forward_flops as f64;
        *by_kind.entry("teacher forward".into()).or_default() += s;
        tc += s;
    }
    let compute_s: f64 = by_kind.values().sum::<f64>() - comm_s - host_s;
    let stage = plan.layout.stage;
    let slots = (stage.chunks.max(1) * plan.cfg.grad_accum) as f64;
    let bubble_s = (compute_s - update_s) * (stage.size - 1) as f64 / slots;
    let step_s = tc.max(ti).max(tcomm).max(th) + bubble_s;
    let mut by_kind: Vec<(String, f64)> = by_kind.into_iter().collect();
    by_kind.sort_by(|a, b| b.1.total_cmp(&a.1));
    StepTime {
        step_s,
        compute_s,
        io_s: busy,
        stall_s: stall + (ti - tc).max(0.0),
        comm_s,
        comm_wait_s: comm_wait + (tcomm - tc.max(ti)).max(0.0),
        update_s,
        host_s,
        bubble_s,
        bound: if host_s > busy.max(compute_s) {
            Bound::Host
        } else if busy > compute_s {
            Bound::Io
        } else {
            Bound::Compute
        },
        by_kind,
        estimated,
    }
}
