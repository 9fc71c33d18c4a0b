//! The opened GPU ([`Gpu`], the backend for `--device cuda:N`) and a plan started on it
//! ([`GpuDevice`]). Opening probes the driver before cudarc touches it, so a machine without
//! a driver or a GPU gets an error naming the device (exit 2), never a panic. Starting
//! allocates each tier the plan packs once (the GPU's memory: one `cuMemAlloc`, zeroed, the
//! plan's buffers views of it at their offsets) and loads every kernel source, compiled by
//! NVRTC for the card (cached on disk). One stream runs the ops in schedule order; the host
//! reads and writes plan buffers only through `download` and `upload`, after the stream's
//! work.
//!
//! Ops run by family (`ops/`, one file each, as the CPU's), launching the kernels of
//! `kernels/*.cu` through `launch`; a family not wired yet refuses its ops by name.

use super::flag::flag;
use super::kernels::SOURCES;
use super::nvrtc::{self, Arch};
use super::rope_tables::{RopeTables, prepare_rope};
use super::sizing::CudaSizing;
use super::sizing::{SCRATCH_ALIGN, Scratch};
use super::transfer::{Copies, Copy, Pinned};
use crate::backend::cpu::CpuDevice;
use crate::backend::{Backend, Device, Peak, StepCtx, Unavailable};
use crate::dist::Comms;
use crate::dtype::DType;
use crate::ir::schedule::{Op, OpEntry};
use crate::ir::{BufId, OpFamily, Program, Sizing, Tier};
use anyhow::{Result, anyhow, bail};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, result as dr, sys as ds};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One GPU, opened: its context and what the planner and reports want to know of it.
pub struct Gpu {
    /// Its number among the machine's GPUs.
    index: usize,
    ctx: Arc<CudaContext>,
    name: String,
    arch: Arch,
    total_bytes: u64,
    /// Device memory in use right after the context was made (total − free then): the
    /// context's share, and other processes'; what the plan's baseline estimates
    /// ([`super::sizing::CONTEXT_BYTES`]).
    used_at_open: u64,
}

/// The GPUs this process opened, each once.
static OPENED: Mutex<Vec<&'static Gpu>> = Mutex::new(Vec::new());

/// Opens GPU `index` once per process (later calls get the same one).
pub fn open(index: usize) -> Result<&'static dyn Backend> {
    let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(g) = opened.iter().find(|g| g.index == index) {
        return Ok(*g);
    }
    let gpu: &'static Gpu = Box::leak(Box::new(Gpu::open(index)?));
    opened.push(gpu);
    Ok(gpu)
}

impl Gpu {
    fn open(index: usize) -> Result<Gpu> {
        let id = flag(index);
        let unavailable = |why: String| anyhow!(Unavailable(format!("--device {id}: {why}")));
        // SAFETY: only loads the library (dlopen) and drops it.
        if !unsafe { ds::is_culib_present() } {
            return Err(unavailable(
                "no NVIDIA driver on this machine (libcuda.so.1 could not be loaded); \
                 `memwall plan --device cuda` needs none"
                    .into(),
            ));
        }
        dr::init().map_err(|e| unavailable(format!("the NVIDIA driver did not start ({e:?})")))?;
        let count = CudaContext::device_count()
            .map_err(|e| unavailable(format!("cannot count the GPUs ({e:?})")))?
            .max(0) as usize;
        if count == 0 {
            return Err(unavailable("the driver sees no GPU on this machine".into()));
        }
        if index >= count {
            return Err(unavailable(format!(
                "this machine has {count} GPU{}: cuda:0{}",
                if count == 1 { "" } else { "s" },
                if count > 1 {
                    format!(" to cuda:{}", count - 1)
                } else {
                    String::new()
                }
            )));
        }
        let ctx = CudaContext::new(index)
            .map_err(|e| unavailable(format!("cannot create a CUDA context ({e:?})")))?;
        // The plan orders every access to its buffers: no event per allocation.
        // SAFETY: called before any allocation or stream of this context.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "an NVIDIA GPU".into());
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| unavailable(format!("cannot read its compute capability ({e:?})")))?;
        let total_bytes = ctx.total_mem().map(|b| b as u64).unwrap_or(0);
        let used_at_open = ctx
            .mem_get_info()
            .map(|(free, total)| (total - free) as u64)
            .unwrap_or(0);
        Ok(Gpu {
            index,
            ctx,
            name,
            arch: Arch {
                major: major as u32,
                minor: minor as u32,
            },
            total_bytes,
            used_at_open,
        })
    }
}

