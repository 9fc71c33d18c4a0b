//! The attention family on the GPU (`kernels/attention.cu`, `kernels/rope.cu`), as the CPU's
//! `backend/cpu/ops/attention.rs`:
//! - [`Op::Attention`]: one launch of the flash forward `attention_forward_hd<HD>_<S>` (HD the
//!   smallest of 64, 128, 256 holding the head size; larger heads are refused).
//! - [`Op::AttentionBackward`]: `attention_backward_dot_<S>` (D = rowsum(dout ⊙ out) into the
//!   scratch region `attention_rows`), then `attention_backward_dkv_hd<HD>_<S>` (the K and V
//!   parts of dqkv) and `attention_backward_dq_hd<HD>_<S>` (the Q part); dqkv is overwritten.
//! - Both pass the op's sliding window as the kernels' last argument `W` (T for none); the
//!   kernels skip the key tiles outside every query's window, so the work follows the window.
//! - [`Op::Rope`]: `rope_<S>` in place, its `inv_freq` read from a device copy made when the
//!   device starts ([`prepare_rope`], [`RopeTables`]).
//!
//! Generation's shorter sequence (`StepCtx::seq`) is the CPU's: every buffer is read and
//! written as `[B, T_run]` rows packed from its start (the first `B·T_run` rows), so the
//! kernels get `T = T_run`.
//!
//! Launch shapes ([`forward_launch`], [`backward_launches`]) are pure functions of
//! (B, T, NH, NKV, hd), the formulas of the kernels' doc comments.
//!
//! Tensor cores (`kernels/attention_mma.cu`, mma.sync m16n8k16, f32 accumulation; HD = 64 or
//! 128): the forward `attention_forward_mma_hd<HD>_<S>` and the backward's
//! `attention_backward_dkv_mma_hd<HD>_<S>`, `attention_backward_dq_mma_hd<HD>_<S>` (launch 1,
//! the dot, is the same) serve bf16 and f16 plans with head sizes up to 128 on sm_80 and newer
//! ([`select_forward`], [`select_backward`], [`uses_mma`]) ONLY when the environment says
//! `MEMWALL_CUDA_ATTENTION=mma` (read once per process, [`AttentionKernels::from_env`]). The
//! default is `fma`, attention.cu's kernels, until a GPU run has confirmed the mma kernels (so
//! far they are checked by NVRTC and the CPU emulation only). f32 plans and larger heads
//! always use attention.cu's kernels.

use super::super::gpu::GpuDevice;
use super::super::launch::{grid_stride, launch_error, suffix};
use super::super::rope_tables::RopeTables;
use crate::backend::StepCtx;
use crate::dtype::DType;
use crate::ir::BufId;
use crate::ir::schedule::{Op, OpEntry};
use anyhow::{Result, anyhow, bail};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg, sys as ds};
use std::sync::OnceLock;

/// Dynamic shared memory a block may use without opting in
/// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
pub const DEFAULT_SHARED_BYTES: u32 = 48 << 10;

/// Threads of every flash attention block (`ATT_THREADS`: exactly this many, the kernels
/// return without writing otherwise).
const ATT_THREADS: u32 = 256;
/// Queries (and keys) of a flash tile (`ATT_BQ` = `ATT_BK`).
const ATT_TILE: usize = 32;
/// The largest grid y and z dimensions.
const MAX_GRID_YZ: usize = 65535;
/// The largest grid x dimension.
const MAX_GRID_X: usize = i32::MAX as usize;

/// Threads of a tensor-core attention block (`ATTM_THREADS`: exactly this many).
const ATTM_THREADS: u32 = 128;
/// Queries (and keys) of a tensor-core tile (`ATTM_BQ` = `ATTM_BK`).
const ATTM_TILE: usize = 64;
/// The environment variable choosing the attention kernels of bf16/f16 plans.
pub const ATTENTION_ENV: &str = "MEMWALL_CUDA_ATTENTION";

/// Which kernels run causal self-attention for bf16 and f16 plans: `fma` (attention.cu's
/// f32 FMA kernels, the default) or `mma` (attention_mma.cu's tensor-core forward where it
/// applies, [`uses_mma`]), as `MEMWALL_CUDA_ATTENTION` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernels {
    Fma,
    Mma,
}

impl AttentionKernels {
    /// The choice a value of `MEMWALL_CUDA_ATTENTION` names (unset or empty: `fma`).
    pub fn parse(v: Option<&str>) -> Result<Self> {
        match v.map(str::trim) {
            None | Some("") | Some("fma") => Ok(Self::Fma),
            Some("mma") => Ok(Self::Mma),
            Some(other) => bail!("{ATTENTION_ENV}={other}: expected `fma` or `mma`"),
        }
    }

    /// `MEMWALL_CUDA_ATTENTION`, read once per process.
    pub fn from_env() -> Result<Self> {
        static CHOICE: OnceLock<std::result::Result<AttentionKernels, String>> = OnceLock::new();
        CHOICE
            .get_or_init(|| {
                let v = std::env::var(ATTENTION_ENV).ok();
                Self::parse(v.as_deref()).map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| anyhow!(e))
    }
}

/// The shape of one attention op: B rows of T tokens, NH query heads, NKV key/value heads,
/// head size hd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
}

