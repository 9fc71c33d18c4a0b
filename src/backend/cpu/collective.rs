//! The CPU device's collectives, started and awaited as its transfers are: an
//! [`Op::AllReduce`], `ReduceScatter`, `AllGather`, or a pipeline stage's `StageSend` or
//! `StageRecv` (point-to-point with a neighbouring stage) starts one ([`Collectives::start`]) and
//! its [`Op::AwaitCollective`] waits for it ([`Collectives::wait`]). They run on the device's
//! communication thread, one after the other in the order they were started, beside the ops
//! in between (which the plan keeps off their buffers); or, where no core is spare for that
//! thread ([`crate::dist::comm_thread_wanted`]), each one whole where its op starts it. Either
//! way the same ring ([`crate::dist::ring`]) sums in the same order: the same bits.
//!
//! The thread is started with the first collective and lives as long as the device. Its
//! queues, the list of collectives in flight and the log of their times (for the profiler's
//! communication track) are sized once for the schedule's collectives, so a step allocates
//! nothing. On the thread, a collective that fails (a peer lost) fails every later one unrun,
//! with its error: the ranks are out of step.

use crate::backend::{CommSpan, CommTime};
use crate::dist::{Comm, Comms, Summable, ring};
use crate::ir::{Axis, BufId, Buffer, Op, Peer, Reduce};
use crate::ir::{Collective, Cut, CutOf};
use anyhow::{Context, Result, anyhow};
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// The address and length (in elements) of a view of plan memory.
#[derive(Clone, Copy)]
struct Raw {
    ptr: usize,
    len: usize,
}

impl Raw {
    fn of<T>(s: &mut [T]) -> Raw {
        Raw {
            ptr: s.as_mut_ptr() as usize,
            len: s.len(),
        }
    }

    /// # Safety
    /// The view this was made of, of `T`s, is still valid and used by nobody else.
    unsafe fn get<'a, T>(self) -> &'a mut [T] {
        // SAFETY: the caller's.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len) }
    }
}

/// What a job does: a ring collective, or a pipeline stage's send or receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Ring(Collective),
    Send(Peer),
    Recv(Peer),
}

/// A collective on views of plan buffers, to run here or on the communication thread.
pub(super) struct Job {
    /// Its `buf`, which names it (its await names it first).
    key: BufId,
    kind: Kind,
    /// How its buffer is cut among the ranks.
    cut: CutOf,
    /// The mesh axis whose ranks it runs among.
    axis: Axis,
    buf: Raw,
    shard: Option<Raw>,
    scratch: Option<Raw>,
    /// A reduce-scatter's residual: copied into its shard, which then gains the sum.
    residual: Option<Raw>,
    accumulate: bool,
    /// An all-reduce's sum or maximum.
    reduce: Reduce,
    /// The ring for the buffers' element type.
    ring: unsafe fn(&Job, &Cut, &dyn Comm) -> Result<()>,
}

