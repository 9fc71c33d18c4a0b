//! The CPU backend: [`Cpu`] answers the planner's sizing questions, and [`CpuDevice`] holds a
//! started plan (the host arena, the worker pool) and runs its ops (`ops`), its transfers
//! (on the disk tier's I/O thread) and its collectives (`collective`: on its communication
//! thread).

use super::attention::attention_workspace_len;
use super::caches::l2_bytes;
use super::collective::{Collectives, Job};
use super::features::{cpu_has_bf16_dot, f16_conversions_available};
use super::gemm::f32::{own_pack_bytes_per_thread, packing_bytes};
use super::gemm::mixed::{compute_path, gemm_mixed_workspace_len};
use crate::backend::{Backend, CommSpan, CommTime, Device, IoSpan, IoTime, Kernels, StepCtx};
use crate::dist::Comms;
use crate::dtype::{DType, Elem};
use crate::ir::MomentsMut;
use crate::ir::Sizing;
use crate::ir::schedule::OptimBufs;
use crate::ir::schedule::{ImplicitBufs, OpEntry, WeightLayout};
use crate::ir::{BufId, Buffer, Op, OptimState, Program, Tier};
use crate::mem::arena::Arena;
use crate::mem::disk::{DiskTier, IoThread, Ticket};
use anyhow::{Context, Result, bail};
use half::{bf16, f16};

/// The CPU backend: kernels on a pool of the plan's `threads` workers, one host arena.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Sizing for Cpu {
    fn attention_workspace_elems(
        &self,
        storage: DType,
        t: usize,
        hs: usize,
        window: Option<usize>,
        threads: usize,
    ) -> usize {
        match storage {
            DType::Bf16 => attention_workspace_len::<bf16>(t, hs, window, threads),
            DType::F16 => attention_workspace_len::<f16>(t, hs, window, threads),
            _ => attention_workspace_len::<f32>(t, hs, window, threads),
        }
    }

    fn mixed_gemm_workspace_elems(&self) -> usize {
        gemm_mixed_workspace_len()
    }

    fn quantized_gemm_workspace_elems(&self, cols: usize) -> usize {
        super::gemm::quantized::workspace_len(cols)
    }

    /// The packing scratch the `gemm` crate allocates for itself: the largest packed panel
    /// of any call (executor calls are serial, and attention's per-worker calls pack panels
    /// of T × hs, far smaller), plus one L2-sized slab per thread (main thread included). The
    /// L2 size is read from sysfs as `gemm` does. Where the f32 GEMM is memwall's own AVX2
    /// kernel, each thread also keeps its packing buffers ([`own_pack_bytes_per_thread`]).
    fn library_scratch_bytes(&self, ops: &[OpEntry], _storage: DType, threads: usize) -> u64 {
        let panel = ops
            .iter()
            .map(|e| gemm_panel_bytes(&e.op))
            .max()
            .unwrap_or(0);
        panel + (threads as u64 + 1) * (l2_bytes() + own_pack_bytes_per_thread())
    }

    fn compute_note(&self, storage: DType) -> Option<String> {
        (storage != DType::F32).then(|| {
            format!(
                "{} (this CPU {} AVX512_BF16)",
                compute_path(storage == DType::Bf16),
                if cpu_has_bf16_dot() { "has" } else { "lacks" }
            )
        })
    }
}

impl Backend for Cpu {
    fn start(&self, program: &Program, comms: Comms) -> Result<Box<dyn Device>> {
        Ok(Box::new(CpuDevice::new(program, comms)?))
    }

    fn measure_peak(&self) -> Option<crate::backend::Peak> {
        super::peak::measure(5, 0.02)
    }

    fn processor(&self) -> String {
        crate::util::machine::cpu_name()
    }

    fn bench_facts(&self, storage: DType) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert(
            "mixed_compute".into(),
            compute_path(storage == DType::Bf16).into(),
        );
        m.insert("cpu_has_avx512_bf16".into(), cpu_has_bf16_dot().into());
        m
    }
}