impl Dims {
    /// qkv's row length, (NH + 2·NKV)·hd.
    pub fn ld(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }

    /// out's row length, NH·hd.
    pub fn co(&self) -> usize {
        self.nh * self.hd
    }

    /// Bytes of the backward's D `[B, NH, T]` f32 (the scratch region `attention_rows`).
    pub fn d_bytes(&self) -> u64 {
        (self.b * self.nh * self.t * 4) as u64
    }

    /// The kernels' `int` arguments (B, T, NH, NKV, hd).
    fn ints(&self) -> Result<[i32; 5]> {
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| anyhow!("{what} = {v} does not fit the kernels' int"))
        };
        Ok([
            int(self.b, "B")?,
            int(self.t, "T")?,
            int(self.nh, "NH")?,
            int(self.nkv, "NKV")?,
            int(self.hd, "hd")?,
        ])
    }
}

/// One kernel launch: its entry's stem (the storage suffix is added), grid, block and
/// dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub stem: &'static str,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub shared: u32,
}

impl Launch {
    fn config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: self.grid,
            block_dim: (self.block, 1, 1),
            shared_mem_bytes: self.shared,
        }
    }

    /// Whether the function must opt in to its dynamic shared memory before the launch.
    pub fn opts_in(&self) -> bool {
        self.shared > DEFAULT_SHARED_BYTES
    }
}

/// The flash kernels' head tile HD for head size `hd`: the smallest of 64, 128, 256 with
/// hd ≤ HD.
pub fn head_tile(hd: usize) -> Result<usize> {
    match hd {
        0 => bail!("attention with head size 0"),
        1..=64 => Ok(64),
        65..=128 => Ok(128),
        129..=256 => Ok(256),
        _ => bail!(
            "attention with head size {hd}: the CUDA kernels handle head sizes up to 256; \
             use --device cpu"
        ),
    }
}

/// Checks what every flash launch of `d` needs: heads that group (NKV divides NH), sizes the
/// kernels' ints hold, grids within the device's limits.
fn check(d: Dims) -> Result<()> {
    if d.b == 0 || d.t == 0 {
        bail!(
            "internal error: attention over {} rows of {} tokens",
            d.b,
            d.t
        );
    }
    if d.nh == 0 || d.nkv == 0 || !d.nh.is_multiple_of(d.nkv) {
        bail!(
            "attention with {} query heads and {} key/value heads: the key/value heads must \
             divide the query heads",
            d.nh,
            d.nkv
        );
    }
    d.ints()?;
    if d.b > MAX_GRID_YZ || d.nh > MAX_GRID_YZ {
        bail!(
            "attention over {} rows of {} heads: the CUDA launch grid holds at most {MAX_GRID_YZ} \
             of each",
            d.b,
            d.nh
        );
    }
    Ok(())
}

fn tiles(t: usize) -> u32 {
    t.div_ceil(ATT_TILE) as u32
}

/// The forward's launch: `attention_forward_hd<HD>`, grid (ceil(T/32), NH, B), block 256,
/// dynamic shared bytes 4·(32·hd + 32·(hd|1) + 32·hd + 1024).
pub fn forward_launch(d: Dims) -> Result<Launch> {
    let stem = match head_tile(d.hd)? {
        64 => "attention_forward_hd64",
        128 => "attention_forward_hd128",
        _ => "attention_forward_hd256",
    };
    check(d)?;
    let hd = d.hd;
    Ok(Launch {
        stem,
        grid: (tiles(d.t), d.nh as u32, d.b as u32),
        block: ATT_THREADS,
        shared: (4 * (32 * hd + 32 * (hd | 1) + 32 * hd + 1024)) as u32,
    })
}

/// Whether the tensor-core forward serves a head size `hd` in `storage` on a card of compute
/// capability `sm_major`.x: `kernels` is [`AttentionKernels::Mma`], the storage bf16 or f16
/// (the mma's operand types), 1 ≤ hd ≤ 128, and the card sm_80 or newer.
pub fn uses_mma(kernels: AttentionKernels, storage: DType, hd: usize, sm_major: u32) -> bool {
    kernels == AttentionKernels::Mma
        && matches!(storage, DType::Bf16 | DType::F16)
        && (1..=128).contains(&hd)
        && sm_major >= 8
}

/// The tensor-core forward's launch: `attention_forward_mma_hd<HD>` (HD = 64 for hd ≤ 64,
/// else 128; hd ≤ 128), grid (ceil(T/64), NH, B), block 128, dynamic shared bytes
/// 2·(64·(HD+8) + HD·72) (hd64: 18,432; hd128: 35,840: no opt-in).
pub fn mma_forward_launch(d: Dims) -> Result<Launch> {
    let (stem, hd_tile) = match d.hd {
        1..=64 => ("attention_forward_mma_hd64", 64),
        65..=128 => ("attention_forward_mma_hd128", 128),
        hd => bail!("internal error: the tensor-core attention forward with head size {hd}"),
    };
    check(d)?;
    Ok(Launch {
        stem,
        grid: (d.t.div_ceil(ATTM_TILE) as u32, d.nh as u32, d.b as u32),
        block: ATTM_THREADS,
        shared: (2 * (64 * (hd_tile + 8) + hd_tile * 72)) as u32,
    })
}