impl Sizing for Gpu {
    fn attention_workspace_elems(
        &self,
        s: DType,
        t: usize,
        hs: usize,
        window: Option<usize>,
        threads: usize,
    ) -> usize {
        CudaSizing.attention_workspace_elems(s, t, hs, window, threads)
    }
    fn mixed_gemm_workspace_elems(&self) -> usize {
        CudaSizing.mixed_gemm_workspace_elems()
    }
    fn quantized_gemm_workspace_elems(&self, cols: usize) -> usize {
        CudaSizing.quantized_gemm_workspace_elems(cols)
    }
    fn library_scratch_bytes(&self, ops: &[OpEntry], storage: DType, threads: usize) -> u64 {
        CudaSizing.library_scratch_bytes(ops, storage, threads)
    }
    fn scratch_bytes(&self, ops: &[OpEntry], storage: DType) -> u64 {
        CudaSizing.scratch_bytes(ops, storage)
    }
    fn compute_note(&self, storage: DType) -> Option<String> {
        CudaSizing
            .compute_note(storage)
            .map(|n| format!("{n} ({}, {})", self.name, self.arch))
    }
    fn tiers(&self) -> &'static [Tier] {
        CudaSizing.tiers()
    }
    fn baseline_bytes(&self) -> Option<u64> {
        CudaSizing.baseline_bytes()
    }
}

impl Backend for Gpu {
    fn start(&self, program: &Program, comms: Comms) -> Result<Box<dyn Device>> {
        if comms.world.size() > 1 {
            bail!(
                "--device {}: ranks on GPUs need NCCL, which the CUDA backend does not have yet; \
                 run one process",
                flag(self.index)
            );
        }
        Ok(Box::new(GpuDevice::new(self, program, comms)?))
    }

    /// The GPU's ceiling is not measured yet (a cuBLASLt GEMM's rate will be).
    fn measure_peak(&self) -> Option<Peak> {
        None
    }

    fn measure_bus(&self) -> Result<Option<(f64, f64)>> {
        super::transfer::measure_bus(&self.ctx).map(Some)
    }

    fn processor(&self) -> String {
        self.name.clone()
    }

    fn bench_facts(&self, _storage: DType) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("gpu".into(), self.name.clone().into());
        m.insert("gpu_arch".into(), self.arch.to_string().into());
        m.insert("gpu_memory_bytes".into(), self.total_bytes.into());
        m.insert("gpu_used_at_open_bytes".into(), self.used_at_open.into());
        m
    }
}

/// A plan started on a GPU: its tiers' allocations, every buffer's device address, the
/// loaded kernels and the stream the ops run on.
pub struct GpuDevice {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    /// The device memory the plan packs (address, bytes), freed on drop.
    tiers: Vec<(ds::CUdeviceptr, u64)>,
    /// Each buffer's device address and bytes (`None`: not in device memory: in the pinned
    /// tier, or an owned host buffer).
    bufs: Vec<Option<(ds::CUdeviceptr, u64)>>,
    /// The updates that run on the host's cores, over the pinned tier (declared before it,
    /// so dropped first): plans whose updates have their whole state there.
    host: Option<CpuDevice>,
    /// The pinned host tier, where the plan offloads to (`--offload`), and the copy stream
    /// that moves its buffers ([`super::transfer`]); each buffer's host address there.
    pinned: Option<Pinned>,
    copies: Option<Copies>,
    pinned_bufs: Vec<Option<(usize, u64)>>,
    /// Each buffer's dtype (how its bytes are laid out).
    pub(super) dtypes: Vec<DType>,
    /// Every kernel entry of every source, by name.
    pub(super) functions: HashMap<String, CudaFunction>,
    /// The plan's storage type (activations and gradients).
    pub(super) storage: DType,
    /// The backend's scratch buffer (address, bytes) and its regions.
    pub(super) scratch: Option<(ds::CUdeviceptr, u64)>,
    pub(super) scratch_layout: Scratch,
    /// The card's architecture (kernels are compiled for it).
    pub(super) arch: Arch,
    /// The Rope ops' frequency tables, copied once when the device starts.
    pub(super) rope: RopeTables,
}

// SAFETY: the device's state is its context's (thread-safe in the driver), addresses (plain
// integers) and loaded functions; ops run one at a time (`Device::run` takes `&self` but the
// executor calls it from one thread), and the stream orders the work they launch.
unsafe impl Send for GpuDevice {}
unsafe impl Sync for GpuDevice {}