impl Job {
    /// Collective `op` on the views `view` gives of its buffers, elements of `T`. Panics on
    /// an op that is not a collective.
    pub(super) fn new<'a, T: Summable>(op: &Op, view: impl Fn(BufId) -> &'a mut [T]) -> Job {
        let raw = |id| Raw::of(view(id));
        // The elements of its buffer a ranged all-reduce sums (all of it otherwise), and what a
        // reduce-scatter adds its sum to.
        let (mut elems, mut residual, mut reduce) = (None, None, Reduce::Sum);
        let (key, kind, cut, axis, shard, scratch, accumulate) = match *op {
            Op::AllReduce {
                buf,
                scratch,
                cut,
                axis,
                elems: ref e,
                reduce: r,
            } => {
                elems = e.clone();
                reduce = r;
                (
                    buf,
                    Collective::AllReduce,
                    cut,
                    axis,
                    None,
                    Some(scratch),
                    false,
                )
            }
            Op::ReduceScatter {
                buf,
                shard,
                scratch,
                accumulate,
                cut,
                axis,
                residual: r,
            } => {
                residual = r;
                (
                    buf,
                    Collective::ReduceScatter,
                    cut,
                    axis,
                    Some(shard),
                    Some(scratch),
                    accumulate,
                )
            }
            Op::AllGather {
                buf,
                shard,
                cut,
                axis,
            } => (buf, Collective::AllGather, cut, axis, shard, None, false),
            Op::StageSend { buf, to } => return Job::point_to_point(buf, Kind::Send(to), view),
            Op::StageRecv { buf, from } => {
                return Job::point_to_point(buf, Kind::Recv(from), view);
            }
            ref other => unreachable!("{other:?} is not a collective"),
        };
        let kind = Kind::Ring(kind);
        Job {
            key,
            kind,
            cut,
            axis,
            buf: match elems {
                Some(e) => Raw::of(&mut view(key)[e]),
                None => raw(key),
            },
            shard: shard.map(raw),
            scratch: scratch.map(raw),
            residual: residual.map(raw),
            accumulate,
            reduce,
            ring: ring_of::<T>,
        }
    }

    /// A send or receive of `buf`'s bytes with a neighbouring pipeline stage.
    fn point_to_point<'a, T: Summable>(
        buf: BufId,
        kind: Kind,
        view: impl Fn(BufId) -> &'a mut [T],
    ) -> Job {
        let elems = Raw::of(view(buf));
        Job {
            key: buf,
            kind,
            cut: CutOf::Even,
            axis: Axis::Pipeline,
            buf: Raw {
                ptr: elems.ptr,
                len: elems.len * std::mem::size_of::<T>(),
            },
            shard: None,
            scratch: None,
            residual: None,
            accumulate: false,
            reduce: Reduce::Sum,
            ring: ring_of::<T>,
        }
    }

    /// Runs it among `comm`'s ranks, `cuts` being the parameter groups'.
    ///
    /// # Safety
    /// The views the job was made of are still valid and used by nobody else.
    unsafe fn run(&self, cuts: &[Cut], comm: &dyn Comm) -> Result<()> {
        // The pipeline's neighbours; the last stage's next is the first under the
        // interleaved schedule (`ir::PipelineStage::peer`).
        let peer = |p| match p {
            Peer::Next => (comm.rank() + 1) % comm.size(),
            Peer::Prev => (comm.rank() + comm.size() - 1) % comm.size(),
        };
        match self.kind {
            // SAFETY: the caller's; a point-to-point job's view is of bytes.
            Kind::Send(p) => return comm.send(unsafe { self.buf.get::<u8>() }, peer(p)),
            // SAFETY: as above.
            Kind::Recv(p) => return comm.recv(unsafe { self.buf.get::<u8>() }, peer(p)),
            Kind::Ring(_) => {}
        }
        let cut = self.cut.resolve(cuts, self.buf.len, comm.size());
        // SAFETY: the caller's.
        unsafe { (self.ring)(self, &cut, comm) }
    }
}

/// Runs `job` on its buffers as `T`s.
///
/// # Safety
/// As [`Job::run`].
unsafe fn ring_of<T: Summable>(job: &Job, cut: &Cut, comm: &dyn Comm) -> Result<()> {
    // SAFETY: the caller's; the plan keeps a collective's buffers apart.
    let (buf, shard, scratch) = unsafe {
        (
            job.buf.get::<T>(),
            job.shard.map(|s| s.get::<T>()),
            job.scratch.map(|s| s.get::<T>()),
        )
    };
    let planned = "internal error: a collective without its planned buffers";
    let Kind::Ring(kind) = job.kind else {
        unreachable!("point-to-point jobs run in Job::run")
    };
    match kind {
        Collective::AllReduce => match job.reduce {
            Reduce::Sum => ring::all_reduce(comm, buf, cut, scratch.expect(planned)),
            Reduce::Max => ring::all_reduce_max(comm, buf, cut, scratch.expect(planned)),
        },
        Collective::ReduceScatter => {
            let shard = shard.expect(planned);
            // SAFETY: as above; the residual is read only.
            if let Some(residual) = job.residual.map(|r| unsafe { r.get::<T>() }) {
                shard.copy_from_slice(residual);
            }
            let accumulate = job.accumulate || job.residual.is_some();
            ring::reduce_scatter(comm, buf, cut, shard, scratch.expect(planned), accumulate)
        }
        Collective::AllGather => {
            if let Some(shard) = shard {
                buf[cut.shard(comm.rank())].copy_from_slice(shard);
            }
            ring::all_gather(comm, buf, cut)
        }
    }
}

/// A collective the thread ended, successful or not.
struct Done {
    key: BufId,
    kind: Kind,
    result: Result<()>,
}