/// The forward's launch for a plan of storage `storage` on a card of compute capability
/// `sm_major`.x: [`mma_forward_launch`] where [`uses_mma`], else [`forward_launch`].
pub fn select_forward(
    d: Dims,
    storage: DType,
    kernels: AttentionKernels,
    sm_major: u32,
) -> Result<Launch> {
    if uses_mma(kernels, storage, d.hd, sm_major) {
        mma_forward_launch(d)
    } else {
        forward_launch(d)
    }
}

/// The tensor-core backward's launches: 1. as [`backward_launches`]'s; 2.
/// `attention_backward_dkv_mma_hd<HD>`: grid (ceil(T/64), NKV, B), block 128, dynamic shared
/// bytes 2·(4·64·(HD+8) + 2·HD·72) (hd64: 55,296; hd128: 106,496: both opt in); 3.
/// `attention_backward_dq_mma_hd<HD>`: grid (ceil(T/64), NH, B), block 128, dynamic shared
/// bytes 2·(4·64·(HD+8) + HD·72) (hd64: 46,080; hd128: 88,064, opting in). HD = 64 for
/// hd ≤ 64, else 128; hd ≤ 128.
pub fn mma_backward_launches(d: Dims) -> Result<[Launch; 3]> {
    let (dkv, dq, hd_tile) = match d.hd {
        1..=64 => (
            "attention_backward_dkv_mma_hd64",
            "attention_backward_dq_mma_hd64",
            64,
        ),
        65..=128 => (
            "attention_backward_dkv_mma_hd128",
            "attention_backward_dq_mma_hd128",
            128,
        ),
        hd => bail!("internal error: the tensor-core attention backward with head size {hd}"),
    };
    let [dot, _, _] = backward_launches(d)?;
    let rows = 4 * ATTM_TILE * (hd_tile + 8);
    let tiles = d.t.div_ceil(ATTM_TILE) as u32;
    Ok([
        dot,
        Launch {
            stem: dkv,
            grid: (tiles, d.nkv as u32, d.b as u32),
            block: ATTM_THREADS,
            shared: (2 * (rows + 2 * hd_tile * 72)) as u32,
        },
        Launch {
            stem: dq,
            grid: (tiles, d.nh as u32, d.b as u32),
            block: ATTM_THREADS,
            shared: (2 * (rows + hd_tile * 72)) as u32,
        },
    ])
}

/// The backward's launches for a plan of storage `storage` on a card of compute capability
/// `sm_major`.x: [`mma_backward_launches`] where [`uses_mma`], else [`backward_launches`].
pub fn select_backward(
    d: Dims,
    storage: DType,
    kernels: AttentionKernels,
    sm_major: u32,
) -> Result<[Launch; 3]> {
    if uses_mma(kernels, storage, d.hd, sm_major) {
        mma_backward_launches(d)
    } else {
        backward_launches(d)
    }
}

/// The backward's three launches, in order:
/// 1. `attention_backward_dot`: grid ceil(B·T·NH / 8), block 256, no shared memory;
/// 2. `attention_backward_dkv_hd<HD>`: grid (ceil(T/32), NKV, B), block 256, dynamic shared
///    bytes 4·(64·hd + 64·(hd|1) + 2048);
/// 3. `attention_backward_dq_hd<HD>`: grid (ceil(T/32), NH, B), block 256, dynamic shared
///    bytes 4·(64·hd + 64·(hd|1) + 1024).
pub fn backward_launches(d: Dims) -> Result<[Launch; 3]> {
    let (dkv, dq) = match head_tile(d.hd)? {
        64 => ("attention_backward_dkv_hd64", "attention_backward_dq_hd64"),
        128 => (
            "attention_backward_dkv_hd128",
            "attention_backward_dq_hd128",
        ),
        _ => (
            "attention_backward_dkv_hd256",
            "attention_backward_dq_hd256",
        ),
    };
    check(d)?;
    let pairs = d.b * d.t * d.nh;
    let warps = (ATT_THREADS / 32) as usize;
    let dot_blocks = pairs.div_ceil(warps);
    if dot_blocks > MAX_GRID_X {
        bail!(
            "attention backward over {pairs} (token, head) pairs: more than the CUDA launch \
             grid holds"
        );
    }
    let hd = d.hd;
    Ok([
        Launch {
            stem: "attention_backward_dot",
            grid: (dot_blocks as u32, 1, 1),
            block: ATT_THREADS,
            shared: 0,
        },
        Launch {
            stem: dkv,
            grid: (tiles(d.t), d.nkv as u32, d.b as u32),
            block: ATT_THREADS,
            shared: (4 * (64 * hd + 64 * (hd | 1) + 2048)) as u32,
        },
        Launch {
            stem: dq,
            grid: (tiles(d.t), d.nh as u32, d.b as u32),
            block: ATT_THREADS,
            shared: (4 * (64 * hd + 64 * (hd | 1) + 1024)) as u32,
        },
    ])
}

