//! The GPU's second tier, pinned host RAM ([`Pinned`]), and the transfers between it and
//! device memory ([`Copies`]): what `--device cuda --offload X` runs.
//!
//! - The tier is one page-locked host allocation (`cuMemHostAlloc` with no flags: cached,
//!   not write-combined, since the host reads it too: checkpoints, and later the CPU's
//!   AdamW), zeroed when the plan starts; its buffers are views at their packed offsets.
//! - Transfers run on a stream of their own, in the order the plan starts them, so a read
//!   queued after a write of the same bytes sees them (as the disk tier's one I/O thread
//!   does on the CPU). A `Transfer` op first makes the copy stream wait for everything the
//!   compute stream has queued so far (an event): a write-back copies what the ops before it
//!   wrote, and a read overwrites bytes that earlier ops used for another buffer. An
//!   `AwaitTransfers` makes the compute stream wait for the copies into or out of its
//!   buffers (their events): the host never blocks, the GPU orders itself.
//! - An update whose whole state is in pinned RAM runs on the host's cores
//!   ([`crate::ir::schedule::OpEntry::runs_on_host`]): before it, the host waits for the
//!   last copy into or out of each of its buffers ([`Copies::settle`]); copies started after
//!   it are queued after it returns, so they carry what it wrote.
//! - The plan guarantees the rest (`plan::build::verify_transfers`): every transfer is
//!   awaited before its device copy is used, no op on the device touches pinned memory, and
//!   no update on the host touches a buffer while a transfer moves it.

use crate::ir::BufId;
use anyhow::{Result, anyhow};
use cudarc::driver::{CudaEvent, CudaStream, result as dr, sys as ds};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The pinned host tier: one page-locked allocation, freed on drop.
pub(super) struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

impl Pinned {
    /// `bytes` of page-locked host memory, zeroed.
    pub(super) fn new(bytes: u64) -> Result<Pinned> {
        let bytes = bytes.max(1) as usize;
        // SAFETY: a fresh allocation of `bytes` (flags 0: portable to this context only,
        // cached, not mapped), freed on drop.
        let ptr = unsafe { dr::malloc_host(bytes, 0) }.map_err(|e| {
            anyhow!(
                "cannot pin {} of host RAM for the plan's offloaded state ({e:?}); `memwall \
                 plan --device cuda --max-host-memory <free RAM>` tells what fits",
                crate::util::bytes::fmt_bytes(bytes as u64)
            )
        })? as *mut u8;
        // SAFETY: `ptr` holds `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        Ok(Pinned { ptr, bytes })
    }

    /// The tier as a host arena, for the CPU's kernels to update its buffers in place.
    ///
    /// # Safety
    /// The arena must be dropped before the tier, and its views used only where no copy
    /// moves their bytes (between a buffer's [`Copies::settle`] and its next copy).
    pub(super) unsafe fn arena(&self) -> Result<crate::mem::arena::Arena> {
        // SAFETY: `ptr` holds `bytes` (page-aligned, from cuMemHostAlloc); the caller keeps
        // the rest of the contract.
        unsafe { crate::mem::arena::Arena::borrowed(self.ptr, self.bytes) }
    }