/// The largest packing panel the GEMMs of `op` make `gemm` allocate
/// ([`packing_bytes`] of each call's rows and depth).
fn gemm_panel_bytes(op: &Op) -> u64 {
    match op {
        Op::Matmul { rows, ic, .. } => packing_bytes(rows.n(), *ic),
        // dinp = dout @ wᵀ (n rows, depth oc); dw += inpᵀ @ dout (ic rows, depth n), or
        // for an `[OC, IC]` weight dw += doutᵀ @ inp (oc rows, depth n).
        Op::MatmulBackward {
            rows,
            ic,
            oc,
            layout,
            ..
        } => {
            let dw_rows = match layout {
                WeightLayout::InOut => *ic,
                WeightLayout::OutIn => *oc,
            };
            packing_bytes(rows.n(), *oc).max(packing_bytes(dw_rows, rows.n()))
        }
        // logits = x @ wteᵀ, dx = dlogits @ wte, dwte += dlogitsᵀ @ x, per chunk of r rows.
        Op::LmHeadLoss {
            rows_per_chunk,
            c,
            v,
            ..
        } => {
            let r = *rows_per_chunk;
            packing_bytes(r, *c)
                .max(packing_bytes(r, *v))
                .max(packing_bytes(*v, r))
        }
        // logits = x @ wᵀ and dw += dlogitsᵀ @ x, per chunk of r rows, over v words.
        Op::LmHeadWeightGrad {
            rows_per_chunk,
            c,
            v,
            ..
        } => {
            let r = *rows_per_chunk;
            packing_bytes(r, *c).max(packing_bytes(*v, r))
        }
        Op::LmHeadLast { c, .. } => packing_bytes(1, *c),
        _ => 0,
    }
}

/// The pool of `threads` compute workers a device runs its kernels on.
fn worker_pool(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("memwall-worker-{i}"))
        .build()
        .map_err(|e| {
            let what = format!("the {threads} compute threads");
            crate::util::threads::refused(&what, e)
        })
}

/// A plan started on the CPU: its host arena, its buffers' placements and the worker pool.
pub struct CpuDevice {
    /// The disk tier's file and its I/O thread (plans with `--offload`). Declared first so
    /// that it is dropped first: its transfers in flight finish while the arena still exists.
    io: Option<IoThread>,
    /// The collectives among the ranks, and their thread (dropped before the arena too).
    collectives: Collectives,
    /// Transfers in flight, by their host staging buffer.
    pending: std::sync::Mutex<Vec<(BufId, Ticket)>>,
    /// Nanoseconds ops waited for transfers.
    stall_ns: std::sync::atomic::AtomicU64,
    arena: Arena,
    pool: rayon::ThreadPool,
    buffers: Vec<Buffer>,
    /// Element type of activations and gradients (f32, bf16 or f16).
    storage: DType,
    /// The arena's largest byte range no persistent buffer holds (host copies of disk-tier
    /// buffers go there between steps).
    free_between_steps: (u64, u64),
    pub(super) state: ImplicitBufs,
}

impl CpuDevice {
    fn new(program: &Program, comms: Comms) -> Result<CpuDevice> {
        let storage = program.storage;
        if storage == DType::F16 && !f16_conversions_available() {
            bail!(
                "--precision fp16: this CPU has no F16C half-precision conversions, so fp16 storage would be converted in software, far slower than fp32; use --precision bf16"
            );
        }
        crate::util::malloc::keep_library_scratch_resident();
        let pool = worker_pool(program.threads)?;
        let io = match (program.tier_bytes(Tier::Nvme), program.disk_dir) {
            (0, _) => None,
            (bytes, Some(dir)) => {
                // Room to time one step's transfers (the executor takes them after each run).
                let per_step = program.schedule.ops.iter();
                let per_step = per_step.filter(|e| matches!(e.op, Op::Transfer { .. }));
                let disk = DiskTier::create(dir, &program.disk_file(), bytes)?;
                Some(IoThread::new(disk, per_step.count())?)
            }
            (_, None) => bail!("--offload needs --offload-dir (a directory on a local disk)"),
        };
        let arena = pool.install(|| Arena::new(program.tiers[0].bytes))?;
        let ops = program.schedule.ops.iter();
        let collectives = ops.filter(|e| e.op.collective_buf().is_some()).count();
        Ok(CpuDevice {
            io,
            collectives: Collectives::new(comms, program.cuts, collectives),
            pending: Default::default(),
            stall_ns: Default::default(),
            arena,
            pool,
            buffers: program.buffers.to_vec(),
            storage,
            free_between_steps: free_between_steps(program.buffers, program.tiers[0].bytes),
            state: program.schedule.implicit.clone(),
        })
    }