impl GpuDevice {
    /// Runs `e`, an op of the attention family.
    pub(in crate::backend::cuda) fn run_attention(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        match &e.op {
            Op::Attention {
                qkv,
                positions,
                out,
                lse,
                rows,
                nh,
                nkv,
                hd,
                window,
                scale_dim,
                ..
            } => {
                let r = rows.with_seq(ctx.seq);
                let d = Dims {
                    b: r.b,
                    t: r.t,
                    nh: *nh,
                    nkv: *nkv,
                    hd: *hd,
                };
                self.att_forward(e, (d, *window, *scale_dim), *qkv, *positions, *out, *lse)
            }
            Op::AttentionBackward {
                dqkv,
                positions,
                dout,
                qkv,
                out,
                lse,
                rows,
                nh,
                nkv,
                hd,
                window,
                scale_dim,
                ..
            } => {
                let r = rows.with_seq(ctx.seq);
                let d = Dims {
                    b: r.b,
                    t: r.t,
                    nh: *nh,
                    nkv: *nkv,
                    hd: *hd,
                };
                let io = (*dqkv, *positions, *dout, *qkv, *out, *lse);
                self.att_backward(e, (d, *window, *scale_dim), io)
            }
            Op::Rope { .. } => self.att_rope(e, ctx),
            _ => bail!("internal error: {} is not an attention op", e.name),
        }
    }

    /// The device's copies of the Rope tables (made by `GpuDevice::new`).
    fn rope_tables(&self) -> Option<&RopeTables> {
        Some(&self.rope)
    }

    /// Address and bytes of buffer `id`, checked to hold `need` bytes (what the kernels read
    /// or write of it).
    fn att_sized(&self, e: &OpEntry, id: BufId, need: u64, what: &str) -> Result<u64> {
        let (ptr, bytes) = self.addr(id)?;
        if bytes < need {
            bail!(
                "internal error: {}: its {what} buffer holds {bytes} bytes, the kernels use \
                 {need}",
                e.name
            );
        }
        Ok(ptr)
    }

    /// The address of the rows' positions (`[B·T]` u32, packed rows), or 0 (NULL: plain
    /// causal rows).
    fn att_positions(&self, e: &OpEntry, positions: Option<BufId>, n: usize) -> Result<u64> {
        match positions {
            Some(id) => self.att_sized(e, id, (n * 4) as u64, "positions"),
            None => Ok(0),
        }
    }

    /// The kernels' window argument `W`: the window, or T for none (a window of T or more
    /// is none); at least 1.
    fn att_window(d: Dims, window: Option<usize>) -> Result<i32> {
        let w = window.map_or(d.t, |w| w.clamp(1, d.t.max(1)));
        i32::try_from(w).map_err(|_| anyhow!("window {w} does not fit the kernels' int"))
    }

    /// Bytes of one activation element (the storage type).
    fn att_elem_bytes(&self) -> u64 {
        self.storage.size().unwrap_or(4) as u64
    }

    /// Entry `stem_<S>`, with its full name (for errors), opted in to `l`'s dynamic shared
    /// memory when it needs more than the default 48 KiB (the attribute is set before every
    /// such launch: a host-side driver call, no synchronization).
    fn att_entry(&self, e: &OpEntry, l: &Launch) -> Result<(&CudaFunction, String)> {
        let name = format!("{}_{}", l.stem, suffix(self.storage));
        let f = self.kernel(l.stem)?;
        if l.opts_in() {
            let attr = ds::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            if let Err(err) = f.set_attribute(attr, l.shared as i32) {
                let most = self
                    .ctx
                    .attribute(
                        ds::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                    )
                    .map(|b| format!("{b} bytes"))
                    .unwrap_or_else(|_| "less".into());
                bail!(
                    "{}: CUDA kernel {name} needs {} bytes of shared memory per block, this GPU \
                     ({}) allows {most} ({err:?})",
                    e.name,
                    l.shared,
                    self.arch
                );
            }
        }
        Ok((f, name))
    }