impl GpuDevice {
    fn new(gpu: &Gpu, program: &Program, comms: Comms) -> Result<GpuDevice> {
        let mut comms = Some(comms);
        gpu.ctx.bind_to_thread().map_err(|e| {
            anyhow!(
                "--device {}: cannot use its context ({e:?})",
                flag(gpu.index)
            )
        })?;
        let stream = gpu.ctx.default_stream();
        let mut device = GpuDevice {
            ctx: gpu.ctx.clone(),
            stream,
            tiers: Vec::new(),
            bufs: vec![None; program.buffers.len()],
            host: None,
            pinned: None,
            copies: None,
            pinned_bufs: vec![None; program.buffers.len()],
            dtypes: program.buffers.iter().map(|b| b.dtype).collect(),
            functions: HashMap::new(),
            storage: program.storage,
            scratch: None,
            scratch_layout: Scratch::for_ops(&program.schedule.ops, program.storage),
            arch: gpu.arch,
            rope: Default::default(),
        };
        let mut bases = HashMap::new();
        for t in program.tiers {
            match t.tier {
                Tier::Device => {}
                Tier::Host if t.bytes == 0 => continue,
                Tier::Host => {
                    let stream = gpu.ctx.new_stream().map_err(|e| {
                        anyhow!(
                            "--device {}: cannot make a copy stream ({e:?})",
                            flag(gpu.index)
                        )
                    })?;
                    let pinned = Pinned::new(t.bytes)?;
                    let on_host = |e: &OpEntry| e.runs_on_host(program.buffers, Tier::Device);
                    if program.schedule.ops.iter().any(on_host) {
                        // SAFETY: `host` is declared before `pinned`, so dropped first; its
                        // updates run between their buffers' `settle` and their next copies.
                        let arena = unsafe { pinned.arena()? };
                        let comms = comms.take().expect("one pinned tier");
                        device.host = Some(CpuDevice::beneath_gpu(program, arena, comms)?);
                    }
                    device.pinned = Some(pinned);
                    device.copies = Some(Copies::new(stream));
                    continue;
                }
                other => bail!(
                    "internal error: the CUDA backend plans device memory and pinned RAM, and \
                     this plan packs {}",
                    other.describe()
                ),
            }
            let bytes = t.bytes.max(1);
            // SAFETY: a fresh allocation of `bytes`, zeroed before any use and freed on drop.
            let ptr = unsafe { dr::malloc_sync(bytes as usize) }.map_err(|e| {
                anyhow!(
                    "--device {}: cannot allocate the plan's {} of device memory ({e:?}); \
                     `memwall plan --device cuda --max-memory <the card's free memory>` tells \
                     what fits",
                    flag(gpu.index),
                    crate::util::bytes::fmt_bytes(bytes)
                )
            })?;
            device.tiers.push((ptr, bytes));
            // SAFETY: `ptr` holds `bytes`.
            unsafe { dr::memset_d8_sync(ptr, 0, bytes as usize) }
                .map_err(|e| anyhow!("zeroing device memory: {e:?}"))?;
            bases.insert(t.tier, ptr);
        }
        for (i, b) in program.buffers.iter().enumerate() {
            if let Some(&base) = bases.get(&b.placement.tier) {
                device.bufs[i] = Some((base + b.placement.offset, b.bytes));
            }
            if let (Tier::Host, Some(p)) = (b.placement.tier, &device.pinned) {
                device.pinned_bufs[i] = Some((p.at(b.placement.offset), b.bytes));
            }
        }
        // The scratch's regions from its first 256-byte boundary (cuBLASLt refuses a
        // workspace less aligned; a plan buffer is only `ALIGN`ed): `Scratch::total` holds
        // the slack.
        device.scratch = program
            .schedule
            .implicit
            .scratch
            .and_then(|id| device.bufs[id.0])
            .map(|(ptr, bytes)| {
                let at = ptr.next_multiple_of(SCRATCH_ALIGN);
                (at, bytes - (at - ptr))
            });
        device.rope = prepare_rope(program)?;
        for src in SOURCES {
            let ptx = nvrtc::cached(src, gpu.arch)?;
            let module = gpu
                .ctx
                .load_module(ptx)
                .map_err(|e| anyhow!("loading CUDA kernels {} on {}: {e:?}", src.name, gpu.arch))?;
            for name in src.entries() {
                let f = module
                    .load_function(&name)
                    .map_err(|e| anyhow!("CUDA kernel {name} of {}: {e:?}", src.name))?;
                device.functions.insert(name, f);
            }
        }
        Ok(device)
    }