    /// The host's half of a plan started on a GPU: the updates whose whole state is in
    /// pinned host RAM ([`OpEntry::runs_on_host`]) run here, with the CPU's own kernels on
    /// `program.threads` workers, over `pinned` (the GPU's pinned tier, borrowed: the plan's
    /// `Host` buffers are at their offsets in it). Nothing else of the plan runs here.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(in crate::backend) fn beneath_gpu(
        program: &Program,
        pinned: Arena,
        comms: Comms,
    ) -> Result<CpuDevice> {
        Ok(CpuDevice {
            io: None,
            collectives: Collectives::new(comms, program.cuts, 0),
            pending: Default::default(),
            stall_ns: Default::default(),
            arena: pinned,
            pool: worker_pool(program.threads)?,
            buffers: program.buffers.to_vec(),
            storage: program.storage,
            free_between_steps: (0, 0),
            state: program.schedule.implicit.clone(),
        })
    }

    /// The whole arena, `bytes` of it (tests).
    #[cfg(test)]
    #[allow(clippy::mut_from_ref)]
    fn padded_all(&self, bytes: u64) -> &mut [u8] {
        // SAFETY: tests only, with no op running.
        unsafe { self.arena.view_mut::<u8>(0, bytes as usize) }
    }

    /// The plan's buffers, with their tiers and offsets.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(in crate::backend) fn buffers(&self) -> &[Buffer] {
        &self.buffers
    }

    /// The disk tier's I/O thread (plans with a disk tier only).
    fn io(&self) -> &IoThread {
        self.io
            .as_ref()
            .expect("a plan with a disk tier has its file")
    }

    fn disk(&self) -> &DiskTier {
        self.io().disk()
    }

    /// Starts copying buffer `from` into `to`, one on the disk tier and the other in the
    /// arena (both padded to the I/O alignment by the plan, so the whole padded extent moves).
    fn start_transfer(&self, from: BufId, to: BufId) {
        let (f, t) = (&self.buffers[from.0], &self.buffers[to.0]);
        assert_eq!(
            f.bytes, t.bytes,
            "transfer {} -> {}: sizes differ",
            f.name, t.name
        );
        // SAFETY: the plan keeps the staging buffer live, and touched by no other op, from
        // this op to the `AwaitTransfers` that names it (its interval spans both, and
        // packing gives no other buffer live in between its bytes).
        let (host, ticket) = unsafe {
            match (f.placement.tier, t.placement.tier) {
                (Tier::Nvme, Tier::Host) => (
                    to,
                    self.io().read(f.placement.offset, self.padded(to), to.0),
                ),
                (Tier::Host, Tier::Nvme) => (
                    from,
                    self.io()
                        .write(t.placement.offset, self.padded(from), from.0),
                ),
                (a, b) => panic!(
                    "internal error: transfer {} ({a:?}) -> {} ({b:?})",
                    f.name, t.name
                ),
            }
        };
        self.pending
            .lock()
            .expect("not poisoned")
            .push((host, ticket));
    }

    /// Waits for the transfers in flight into or out of `bufs`; the first error, if any.
    fn await_transfers(&self, bufs: &[BufId]) -> Result<()> {
        self.await_transfers_where(|b| bufs.contains(&b))
    }

    /// Waits for the transfers in flight whose host buffer is `mine`; the first error.
    fn await_transfers_where(&self, mine: impl Fn(BufId) -> bool) -> Result<()> {
        let mine: Vec<Ticket> = {
            let mut pending = self.pending.lock().expect("not poisoned");
            let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut *pending)
                .into_iter()
                .partition(|(b, _)| mine(*b));
            *pending = rest;
            mine.into_iter().map(|(_, t)| t).collect()
        };
        let t0 = std::time::Instant::now();
        let mut first = Ok(());
        for t in mine {
            let r = t.wait();
            if first.is_ok() {
                first = r;
            }
        }
        let waited = t0.elapsed().as_nanos() as u64;
        self.stall_ns
            .fetch_add(waited, std::sync::atomic::Ordering::Relaxed);
        first
    }

    // SAFETY (all views): offsets and sizes come from the verified plan; an op's written
    // buffers never overlap the other buffers it touches (`OpEntry::buffers`, checked by
    // plan::build::verify_ops), and the persistent buffers (params, moments) are distinct
    // buffers in the arena, and each op's gradient buffers are among the buffers it touches.

    /// Buffer `id`, which must be in the arena.
    fn in_arena(&self, id: BufId) -> &Buffer {
        let b = &self.buffers[id.0];
        assert_eq!(
            b.placement.tier,
            Tier::Host,
            "buffer {} is not in the arena",
            b.name
        );
        b
    }

    /// How buffer `id` stores its elements (f32, ..., or ggml blocks).
    pub(super) fn dtype(&self, id: BufId) -> DType {
        self.buffers[id.0].dtype
    }

    /// A view of buffer `id` as elements of `T`, whose dtype must be `dtype`.
    #[allow(clippy::mut_from_ref)]
    fn typed<T>(&self, id: BufId, dtype: DType) -> &mut [T] {
        let b = self.in_arena(id);
        assert_eq!(b.dtype, dtype, "buffer {} viewed as {dtype:?}", b.name);
        debug_assert_eq!(Some(std::mem::size_of::<T>()), dtype.size());
        unsafe { self.arena.view_mut::<T>(b.placement.offset, b.elems) }
    }

    /// The bytes of buffer `id`.
    #[allow(clippy::mut_from_ref)]
    pub(super) fn bytes(&self, id: BufId) -> &mut [u8] {
        let n = self.in_arena(id).bytes as usize;
        &mut self.padded(id)[..n]
    }

    /// The bytes of buffer `id` with its padding to its alignment (what a transfer moves).
    #[allow(clippy::mut_from_ref)]
    fn padded(&self, id: BufId) -> &mut [u8] {
        let b = self.in_arena(id);
        // SAFETY: as for every view; packing reserves the padding for the buffer, and u8
        // has no alignment or validity requirement.
        unsafe {
            self.arena
                .view_mut::<u8>(b.placement.offset, b.padded_bytes() as usize)
        }
    }

    #[allow(clippy::mut_from_ref)]
    pub(super) fn u32_mut(&self, id: BufId) -> &mut [u32] {
        self.typed(id, DType::U32)
    }

    /// A view of the f64 buffer `id` (step scalars).
    #[allow(clippy::mut_from_ref)]
    pub(super) fn f64_mut(&self, id: BufId) -> &mut [f64] {
        self.typed(id, DType::F64)
    }

    /// A view of buffer `id` as elements of `T` (whose dtype it must have).
    #[allow(clippy::mut_from_ref)]
    pub(super) fn view<T: Elem>(&self, id: BufId) -> &mut [T] {
        let dtype = match T::NAME {
            "f32" => DType::F32,
            "bf16" => DType::Bf16,
            "f16" => DType::F16,
            other => unreachable!("element type {other}"),
        };
        self.typed(id, dtype)
    }

    /// Zeroes a buffer of any dtype (all-zero bits are 0 in every element type).
    pub(super) fn zero(&self, id: BufId) {
        use rayon::prelude::*;
        self.bytes(id)
            .par_chunks_mut(1 << 18)
            .for_each(|c| c.fill(0));
    }

    /// The AdamW moments `o` (the whole model's or a group's staging copy) in their format.
    pub(super) fn moments_view(&self, o: &OptimBufs) -> MomentsMut<'_> {
        match o.format {
            OptimState::F32 => MomentsMut::F32 {
                m: self.typed(o.m, DType::F32),
                v: self.typed(o.v, DType::F32),
            },
            OptimState::Bf16 => MomentsMut::Bf16 {
                m: self.typed(o.m, DType::Bf16),
                v: self.typed(o.v, DType::Bf16),
            },
            OptimState::Int8 => MomentsMut::Int8 {
                m: self.typed(o.m, DType::I8),
                m_absmax: self.typed(o.m_scale.expect("int8 scales"), DType::F32),
                v: self.typed(o.v, DType::U8),
                v_absmax: self.typed(o.v_scale.expect("int8 scales"), DType::F32),
            },
        }
    }

    /// Host copies of the disk-tier buffers among `bufs`, read whole, by position in `bufs`.
    /// They go in the arena's bytes that no persistent buffer holds (between steps nothing
    /// else is live, and `download`/`upload` are only called between steps), so reading
    /// offloaded state costs no memory outside the plan; where they do not fit there, in
    /// fresh page-aligned scratch.
    fn read_disk_buffers(&self, bufs: &[BufId]) -> Result<Vec<Option<HostCopy>>> {
        let (mut at, end) = self.free_between_steps;
        bufs.iter()
            .map(|&id| {
                let b = &self.buffers[id.0];
                if b.placement.tier != Tier::Nvme {
                    return Ok(None);
                }
                let len = b.padded_bytes();
                let start = at.next_multiple_of(crate::ir::IO_ALIGN);
                let copy = if start + len <= end {
                    at = start + len;
                    HostCopy::InArena(start)
                } else {
                    let scratch =
                        Arena::new(len).with_context(|| format!("a host copy of {}", b.name))?;
                    HostCopy::Scratch(scratch)
                };
                self.disk()
                    .read(b.placement.offset, self.copy_bytes(&copy, len))?;
                Ok(Some(copy))
            })
            .collect()
    }

    /// The `len` bytes of a host copy.
    #[allow(clippy::mut_from_ref)]
    fn copy_bytes<'a>(&'a self, copy: &'a HostCopy, len: u64) -> &'a mut [u8] {
        // SAFETY: an arena copy lies in bytes no persistent buffer holds, disjoint from the
        // other copies of the same call; scratch is exclusively the copy's.
        unsafe {
            match copy {
                HostCopy::InArena(offset) => self.arena.view_mut::<u8>(*offset, len as usize),
                HostCopy::Scratch(a) => a.view_mut::<u8>(0, len as usize),
            }
        }
    }

    /// Byte views of `bufs`: arena buffers in place, disk-tier buffers in their `copies`.
    #[allow(clippy::mut_from_ref)]
    fn views<'a>(&'a self, bufs: &[BufId], copies: &'a [Option<HostCopy>]) -> Vec<&'a mut [u8]> {
        for (i, a) in bufs.iter().enumerate() {
            assert!(!bufs[..i].contains(a), "buffer listed twice");
        }
        bufs.iter()
            .zip(copies)
            .map(|(&id, copy)| match copy {
                Some(c) => &mut self.copy_bytes(c, self.buffers[id.0].padded_bytes())
                    [..self.buffers[id.0].bytes as usize],
                None => self.bytes(id),
            })
            .collect()
    }
}