/// The log of the collectives' times: reserved once, never grown (records past its
/// capacity are counted, not kept).
struct Log {
    spans: Vec<CommSpan>,
    dropped: u64,
}

impl Log {
    fn push(&mut self, span: CommSpan) {
        match self.spans.len() < self.spans.capacity() {
            true => self.spans.push(span),
            false => self.dropped += 1,
        }
    }
}

/// Nanoseconds spent in collectives and waiting for them (shared with the thread).
#[derive(Default)]
struct Clock {
    busy_ns: AtomicU64,
    wait_ns: AtomicU64,
}

/// The communication thread: its queue of collectives and of their ends.
struct Thread {
    jobs: Option<SyncSender<Job>>,
    done: Mutex<Receiver<Done>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Thread {
    /// Finishes the collectives queued (their memory is still the device's), then stops.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// A rank's collectives on one device: the ranks, the cuts, the thread and its bookkeeping.
pub(super) struct Collectives {
    /// The job's communicators, one per mesh axis; each collective runs on its axis's.
    comms: Comms,
    cuts: Arc<[Cut]>,
    /// The schedule's collectives: room for that many in every queue and log.
    room: usize,
    /// Run beside the ops, on the thread (else each inline, where its op starts it).
    overlap: bool,
    thread: OnceLock<Thread>,
    /// The collectives started on the thread and not yet waited for, oldest first.
    in_flight: Mutex<VecDeque<(BufId, Kind)>>,
    clock: Arc<Clock>,
    log: Arc<Mutex<Log>>,
}

impl Collectives {
    /// Collectives among the ranks of `comms`'s axes on buffers cut by `cuts` (one per
    /// parameter group), `room` of them in a schedule.
    pub(super) fn new(comms: Comms, cuts: &[Cut], room: usize) -> Collectives {
        Collectives {
            comms,
            cuts: cuts.into(),
            room,
            overlap: true,
            thread: OnceLock::new(),
            in_flight: Mutex::new(VecDeque::with_capacity(room)),
            clock: Default::default(),
            log: Arc::new(Mutex::new(Log {
                spans: Vec::with_capacity(room),
                dropped: 0,
            })),
        }
    }

    /// Runs the collectives beside the ops (`true`) or each inline. Between runs only
    /// (nothing in flight).
    pub(super) fn set_overlap(&mut self, on: bool) {
        debug_assert!(self.in_flight.get_mut().is_ok_and(|f| f.is_empty()));
        self.overlap = on;
        if !on {
            drop(self.thread.take());
        }
    }

    /// The thread, started the first time.
    fn thread(&self) -> Result<&Thread> {
        if let Some(t) = self.thread.get() {
            return Ok(t);
        }
        let t = self.spawn()?;
        Ok(self.thread.get_or_init(|| t))
    }

    fn spawn(&self) -> Result<Thread> {
        let (jobs, job_rx) = sync_channel::<Job>(self.room.max(1));
        let (done_tx, done) = sync_channel::<Done>(self.room.max(1));
        let (comms, cuts) = (self.comms.clone(), self.cuts.clone());
        let (clock, log) = (self.clock.clone(), self.log.clone());
        let worker = std::thread::Builder::new()
            .name("memwall-comm".into())
            .spawn(move || {
                // The first failure, which every later collective reports unrun.
                let mut failed: Option<String> = None;
                for job in job_rx {
                    let start = Instant::now();
                    let result = match &failed {
                        Some(why) => Err(anyhow!("not run: an earlier collective failed: {why}")),
                        // SAFETY: `Collectives::start`'s caller keeps the views valid and
                        // untouched until the collective is waited for.
                        None => unsafe { job.run(&cuts, &**comms.along(job.axis)) },
                    };
                    let end = Instant::now();
                    if failed.is_none() {
                        clock.busy_ns.fetch_add(nanos(end - start), Relaxed);
                        let span = CommSpan {
                            buf: job.key,
                            start,
                            end,
                        };
                        log.lock().expect("not poisoned").push(span);
                        if let Err(e) = &result {
                            failed = Some(format!("{e:#}"));
                        }
                    }
                    let (key, kind) = (job.key, job.kind);
                    if done_tx.send(Done { key, kind, result }).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| crate::util::threads::refused("the communication thread", e))?;
        Ok(Thread {
            jobs: Some(jobs),
            done: Mutex::new(done),
            worker: Some(worker),
        })
    }

    /// Starts `job`: on the thread, or runs it here whole (its time counted as waited for).
    ///
    /// # Safety
    /// The views `job` was made of must stay valid, and be touched by nothing else, until
    /// [`Collectives::wait`] has waited for it (its await, or a wait for everything).
    pub(super) unsafe fn start(&self, job: Job, buffers: &[Buffer]) -> Result<()> {
        if !self.overlap {
            let start = Instant::now();
            // SAFETY: the caller's.
            let comm = self.comms.along(job.axis);
            let result = unsafe { job.run(&self.cuts, &**comm) };
            let end = Instant::now();
            let ns = nanos(end - start);
            self.clock.busy_ns.fetch_add(ns, Relaxed);
            self.clock.wait_ns.fetch_add(ns, Relaxed);
            let span = CommSpan {
                buf: job.key,
                start,
                end,
            };
            self.log.lock().expect("not poisoned").push(span);
            return result;
        }
        let thread = self.thread()?;
        let (key, kind) = (job.key, job.kind);
        self.in_flight
            .lock()
            .expect("not poisoned")
            .push_back((key, kind));
        let jobs = thread.jobs.as_ref().expect("open until dropped");
        if jobs.send(job).is_err() {
            self.in_flight.lock().expect("not poisoned").pop_back();
            return Err(anyhow!(
                "internal error: the communication thread is gone ({} of {})",
                name(kind),
                buffers[key.0].name
            ));
        }
        Ok(())
    }

    /// Waits for the collective on `key` and those started before it (they end in order),
    /// or with `None` for every one in flight; the first error, naming the collective and
    /// its buffer (among `buffers`). Nothing to wait for when it ended already, or ran
    /// inline.
    pub(super) fn wait(&self, key: Option<BufId>, buffers: &[Buffer]) -> Result<()> {
        let t0 = Instant::now();
        let mut in_flight = self.in_flight.lock().expect("not poisoned");
        let upto = match key {
            Some(k) => in_flight.iter().rposition(|j| j.0 == k),
            None => in_flight.len().checked_sub(1),
        };
        let mut first = Ok(());
        if let Some(pos) = upto {
            let done = self
                .thread
                .get()
                .map(|t| t.done.lock().expect("not poisoned"));
            for _ in 0..=pos {
                let (key, kind) = in_flight.pop_front().expect("counted above");
                let what = || format!("{} of {}", name(kind), buffers[key.0].name);
                let result = match done.as_ref().map(|d| d.recv()) {
                    Some(Ok(d)) => {
                        debug_assert!(d.key == key && d.kind == kind, "they end in order");
                        d.result.with_context(what)
                    }
                    _ => Err(anyhow!(
                        "internal error: the communication thread ended before the {}",
                        what()
                    )),
                };
                if first.is_ok() {
                    first = result;
                }
            }
        }
        self.clock.wait_ns.fetch_add(nanos(t0.elapsed()), Relaxed);
        first
    }

    /// Time in collectives and waiting for them, since the device started.
    pub(super) fn time(&self) -> CommTime {
        CommTime {
            busy_s: self.clock.busy_ns.load(Relaxed) as f64 * 1e-9,
            wait_s: self.clock.wait_ns.load(Relaxed) as f64 * 1e-9,
        }
    }

    /// Moves the logged collectives into `out`, as many as its spare capacity holds; how
    /// many were not kept.
    pub(super) fn take_spans(&self, out: &mut Vec<CommSpan>) -> u64 {
        let mut log = self.log.lock().expect("not poisoned");
        let mut no_room = 0;
        for s in log.spans.drain(..) {
            match out.len() < out.capacity() {
                true => out.push(s),
                false => no_room += 1,
            }
        }
        std::mem::take(&mut log.dropped) + no_room
    }
}

fn nanos(d: std::time::Duration) -> u64 {
    d.as_nanos() as u64
}

/// A collective's name in messages.
fn name(kind: Kind) -> &'static str {
    match kind {
        Kind::Ring(Collective::AllReduce) => "all-reduce",
        Kind::Ring(Collective::ReduceScatter) => "reduce-scatter",
        Kind::Ring(Collective::AllGather) => "all-gather",
        Kind::Send(Peer::Next) => "send to the next stage",
        Kind::Send(Peer::Prev) => "send to the stage before",
        Kind::Recv(Peer::Next) => "receive from the next stage",
        Kind::Recv(Peer::Prev) => "receive from the stage before",
    }
}