    /// Makes the device's context current on the calling thread (ops, downloads and uploads
    /// may come from any of the executor's threads).
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("making the GPU's context current: {e:?}"))
    }

    /// Runs a `Transfer` (queued on the copy stream after the compute stream's work so far)
    /// or an `AwaitTransfers` (the compute stream waits for those copies): `transfer`.
    fn run_transfer(&self, e: &OpEntry) -> Result<()> {
        let copies = self
            .copies
            .as_ref()
            .ok_or_else(|| anyhow!("internal error: {}: the plan has no pinned tier", e.name))?;
        let named = |x: anyhow::Error| anyhow!("{}: {x:#}", e.name);
        match &e.op {
            Op::Transfer { from, to } => {
                let ends = (self.bufs[from.0], self.pinned_bufs[to.0]);
                let (stage, copy, bytes) = match ends {
                    (Some((src, bytes)), Some((dst, _))) => {
                        ((*from, *to), Copy::ToHost { dst, src }, bytes)
                    }
                    _ => match (self.pinned_bufs[from.0], self.bufs[to.0]) {
                        (Some((src, _)), Some((dst, bytes))) => {
                            ((*to, *from), Copy::ToDevice { dst, src }, bytes)
                        }
                        _ => bail!(
                            "internal error: {}: a transfer between device memory and pinned \
                             RAM has an end elsewhere",
                            e.name
                        ),
                    },
                };
                copies
                    .start(&self.stream, stage, copy, bytes)
                    .map_err(named)
            }
            Op::AwaitTransfers { bufs } => copies.wait(&self.stream, bufs).map_err(named),
            _ => bail!("internal error: {} is not a transfer", e.name),
        }
    }

    /// Runs `e`, an update whose whole state is in pinned RAM, on the host's cores with the
    /// CPU's kernels (`host`), once the copies into or out of its buffers are done; the GPU
    /// meanwhile works through what was queued before it.
    fn run_on_host(&self, host: &CpuDevice, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        let Op::AdamW { state, .. } = &e.op else {
            bail!(
                "internal error: {} runs on the host but is no update",
                e.name
            );
        };
        if ctx.update.is_none() {
            return Ok(()); // a skipped step
        }
        let mut homes = state.ids();
        homes.extend(e.params.map(|b| b.buf));
        homes.extend(e.grads.map(|b| b.buf));
        if let Some(c) = &self.copies {
            c.settle(&homes).map_err(|x| anyhow!("{}: {x:#}", e.name))?;
        }
        let mut result = Ok(());
        host.scope(&mut || result = host.run(e, ctx));
        result
    }

    /// Buffer `id`'s host address, when it is in the pinned tier.
    fn pinned_addr(&self, id: BufId) -> Option<usize> {
        self.pinned_bufs[id.0].map(|(at, _)| at)
    }

    /// The bytes of buffer `id`, in the pinned tier at host address `at`.
    ///
    /// # Safety
    /// Only while no copy is in flight (both streams synchronised) and no other view of the
    /// buffer lives.
    unsafe fn pinned_bytes(&self, id: BufId, at: usize) -> &[u8] {
        let bytes = self.pinned_bufs[id.0].map_or(0, |(_, n)| n);
        // SAFETY: the plan placed the buffer's `bytes` at `at` in the pinned allocation.
        unsafe { std::slice::from_raw_parts(at as *const u8, bytes as usize) }
    }

    /// [`GpuDevice::pinned_bytes`], to write.
    ///
    /// # Safety
    /// As [`GpuDevice::pinned_bytes`].
    #[allow(clippy::mut_from_ref)]
    unsafe fn pinned_bytes_mut(&self, id: BufId, at: usize) -> &mut [u8] {
        let bytes = self.pinned_bufs[id.0].map_or(0, |(_, n)| n);
        // SAFETY: as in `pinned_bytes`.
        unsafe { std::slice::from_raw_parts_mut(at as *mut u8, bytes as usize) }
    }

    /// The device address and bytes of plan buffer `id` (an internal error for one not in
    /// device memory).
    pub(super) fn addr(&self, id: BufId) -> Result<(ds::CUdeviceptr, u64)> {
        self.bufs[id.0]
            .ok_or_else(|| anyhow!("internal error: buffer {} is not in device memory", id.0))
    }
}