/// Where a disk-tier buffer's bytes are read to for the host ([`CpuDevice::download`],
/// [`CpuDevice::upload`]).
enum HostCopy {
    /// At this offset of the arena, in bytes no persistent buffer holds.
    InArena(u64),
    /// In scratch of its own (it did not fit in the arena's free bytes).
    Scratch(Arena),
}

/// The largest byte range of an arena of `arena_bytes` that no persistent host buffer of
/// `buffers` holds: free between steps.
fn free_between_steps(buffers: &[Buffer], arena_bytes: u64) -> (u64, u64) {
    let mut held: Vec<(u64, u64)> = buffers
        .iter()
        .filter(|b| b.persistent && b.placement.tier == Tier::Host)
        .map(|b| (b.placement.offset, b.placement.offset + b.padded_bytes()))
        .collect();
    held.sort_unstable();
    let (mut best, mut at) = ((0, 0), 0);
    for (start, end) in held.into_iter().chain([(arena_bytes, arena_bytes)]) {
        if start > at && start - at > best.1 - best.0 {
            best = (at, start);
        }
        at = at.max(end);
    }
    best
}

impl CpuDevice {
    /// Starts collective `op` on its buffers, elements of `T`.
    fn start_collective<T: Elem + crate::dist::Summable>(&self, op: &Op) -> Result<()> {
        let job = Job::new(op, |id| self.view::<T>(id));
        // SAFETY: the plan keeps a collective's buffers live, and touched by no other op,
        // from its op to its `AwaitCollective` (plan::build::verify_collectives), and
        // `Device::sync` waits for whatever a run leaves in flight.
        unsafe { self.collectives.start(job, &self.buffers) }
    }
}