    /// The address of byte `offset` (of a buffer the plan placed there).
    pub(super) fn at(&self, offset: u64) -> usize {
        assert!(
            offset as usize <= self.bytes,
            "offset {offset} past the pinned tier"
        );
        self.ptr as usize + offset as usize
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host` in `new`; the device synchronised both streams
        // before dropping its tiers.
        let _ = unsafe { dr::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// The copy stream and the transfers in flight on it, by their device copy; and the last
/// copy into or out of each pinned home, for the host's updates to wait for.
pub(super) struct Copies {
    pub(super) stream: Arc<CudaStream>,
    pending: Mutex<Vec<(BufId, Arc<CudaEvent>)>>,
    last_on_home: Mutex<HashMap<BufId, Arc<CudaEvent>>>,
}

/// Events only order streams here: no timing.
const NO_TIMING: Option<ds::CUevent_flags> = Some(ds::CUevent_flags::CU_EVENT_DISABLE_TIMING);

impl Copies {
    pub(super) fn new(stream: Arc<CudaStream>) -> Copies {
        Copies {
            stream,
            pending: Mutex::new(Vec::new()),
            last_on_home: Mutex::new(HashMap::new()),
        }
    }

    /// Forgets the transfers in flight (after both streams were synchronised).
    pub(super) fn clear(&self) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.last_on_home
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Blocks the host until the last copy into or out of each of `homes` (pinned buffers)
    /// is done: the copy stream runs in order, so every earlier one is too.
    pub(super) fn settle(&self, homes: &[BufId]) -> Result<()> {
        let events: Vec<Arc<CudaEvent>> = {
            let mut last = self.last_on_home.lock().unwrap_or_else(|p| p.into_inner());
            homes.iter().filter_map(|h| last.remove(h)).collect()
        };
        for ev in events {
            ev.synchronize()
                .map_err(|e| anyhow!("waiting for a copy to or from pinned RAM ({e:?})"))?;
        }
        Ok(())
    }
}

/// One copy between the tiers: its ends' addresses.
pub(super) enum Copy {
    /// A pinned home (host address) into its device copy: a read.
    ToDevice { dst: ds::CUdeviceptr, src: usize },
    /// A device copy back to its pinned home: a write-back.
    ToHost { dst: usize, src: ds::CUdeviceptr },
}

impl Copies {
    /// Queues `copy` of `bytes` on the copy stream after everything `compute` has queued so
    /// far, recording its end against `stage` (its device copy) for [`Copies::wait`] and
    /// against `home` (its pinned buffer) for [`Copies::settle`].
    pub(super) fn start(
        &self,
        compute: &CudaStream,
        (stage, home): (BufId, BufId),
        copy: Copy,
        bytes: u64,
    ) -> Result<()> {
        let failed = |what: &str, e: cudarc::driver::DriverError| anyhow!("{what} ({e:?})");
        let after = compute
            .record_event(NO_TIMING)
            .map_err(|e| failed("an event on the compute stream", e))?;
        self.stream
            .wait(&after)
            .map_err(|e| failed("ordering the copy after the compute", e))?;
        let cu = self.stream.cu_stream();
        let n = bytes as usize;
        // SAFETY: the plan placed `bytes` at each end; between this op and its await only
        // the copy stream touches them (`plan::build::verify_transfers`), and the pinned
        // allocation outlives the stream's work (the device synchronises before freeing).
        unsafe {
            match copy {
                Copy::ToDevice { dst, src } => {
                    let src = std::slice::from_raw_parts(src as *const u8, n);
                    dr::memcpy_htod_async(dst, src, cu)
                }
                Copy::ToHost { dst, src } => {
                    let dst = std::slice::from_raw_parts_mut(dst as *mut u8, n);
                    dr::memcpy_dtoh_async(dst, src, cu)
                }
            }
        }
        .map_err(|e| failed("a copy between pinned RAM and the GPU", e))?;
        let done = self
            .stream
            .record_event(NO_TIMING)
            .map_err(|e| failed("an event on the copy stream", e))?;
        let done = Arc::new(done);
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((stage, done.clone()));
        self.last_on_home
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(home, done);
        Ok(())
    }

    /// Makes `compute` wait (on the GPU, the host going on) for the copies started into or
    /// out of `bufs`.
    pub(super) fn wait(&self, compute: &CudaStream, bufs: &[BufId]) -> Result<()> {
        let mine: Vec<Arc<CudaEvent>> = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut *pending)
                .into_iter()
                .partition(|(b, _)| bufs.contains(b));
            *pending = rest;
            mine.into_iter().map(|(_, ev)| ev).collect()
        };
        for ev in &mine {
            compute
                .wait(ev)
                .map_err(|e| anyhow!("waiting for a copy ({e:?})"))?;
        }
        Ok(())
    }
}

/// Bytes each way [`measure_bus`] copies per timed copy.
const BUS_PROBE_BYTES: usize = 256 << 20;

/// Copies [`BUS_PROBE_BYTES`] between pinned host RAM and device memory on a stream of its
/// own, one copy each way to warm up then five timed: (host to device, device to host)
/// bytes per second, the median of the five each way.
pub(super) fn measure_bus(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<(f64, f64)> {
    let failed = |what: &str, e: cudarc::driver::DriverError| {
        anyhow!("measuring the GPU's bus to pinned RAM: {what} ({e:?})")
    };
    ctx.bind_to_thread().map_err(|e| failed("its context", e))?;
    let stream = ctx.new_stream().map_err(|e| failed("a stream", e))?;
    let host = Pinned::new(BUS_PROBE_BYTES as u64)?;
    // SAFETY: a fresh allocation, freed below after the stream's work.
    let dev =
        unsafe { dr::malloc_sync(BUS_PROBE_BYTES) }.map_err(|e| failed("device memory", e))?;
    let cu = stream.cu_stream();
    let time = |up: bool| -> Result<f64> {
        let mut secs = Vec::new();
        for round in 0..6 {
            let t0 = std::time::Instant::now();
            // SAFETY: both ends hold BUS_PROBE_BYTES; the stream is synchronised before the
            // next copy and before either is freed.
            unsafe {
                if up {
                    let src = std::slice::from_raw_parts(host.ptr as *const u8, BUS_PROBE_BYTES);
                    dr::memcpy_htod_async(dev, src, cu)
                } else {
                    let dst = std::slice::from_raw_parts_mut(host.ptr, BUS_PROBE_BYTES);
                    dr::memcpy_dtoh_async(dst, dev, cu)
                }
            }
            .map_err(|e| failed("a copy", e))?;
            stream.synchronize().map_err(|e| failed("waiting", e))?;
            if round > 0 {
                secs.push(t0.elapsed().as_secs_f64());
            }
        }
        secs.sort_by(f64::total_cmp);
        Ok(BUS_PROBE_BYTES as f64 / secs[secs.len() / 2])
    };
    let rates = time(true).and_then(|up| Ok((up, time(false)?)));
    // SAFETY: allocated above; the stream's copies are done (or failed).
    let _ = stream.synchronize();
    let _ = unsafe { dr::free_sync(dev) };
    rates
}