impl Device for GpuDevice {
    fn run(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        self.bind()?;
        if let Some(host) = &self.host
            && e.runs_on_host(host.buffers(), Tier::Device)
        {
            return self.run_on_host(host, e, ctx);
        }
        match e.op.family() {
            OpFamily::Fill => self.run_fill(e),
            OpFamily::Embedding => self.run_embedding(e, ctx),
            OpFamily::Norm => self.run_norm(e, ctx),
            OpFamily::Linear => self.run_linear(e, ctx),
            OpFamily::Attention => self.run_attention(e, ctx),
            OpFamily::Activation => self.run_activation(e, ctx),
            OpFamily::LmHead => self.run_lm_head(e, ctx),
            OpFamily::Adapter => self.run_adapter(e, ctx),
            OpFamily::Optimizer => self.run_optimizer(e, ctx),
            OpFamily::Transfer => self.run_transfer(e),
            OpFamily::Collective => bail!(
                "internal error: {}: the CUDA backend runs one process (no collectives)",
                e.name
            ),
        }
    }

    fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("waiting for the GPU: {e:?}"))?;
        if let Some(c) = &self.copies {
            c.stream.synchronize().map_err(|e| {
                anyhow!("waiting for the GPU's copies to and from pinned RAM: {e:?}")
            })?;
            c.clear();
        }
        Ok(())
    }

    fn queues_ops(&self) -> bool {
        true
    }

    fn memory_in_use(&self) -> Option<u64> {
        self.ctx
            .mem_get_info()
            .ok()
            .map(|(free, total)| (total - free) as u64)
    }

    fn scope(&self, f: &mut (dyn FnMut() + Send)) {
        // The context is current on the thread that started the device; ops issued from
        // another thread make it current there first.
        let _ = self.ctx.bind_to_thread();
        f()
    }

    fn download(&self, bufs: &[BufId], f: &mut dyn FnMut(&[&[u8]])) -> Result<()> {
        self.bind()?;
        self.sync()?;
        let mut host = Vec::with_capacity(bufs.len());
        for &id in bufs {
            if self.pinned_addr(id).is_some() {
                host.push(Vec::new());
                continue;
            }
            let (ptr, bytes) = self.addr(id)?;
            let mut v = vec![0u8; bytes as usize];
            // SAFETY: `v` holds the buffer's bytes; the stream's work is done.
            unsafe { dr::memcpy_dtoh_sync(&mut v, ptr) }
                .map_err(|e| anyhow!("copying a buffer from the GPU: {e:?}"))?;
            host.push(v);
        }
        let views: Vec<&[u8]> = bufs
            .iter()
            .zip(&host)
            .map(|(&id, v)| match self.pinned_addr(id) {
                // SAFETY: the buffer's bytes in the pinned tier; both streams are done, and
                // no op runs while the view lives.
                Some(at) => unsafe { self.pinned_bytes(id, at) },
                None => v.as_slice(),
            })
            .collect();
        f(&views);
        Ok(())
    }

    fn upload(&mut self, bufs: &[BufId], f: &mut dyn FnMut(&mut [&mut [u8]])) -> Result<()> {
        self.bind()?;
        self.sync()?;
        let mut host: Vec<Vec<u8>> = bufs
            .iter()
            .map(|&id| match self.pinned_addr(id) {
                Some(_) => Ok(Vec::new()),
                None => self.addr(id).map(|(_, bytes)| vec![0u8; bytes as usize]),
            })
            .collect::<Result<_>>()?;
        {
            let mut views: Vec<&mut [u8]> = bufs
                .iter()
                .zip(host.iter_mut())
                .map(|(&id, v)| match self.pinned_addr(id) {
                    // SAFETY: as in `download`; each buffer's bytes are its own.
                    Some(at) => unsafe { self.pinned_bytes_mut(id, at) },
                    None => v.as_mut_slice(),
                })
                .collect();
            f(&mut views);
        }
        for (&id, v) in bufs.iter().zip(&host) {
            if self.pinned_addr(id).is_some() {
                continue;
            }
            let (ptr, _) = self.addr(id)?;
            // SAFETY: the buffer holds `v.len()` bytes; the stream's work is done.
            unsafe { dr::memcpy_htod_sync(ptr, v) }
                .map_err(|e| anyhow!("copying a buffer to the GPU: {e:?}"))?;
        }
        Ok(())
    }
}

impl Drop for GpuDevice {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        if let Some(c) = &self.copies {
            let _ = c.stream.synchronize();
        }
        for &(ptr, _) in &self.tiers {
            // SAFETY: allocated by `malloc_sync` in `new`, the stream's work done.
            let _ = unsafe { dr::free_sync(ptr) };
        }
    }
}