impl Device for CpuDevice {
    fn run(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        match &e.op {
            Op::Transfer { from, to } => {
                self.start_transfer(*from, *to);
                return Ok(());
            }
            Op::AwaitTransfers { bufs } => {
                self.await_transfers(bufs)?;
                return Ok(());
            }
            Op::AllReduce { .. }
            | Op::ReduceScatter { .. }
            | Op::AllGather { .. }
            | Op::StageSend { .. }
            | Op::StageRecv { .. } => {
                let buf = e.op.collective_buf().expect("a collective");
                match self.buffers[buf.0].dtype {
                    DType::Bf16 => self.start_collective::<bf16>(&e.op)?,
                    DType::F16 => self.start_collective::<f16>(&e.op)?,
                    DType::F32 => self.start_collective::<f32>(&e.op)?,
                    other => bail!("internal error: a collective over {other:?} elements"),
                }
                return Ok(());
            }
            Op::AwaitCollective { bufs } => {
                self.collectives.wait(Some(bufs[0]), &self.buffers)?;
                return Ok(());
            }
            _ => {}
        }
        match self.storage {
            DType::Bf16 => self.run_by_family::<bf16>(e, ctx),
            DType::F16 => self.run_by_family::<f16>(e, ctx),
            _ => self.run_by_family::<f32>(e, ctx),
        }
        Ok(())
    }