    /// [`Op::Attention`]: `attention_forward_hd<HD>_<S>(qkv, pos, out, lse, B, T, NH, NKV,
    /// hd, W, sd)` (or `attention_forward_mma_hd<HD>_<S>`, the same arguments, where
    /// [`select_forward`] picks it), writing out `[N, NH·hd]` and lse `[B, NH, T]` in full;
    /// `W` the sliding window (T for none: [`Self::att_window`]), `sd` the op's `scale_dim`
    /// (scores are q·k / √sd).
    fn att_forward(
        &self,
        e: &OpEntry,
        (d, window, sd): (Dims, Option<usize>, f32),
        qkv: BufId,
        positions: Option<BufId>,
        out: BufId,
        lse: BufId,
    ) -> Result<()> {
        if d.b * d.t == 0 {
            return Ok(());
        }
        let l = AttentionKernels::from_env()
            .and_then(|k| select_forward(d, self.storage, k, self.arch.major))
            .map_err(|err| anyhow!("{}: {err}", e.name))?;
        let (n, es) = (d.b * d.t, self.att_elem_bytes());
        let qkv = self.att_sized(e, qkv, (n * d.ld()) as u64 * es, "qkv")?;
        let pos = self.att_positions(e, positions, n)?;
        let out = self.att_sized(e, out, (n * d.co()) as u64 * es, "out")?;
        let lse = self.att_sized(e, lse, d.d_bytes(), "lse")?;
        let [b, t, nh, nkv, hd] = d.ints()?;
        let w = Self::att_window(d, window)?;
        let (f, name) = self.att_entry(e, &l)?;
        // SAFETY: the forward entry's signature (const T* qkv, const unsigned* pos, T* out,
        // float* lse, int B, int T, int NH, int NKV, int hd, int W, float sd); the buffers hold what it
        // reads and writes (checked above); its launch shape and shared memory are the doc's.
        unsafe {
            self.launch(f)
                .arg(&qkv)
                .arg(&pos)
                .arg(&out)
                .arg(&lse)
                .arg(&b)
                .arg(&t)
                .arg(&nh)
                .arg(&nkv)
                .arg(&hd)
                .arg(&w)
                .arg(&sd)
                .launch(l.config())
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, &name, err))
    }

    /// [`Op::AttentionBackward`]: D into the scratch region `attention_rows` (launch 1), then
    /// dK, dV (launch 2) and dQ (launch 3), overwriting dqkv in full; the window and `sd` as
    /// the forward's.
    #[allow(clippy::type_complexity)]
    fn att_backward(
        &self,
        e: &OpEntry,
        (d, window, sd): (Dims, Option<usize>, f32),
        (dqkv, positions, dout, qkv, out, lse): (BufId, Option<BufId>, BufId, BufId, BufId, BufId),
    ) -> Result<()> {
        if d.b * d.t == 0 {
            return Ok(());
        }
        let [dot, dkv, dq] = AttentionKernels::from_env()
            .and_then(|k| select_backward(d, self.storage, k, self.arch.major))
            .map_err(|err| anyhow!("{}: {err}", e.name))?;
        let (n, es) = (d.b * d.t, self.att_elem_bytes());
        let rows_bytes = (n * d.ld()) as u64 * es;
        let out_bytes = (n * d.co()) as u64 * es;
        let dqkv = self.att_sized(e, dqkv, rows_bytes, "dqkv")?;
        let pos = self.att_positions(e, positions, n)?;
        let dout = self.att_sized(e, dout, out_bytes, "dout")?;
        let qkv = self.att_sized(e, qkv, rows_bytes, "qkv")?;
        let out = self.att_sized(e, out, out_bytes, "out")?;
        let lse = self.att_sized(e, lse, d.d_bytes(), "lse")?;
        let (dptr, dcap) = self.scratch().attention_rows;
        if dptr == 0 || dcap < d.d_bytes() {
            bail!(
                "internal error: {}: the backend's scratch has {dcap} bytes for attention's row \
                 sums, the backward needs {}",
                e.name,
                d.d_bytes()
            );
        }
        let [b, t, nh, nkv, hd] = d.ints()?;
        let w = Self::att_window(d, window)?;

        // 1. D[(b·NH + h)·T + i] = Σ_c dout · out.
        let (f, name) = self.att_entry(e, &dot)?;
        // SAFETY: (float* D, const T* dout, const T* out, int B, int T, int NH, int hd); D
        // holds B·NH·T f32 (checked above).
        unsafe {
            self.launch(f)
                .arg(&dptr)
                .arg(&dout)
                .arg(&out)
                .arg(&b)
                .arg(&t)
                .arg(&nh)
                .arg(&hd)
                .launch(dot.config())
        }
        .map_err(|err| launch_error(e, &name, err))?;

        // 2. dK, dV; 3. dQ: the same arguments, each after launch 1 on the stream.
        for l in [dkv, dq] {
            let (f, name) = self.att_entry(e, &l)?;
            // SAFETY: (T* dqkv, const unsigned* pos, const T* dout, const T* qkv, const
            // float* lse, const float* D, int B, int T, int NH, int NKV, int hd, int W, float
            // sd); the buffers hold what it reads and writes (checked above).
            unsafe {
                self.launch(f)
                    .arg(&dqkv)
                    .arg(&pos)
                    .arg(&dout)
                    .arg(&qkv)
                    .arg(&lse)
                    .arg(&dptr)
                    .arg(&b)
                    .arg(&t)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&w)
                    .arg(&sd)
                    .launch(l.config())
            }
            .map_err(|err| launch_error(e, &name, err))?;
        }
        Ok(())
    }

    /// [`Op::Rope`]: `rope_<S>(x, pos, inv_freq, scale, N, T, width, rotated, hd, pos0 = 0,
    /// inverse)` in place, grid-stride over N·hd/2.
    fn att_rope(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        let Op::Rope {
            x,
            positions,
            rows,
            width,
            rotated,
            hd,
            inv_freq,
            scale,
            inverse,
        } = &e.op
        else {
            bail!("internal error: {} is not a rope op", e.name);
        };
        let r = rows.with_seq(ctx.seq);
        let (n, width, rotated, hd) = (r.n(), *width, *rotated, *hd);
        if hd < 2 || !hd.is_multiple_of(2) || !rotated.is_multiple_of(hd) || rotated > width {
            bail!(
                "internal error: {}: rotary embedding of {rotated} of {width} channels in heads \
                 of {hd}",
                e.name
            );
        }
        if inv_freq.len() < hd / 2 {
            bail!(
                "internal error: {}: {} rotary frequencies for heads of {hd}",
                e.name,
                inv_freq.len()
            );
        }
        if n == 0 {
            return Ok(());
        }
        let Some(tables) = self.rope_tables() else {
            bail!(
                "{}: the CUDA backend does not run rotary embeddings yet (its frequency tables \
                 are not on the GPU); use --device cpu",
                e.name
            );
        };
        let freq = tables.find(inv_freq).ok_or_else(|| {
            anyhow!(
                "internal error: {}: its rotary frequencies were not copied to the GPU",
                e.name
            )
        })?;
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| anyhow!("{}: {v} does not fit the kernel's int", e.name))
        };
        let (n_i, t_i, width_i, rotated_i, hd_i) =
            (int(n)?, int(r.t)?, int(width)?, int(rotated)?, int(hd)?);
        let (pos0, inverse) = (0i32, *inverse as i32);
        let xp = self.att_sized(e, *x, (n * width) as u64 * self.att_elem_bytes(), "x")?;
        let pos = self.att_positions(e, *positions, n)?;
        let f = self.kernel("rope")?;
        let name = format!("rope_{}", suffix(self.storage));
        // SAFETY: (T* x, const unsigned* positions, const float* inv_freq, float scale,
        // int N, int T, int width, int rotated, int hd, int pos0, int inverse); x holds N·width elements
        // (checked), inv_freq hd/2 f32 in device memory; any grid-stride shape.
        unsafe {
            self.launch(f)
                .arg(&xp)
                .arg(&pos)
                .arg(&freq)
                .arg(scale)
                .arg(&n_i)
                .arg(&t_i)
                .arg(&width_i)
                .arg(&rotated_i)
                .arg(&hd_i)
                .arg(&pos0)
                .arg(&inverse)
                .launch(grid_stride((n * (hd / 2)) as u64))
        }
        .map(|_| ())
        .map_err(|err| launch_error(e, &name, err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::sizing::Scratch;
    use crate::dtype::DType;
    use crate::ir::schedule::{Phase, Rows};

    fn gpt2() -> Dims {
        Dims {
            b: 4,
            t: 1024,
            nh: 12,
            nkv: 12,
            hd: 64,
        }
    }

    fn llama3_8b() -> Dims {
        Dims {
            b: 1,
            t: 8192,
            nh: 32,
            nkv: 8,
            hd: 128,
        }
    }

    #[test]
    fn head_tiles_are_the_smallest_that_hold_the_head() {
        assert_eq!(head_tile(1).unwrap(), 64);
        assert_eq!(head_tile(64).unwrap(), 64);
        assert_eq!(head_tile(65).unwrap(), 128);
        assert_eq!(head_tile(80).unwrap(), 128);
        assert_eq!(head_tile(128).unwrap(), 128);
        assert_eq!(head_tile(129).unwrap(), 256);
        assert_eq!(head_tile(256).unwrap(), 256);
        let err = head_tile(257).unwrap_err().to_string();
        assert!(err.contains("257") && err.contains("256"), "{err}");
        assert!(head_tile(0).is_err());
    }

    #[test]
    fn gpt2_launches_follow_the_kernel_doc() {
        let d = gpt2();
        let f = forward_launch(d).unwrap();
        assert_eq!(f.stem, "attention_forward_hd64");
        assert_eq!(f.grid, (32, 12, 4));
        assert_eq!(f.block, 256);
        assert_eq!(f.shared, 28_800);
        assert!(!f.opts_in());
        let [dot, dkv, dq] = backward_launches(d).unwrap();
        assert_eq!(dot.stem, "attention_backward_dot");
        assert_eq!(dot.grid, ((4 * 1024 * 12 / 8) as u32, 1, 1));
        assert_eq!((dot.block, dot.shared), (256, 0));
        assert_eq!(dkv.stem, "attention_backward_dkv_hd64");
        assert_eq!(dkv.grid, (32, 12, 4));
        assert_eq!((dkv.block, dkv.shared), (256, 41_216));
        assert_eq!(dq.stem, "attention_backward_dq_hd64");
        assert_eq!(dq.grid, (32, 12, 4));
        assert_eq!((dq.block, dq.shared), (256, 37_120));
        // The hd 64 entries never opt in.
        assert!(!dkv.opts_in() && !dq.opts_in());
    }

    #[test]
    fn llama3_8b_launches_follow_the_kernel_doc() {
        let d = llama3_8b();
        let f = forward_launch(d).unwrap();
        assert_eq!(f.stem, "attention_forward_hd128");
        assert_eq!(f.grid, (256, 32, 1));
        assert_eq!(f.shared, 53_376);
        assert!(f.opts_in());
        let [dot, dkv, dq] = backward_launches(d).unwrap();
        assert_eq!(dot.grid, (8192 * 32 / 8, 1, 1));
        assert_eq!(dkv.stem, "attention_backward_dkv_hd128");
        assert_eq!(dkv.grid, (256, 8, 1)); // one CTA column per KV head
        assert_eq!(dkv.shared, 73_984);
        assert_eq!(dq.stem, "attention_backward_dq_hd128");
        assert_eq!(dq.grid, (256, 32, 1));
        assert_eq!(dq.shared, 69_888);
        assert!(dkv.opts_in() && dq.opts_in());
    }

    #[test]
    fn hd256_and_odd_heads_and_ragged_sequences() {
        let d = Dims {
            b: 2,
            t: 33,
            nh: 8,
            nkv: 1,
            hd: 256,
        };
        assert_eq!(forward_launch(d).unwrap().shared, 102_528);
        let [dot, dkv, dq] = backward_launches(d).unwrap();
        assert_eq!(dot.grid.0, (2 * 33 * 8usize).div_ceil(8) as u32);
        assert_eq!((dkv.grid, dkv.shared), ((2, 1, 2), 139_520));
        assert_eq!((dq.grid, dq.shared), ((2, 8, 2), 135_424));
        // Shared memory follows the runtime hd, not the tile: hd 80 on the hd128 entries.
        let d = Dims { hd: 80, ..gpt2() };
        let f = forward_launch(d).unwrap();
        assert_eq!(f.stem, "attention_forward_hd128");
        assert_eq!(f.shared, 4 * (32 * 80 + 32 * 81 + 32 * 80 + 1024));
        // A single token.
        let d = Dims { t: 1, ..gpt2() };
        assert_eq!(forward_launch(d).unwrap().grid, (1, 12, 4));
        assert_eq!(backward_launches(d).unwrap()[0].grid, (6, 1, 1));
    }

    #[test]
    fn impossible_shapes_are_refused() {
        let err = forward_launch(Dims { hd: 320, ..gpt2() })
            .unwrap_err()
            .to_string();
        assert!(err.contains("head size 320"), "{err}");
        assert!(backward_launches(Dims { hd: 512, ..gpt2() }).is_err());
        let err = forward_launch(Dims { nkv: 5, ..gpt2() })
            .unwrap_err()
            .to_string();
        assert!(err.contains("divide"), "{err}");
        assert!(forward_launch(Dims { nkv: 0, ..gpt2() }).is_err());
        assert!(forward_launch(Dims { t: 0, ..gpt2() }).is_err());
        assert!(
            forward_launch(Dims {
                b: 70_000,
                ..gpt2()
            })
            .is_err()
        );
        assert!(
            forward_launch(Dims {
                t: 1 << 31,
                ..gpt2()
            })
            .is_err()
        );
    }

    #[test]
    fn the_attention_kernels_switch_parses() {
        use AttentionKernels::*;
        assert_eq!(AttentionKernels::parse(None).unwrap(), Fma);
        assert_eq!(AttentionKernels::parse(Some("")).unwrap(), Fma);
        assert_eq!(AttentionKernels::parse(Some("fma")).unwrap(), Fma);
        assert_eq!(AttentionKernels::parse(Some("mma")).unwrap(), Mma);
        assert_eq!(AttentionKernels::parse(Some(" mma\n")).unwrap(), Mma);
        let err = AttentionKernels::parse(Some("wmma"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(ATTENTION_ENV) && err.contains("wmma"), "{err}");
    }

    #[test]
    fn the_tensor_cores_serve_only_bf16_and_f16_heads_up_to_128_on_sm80_when_asked() {
        use AttentionKernels::*;
        for st in [DType::Bf16, DType::F16] {
            for hd in [1, 33, 64, 65, 80, 128] {
                assert!(uses_mma(Mma, st, hd, 8) && uses_mma(Mma, st, hd, 9));
                assert!(!uses_mma(Fma, st, hd, 9), "fma is the default");
            }
            assert!(!uses_mma(Mma, st, 129, 9) && !uses_mma(Mma, st, 256, 9));
            assert!(!uses_mma(Mma, st, 0, 9));
            assert!(!uses_mma(Mma, st, 64, 7), "sm_75 has no bf16 m16n8k16");
        }
        assert!(!uses_mma(Mma, DType::F32, 64, 9));
        // The selection: the fma launch unless the tensor cores serve the op.
        let d = gpt2();
        assert_eq!(
            select_forward(d, DType::Bf16, Fma, 9).unwrap(),
            forward_launch(d).unwrap()
        );
        assert_eq!(
            select_forward(d, DType::F32, Mma, 9).unwrap(),
            forward_launch(d).unwrap()
        );
        let m = select_forward(d, DType::Bf16, Mma, 9).unwrap();
        assert_eq!(m, mma_forward_launch(d).unwrap());
        assert_eq!(
            select_backward(d, DType::Bf16, Fma, 9).unwrap(),
            backward_launches(d).unwrap()
        );
        assert_eq!(
            select_backward(d, DType::F32, Mma, 9).unwrap(),
            backward_launches(d).unwrap()
        );
        assert_eq!(
            select_backward(d, DType::F16, Mma, 8).unwrap(),
            mma_backward_launches(d).unwrap()
        );
        assert_eq!(
            select_backward(d, DType::F16, Mma, 7).unwrap(),
            backward_launches(d).unwrap()
        );
        let d256 = Dims { hd: 256, ..d };
        assert_eq!(
            select_forward(d256, DType::F16, Mma, 9).unwrap().stem,
            "attention_forward_hd256"
        );
    }

    #[test]
    fn mma_forward_launches_follow_the_kernel_doc() {
        // GPT-2: hd 64, tiles of 64 queries.
        let f = mma_forward_launch(gpt2()).unwrap();
        assert_eq!(f.stem, "attention_forward_mma_hd64");
        assert_eq!(f.grid, (16, 12, 4));
        assert_eq!((f.block, f.shared), (128, 18_432));
        assert!(!f.opts_in());
        // Llama 3 8B: hd 128, GQA (the grid is over query heads).
        let f = mma_forward_launch(llama3_8b()).unwrap();
        assert_eq!(f.stem, "attention_forward_mma_hd128");
        assert_eq!(f.grid, (128, 32, 1));
        assert_eq!((f.block, f.shared), (128, 35_840));
        assert!(!f.opts_in());
        // Shared memory follows the tile HD (rows are zero-padded), not the runtime hd; a
        // ragged T rounds up.
        for (hd, tile) in [
            (1, 64),
            (40, 64),
            (64, 64),
            (65, 128),
            (80, 128),
            (128, 128),
        ] {
            let d = Dims {
                hd,
                t: 65,
                ..gpt2()
            };
            let f = mma_forward_launch(d).unwrap();
            assert_eq!(
                f.shared as usize,
                2 * (64 * (tile + 8) + tile * 72),
                "hd {hd}"
            );
            assert_eq!(f.grid.0, 2);
        }
        assert!(mma_forward_launch(Dims { hd: 129, ..gpt2() }).is_err());
        assert!(mma_forward_launch(Dims { nkv: 5, ..gpt2() }).is_err());
    }

    #[test]
    fn mma_backward_launches_follow_the_kernel_doc() {
        let d = gpt2();
        let [dot, dkv, dq] = mma_backward_launches(d).unwrap();
        assert_eq!(
            dot,
            backward_launches(d).unwrap()[0],
            "launch 1 is attention.cu's dot"
        );
        assert_eq!(dkv.stem, "attention_backward_dkv_mma_hd64");
        assert_eq!(
            (dkv.grid, dkv.block, dkv.shared),
            ((16, 12, 4), 128, 55_296)
        );
        assert!(dkv.opts_in());
        assert_eq!(dq.stem, "attention_backward_dq_mma_hd64");
        assert_eq!((dq.grid, dq.block, dq.shared), ((16, 12, 4), 128, 46_080));
        assert!(!dq.opts_in());
        let [_, dkv, dq] = mma_backward_launches(llama3_8b()).unwrap();
        assert_eq!(dkv.stem, "attention_backward_dkv_mma_hd128");
        assert_eq!((dkv.grid, dkv.shared), ((128, 8, 1), 106_496)); // one column per KV head
        assert_eq!(dq.stem, "attention_backward_dq_mma_hd128");
        assert_eq!((dq.grid, dq.shared), ((128, 32, 1), 88_064));
        assert!(dkv.opts_in() && dq.opts_in());
        // Within sm_80's 163 KiB of opt-in shared memory.
        assert!(dkv.shared <= 163 * 1024);
        for (hd, tile) in [(1, 64), (33, 64), (72, 128), (128, 128)] {
            let [_, dkv, dq] = mma_backward_launches(Dims {
                hd,
                t: 129,
                ..gpt2()
            })
            .unwrap();
            assert_eq!(
                dkv.shared as usize,
                2 * (4 * 64 * (tile + 8) + 2 * tile * 72)
            );
            assert_eq!(dq.shared as usize, 2 * (4 * 64 * (tile + 8) + tile * 72));
            assert_eq!((dkv.grid.0, dq.grid.0), (3, 3));
        }
        assert!(mma_backward_launches(Dims { hd: 256, ..gpt2() }).is_err());
    }

    fn entry(op: Op) -> OpEntry {
        OpEntry {
            name: "h.0.attn".into(),
            phase: Phase::Backward,
            op,
            flops: 0,
            params: None,
            grads: None,
            micro: 0,
            frozen: false,
        }
    }

    #[test]
    fn the_scratch_holds_the_backward_row_sums() {
        for d in [gpt2(), llama3_8b()] {
            let op = Op::AttentionBackward {
                dqkv: BufId(0),
                positions: None,
                dout: BufId(1),
                qkv: BufId(2),
                out: BufId(3),
                lse: BufId(4),
                ws: BufId(5),
                rows: Rows { b: d.b, t: d.t },
                nh: d.nh,
                nkv: d.nkv,
                hd: d.hd,
                window: None,
                scale_dim: d.hd as f32,
            };
            let s = Scratch::for_ops(&[entry(op)], DType::Bf16);
            assert_eq!(s.attention_rows, d.d_bytes());
            // Generation's shorter sequence needs less.
            assert!(Dims { t: d.t / 2, ..d }.d_bytes() <= s.attention_rows);
        }
    }
}