    /// Runs `f` on the pool's first worker, always the same thread. The `gemm` crate
    /// allocates its packing scratch in the thread that calls it, and glibc keeps what a
    /// thread frees in that thread's own arena: with `install`, which hands `f` to whichever
    /// worker is free, steps that landed on two workers kept the scratch resident in two
    /// arenas, where the plan counts it once.
    fn scope(&self, f: &mut (dyn FnMut() + Send)) {
        let f = std::sync::Mutex::new(f);
        self.pool.broadcast(|ctx| {
            if ctx.index() == 0 {
                (f.lock().expect("the step panicked"))()
            }
        });
    }

    unsafe fn spare_between_steps(&self, bytes: usize) -> Option<&mut [u8]> {
        let (at, end) = self.free_between_steps;
        let start = at.next_multiple_of(8);
        // SAFETY: bytes no persistent buffer holds, so nothing is in them between steps; the
        // caller holds one such slice at a time and runs no op meanwhile.
        (start + bytes as u64 <= end).then(|| unsafe { self.arena.view_mut::<u8>(start, bytes) })
    }

    fn sync(&self) -> Result<()> {
        let collectives = self.collectives.wait(None, &self.buffers);
        let idle = self.pending.lock().expect("not poisoned").is_empty();
        let transfers = match idle {
            true => Ok(()),
            false => self.await_transfers_where(|_| true),
        };
        collectives.and(transfers)
    }

    fn overlap_collectives(&mut self, on: bool) {
        self.collectives.set_overlap(on);
    }

    fn download(&self, bufs: &[BufId], f: &mut dyn FnMut(&[&[u8]])) -> Result<()> {
        let copies = self.read_disk_buffers(bufs)?;
        let views: Vec<&[u8]> = self.views(bufs, &copies).into_iter().map(|b| &*b).collect();
        f(&views);
        Ok(())
    }

    fn offload_note(&self) -> Option<String> {
        let disk = self.io.as_ref()?.disk();
        (!disk.direct).then(|| {
            format!(
                "offload: the file system of {} refused O_DIRECT; using buffered I/O and dropping the page cache after each transfer",
                disk.path().display()
            )
        })
    }

    fn io_time(&self) -> IoTime {
        IoTime {
            busy_s: self.io.as_ref().map_or(0.0, |io| io.busy_s()),
            stall_s: self.stall_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    fn comm_time(&self) -> CommTime {
        self.collectives.time()
    }

    fn take_comm_spans(&self, out: &mut Vec<CommSpan>) -> u64 {
        self.collectives.take_spans(out)
    }

    fn take_io_spans(&self, out: &mut Vec<IoSpan>) -> u64 {
        let Some(io) = &self.io else { return 0 };
        let mut no_room = 0;
        let not_logged = io.take_timed(&mut |t| {
            if out.len() < out.capacity() {
                out.push(IoSpan {
                    buf: BufId(t.tag),
                    read: t.read,
                    bytes: t.bytes,
                    start: t.start,
                    end: t.end,
                });
            } else {
                no_room += 1;
            }
        });
        not_logged + no_room
    }

    fn upload(&mut self, bufs: &[BufId], f: &mut dyn FnMut(&mut [&mut [u8]])) -> Result<()> {
        let copies = self.read_disk_buffers(bufs)?;
        f(&mut self.views(bufs, &copies));
        for (&id, copy) in bufs.iter().zip(&copies) {
            if let Some(c) = copy {
                let b = &self.buffers[id.0];
                self.disk()
                    .write(b.placement.offset, self.copy_bytes(c, b.padded_bytes()))?;
            }
        }
        Ok(())
    }
}

/// Two disjoint mutable sub-slices of one buffer.
pub(super) fn two_ranges<T>(
    buf: &mut [T],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&mut [T], &mut [T]) {
    assert!(
        a.end <= b.start || b.end <= a.start,
        "overlapping parameter ranges"
    );
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        let bl = b.end - b.start;
        (&mut hi[..a.end - a.start], &mut lo[b.start..b.start + bl])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{AdamWStep, DeviceKind};
    use crate::dist::{Comms, Single};
    use crate::model::ModelSpec;
    use crate::plan::{Mode, OffloadSet, StepConfig, build_plan};
    use std::sync::Arc;

    /// The host's half of a GPU plan whose updates have their state in pinned RAM: over an
    /// arena laid out as the pinned tier, each update on the host changes its group's master
    /// weights and moments in place exactly as the CPU's AdamW does on copies of them, and
    /// touches no other byte of the tier.
    #[test]
    fn the_updates_beneath_a_gpu_run_on_the_pinned_tier_in_place() {
        let spec = ModelSpec::preset("llama-tiny").unwrap();
        let mut cfg = StepConfig::new(2, 32, 2);
        cfg.offload.set = OffloadSet::ALL;
        cfg.precision = crate::ir::Precision::Bf16;
        let plan = build_plan(&spec, &cfg, Mode::Train, DeviceKind::Cuda.sizing()).unwrap();
        let program = plan.program();
        let bytes = program.tier_bytes(Tier::Host);
        let world: Arc<dyn crate::dist::Comm> = Arc::new(Single);
        let comms = Comms::new(world, &plan.cfg.mesh).unwrap();
        let host = CpuDevice::beneath_gpu(&program, Arena::new(bytes).unwrap(), comms).unwrap();
        // Every byte of the tier set to something distinct (finite as f32 and bf16).
        let all = host.padded_all(bytes);
        for (i, b) in all.iter_mut().enumerate() {
            *b = [0x3c, 0x3d, 0x3e, 0x3f][i % 4] ^ ((i / 4) % 7) as u8;
        }
        let before = all.to_vec();
        let step = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 3,
            grad_scale: 0.5,
        };
        let ctx = StepCtx {
            seq: None,
            training: true,
            loss_scale: 1.0,
            update: Some(step),
            dropout_seed: 0,
            first_micro: 0,
            loss_tokens: 1,
        };
        let on_host = |e: &&OpEntry| e.runs_on_host(&plan.buffers, Tier::Device);
        let updates: Vec<&OpEntry> = plan.schedule.ops.iter().filter(on_host).collect();
        assert!(!updates.is_empty());
        let mut want = before.clone();
        let mut changed = vec![false; before.len()];
        for e in &updates {
            let Op::AdamW { tensors, state, .. } = &e.op else {
                unreachable!()
            };
            let (p, g) = (e.params.unwrap(), e.grads.unwrap());
            let at = |id: BufId| plan.buffer(id).placement.offset as usize;
            for t in tensors {
                let f32s = |buf: BufId, base: usize| {
                    let o = at(buf) + 4 * (t.range.start - base);
                    o..o + 4 * t.range.len()
                };
                let (pr, mr, vr) = (
                    f32s(p.buf, p.base),
                    f32s(state.m, state.base),
                    f32s(state.v, state.base),
                );
                let go = at(g.buf) + 2 * (t.range.start - g.base);
                let grads: Vec<half::bf16> = want[go..go + 2 * t.range.len()]
                    .chunks(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                    .collect();
                let read = |r: &std::ops::Range<usize>, w: &[u8]| -> Vec<f32> {
                    w[r.clone()]
                        .chunks(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect()
                };
                let (mut pv, mut mv, mut vv) =
                    (read(&pr, &want), read(&mr, &want), read(&vr, &want));
                let hp = AdamWStep {
                    weight_decay: if t.decay { step.weight_decay } else { 0.0 },
                    ..step
                };
                super::super::adamw::adamw_update(&mut pv, &grads, &mut mv, &mut vv, &hp);
                for (r, v) in [(pr, pv), (mr, mv), (vr, vv)] {
                    let out: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    want[r.clone()].copy_from_slice(&out);
                    changed[r].fill(true);
                }
            }
            host.run(e, &ctx).unwrap();
        }
        let got = host.padded_all(bytes);
        assert!(changed.iter().any(|&c| c));
        for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a, b,
                "byte {i} of the pinned tier (changed by an update: {})",
                changed[i]
            );
        }
    }
}
