//! The disk tier (`--offload`): one preallocated file per run in the offload directory,
//! holding the plan's [`crate::ir::Tier::Nvme`] buffers at their packed offsets, read and
//! written whole with direct I/O (`O_DIRECT`: no page cache, so offloading does not grow the
//! machine's memory behind the plan's back). Where the file system refuses `O_DIRECT` (tmpfs,
//! some overlay file systems) the file is opened buffered and every transfer is followed by
//! `posix_fadvise(DONTNEED)`, which the caller says once in its output.
//!
//! Offsets, lengths and host addresses are multiples of [`IO_ALIGN`] (the plan pads every
//! transfer's two ends to it). The file is scratch: removed when the tier is dropped; the
//! checkpoint is the record.
//!
//! [`IoThread`] runs a step's transfers on a thread of their own, in the order they were
//! started, so that reading the next group's state and writing the last one's overlap the
//! compute; each transfer's [`Ticket`] is waited on before its host buffer is used. It keeps
//! the times of the transfers it performed ([`Timed`]) in a log reserved when it starts, for
//! the profiler's I/O track.

use crate::ir::IO_ALIGN;
use crate::util::bytes::fmt_bytes;
use anyhow::{Context, Result, bail};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

/// Fault injection for tests: with `MEMWALL_OFFLOAD_FAIL_AFTER=N` in the environment, every
/// transfer after the first N fails as a disk error would.
pub const FAIL_AFTER_ENV: &str = "MEMWALL_OFFLOAD_FAIL_AFTER";

/// Test seam: with `MEMWALL_DISK_FREE_BYTES=N` in the environment, [`free_bytes`] reports at
/// most N bytes free (a small disk without mounting one).
pub const DISK_FREE_ENV: &str = "MEMWALL_DISK_FREE_BYTES";

/// An open offload file.
pub struct DiskTier {
    file: File,
    path: PathBuf,
    /// Opened with `O_DIRECT` (else buffered, with the page cache dropped after each transfer).
    pub direct: bool,
    /// Transfers left before an injected failure ([`FAIL_AFTER_ENV`]).
    fail_after: Option<AtomicU64>,
    /// The directory, when this tier created it: removed with the file if left empty.
    created_dir: Option<PathBuf>,
}

impl DiskTier {
    /// Creates `dir` if needed (removed again with the file when it is left empty) and
    /// `dir/name` of `bytes` bytes (space checked, then reserved with `fallocate`),
    /// replacing a previous run's file. Errors name the directory and what would fix it.
    pub fn create(dir: &Path, name: &str, bytes: u64) -> Result<DiskTier> {
        DiskTier::create_as(dir, name, bytes, "the offload file")
    }

    /// [`DiskTier::create`] of a file that errors call `what` (the disk probe's scratch).
    pub fn create_as(dir: &Path, name: &str, bytes: u64, what: &str) -> Result<DiskTier> {
        let created_dir = (!dir.exists()).then(|| dir.to_path_buf());
        let _ = std::fs::create_dir_all(dir); // a failure is named just below
        if !dir.is_dir() {
            bail!(
                "--offload-dir {}: not a directory (create it, or point --offload-dir at a directory on a disk with {} free)",
                dir.display(),
                fmt_bytes(bytes)
            );
        }
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path); // a previous run's scratch
        check_room(dir, bytes, what)?;
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true).create(true).truncate(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (
                open(false)
                    .with_context(|| format!("--offload-dir: cannot create {}", path.display()))?,
                false,
            ),
            Err(e) => {
                return Err(e).with_context(|| {
                    format!(
                        "--offload-dir {}: cannot create {} (is the directory writable?)",
                        dir.display(),
                        path.display()
                    )
                });
            }
        };
        let fail_after = std::env::var(FAIL_AFTER_ENV)
            .ok()
            .and_then(|n| n.parse().ok())
            .map(AtomicU64::new);
        let tier = DiskTier {
            file,
            path,
            direct,
            fail_after,
            created_dir,
        };
        // SAFETY: a valid descriptor; fallocate only reserves blocks.
        let r = unsafe { libc::fallocate(tier.file.as_raw_fd(), 0, 0, bytes as libc::off_t) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                tier.file
                    .set_len(bytes)
                    .with_context(|| tier.what("size"))?;
            } else {
                return Err(e).with_context(|| {
                    format!("reserving {} for {}", fmt_bytes(bytes), tier.path.display())
                });
            }
        }
        Ok(tier)
    }

    /// The file's path (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads `buf.len()` bytes at `offset` (both multiples of [`IO_ALIGN`], `buf` aligned).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        check_aligned(offset, buf.as_ptr(), buf.len());
        self.injected_failure()
            .and_then(|()| self.file.read_exact_at(buf, offset))
            .with_context(|| self.what_at("read", offset, buf.len()))?;
        self.drop_cache(offset, buf.len());
        Ok(())
    }

    /// Writes `buf` at `offset` (both multiples of [`IO_ALIGN`], `buf` aligned).
    pub fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        check_aligned(offset, buf.as_ptr(), buf.len());
        self.injected_failure()
            .and_then(|()| self.file.write_all_at(buf, offset))
            .with_context(|| self.what_at("write", offset, buf.len()))?;
        self.drop_cache(offset, buf.len());
        Ok(())
    }

    fn injected_failure(&self) -> std::io::Result<()> {
        match &self.fail_after {
            Some(left)
                if left
                    .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                    .is_err() =>
            {
                Err(std::io::Error::other(format!(
                    "injected by {FAIL_AFTER_ENV}"
                )))
            }
            _ => Ok(()),
        }
    }

    fn drop_cache(&self, offset: u64, len: usize) {
        if !self.direct {
            // SAFETY: a valid descriptor; advice only.
            unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    offset as libc::off_t,
                    len as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
    }

    fn what(&self, op: &str) -> String {
        format!("offload file {}: {op}", self.path.display())
    }

    fn what_at(&self, op: &str, offset: u64, len: usize) -> String {
        format!(
            "offload file {}: {op} of {len} bytes at offset {offset} failed",
            self.path.display()
        )
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        // Only an empty directory is removed (`remove_dir` refuses any other).
        if let Some(dir) = &self.created_dir {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A transfer in flight: wait on it before touching its host buffer.
pub struct Ticket(mpsc::Receiver<Result<()>>);

impl Ticket {
    /// Blocks until the transfer is done; its error names the file and offset.
    pub fn wait(self) -> Result<()> {
        self.0
            .recv()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the offload I/O thread stopped")))
    }
}

struct Job {
    /// Read from the file into the host (else write the host bytes to the file).
    read: bool,
    offset: u64,
    ptr: usize,
    len: usize,
    /// The submitter's name for the transfer, returned in its [`Timed`] record.
    tag: usize,
}

/// One transfer the I/O thread performed, successful or not.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    /// The submitter's tag (the CPU device: the index of the host buffer).
    pub tag: usize,
    /// From the file into host memory (else host memory to the file).
    pub read: bool,
    pub bytes: u64,
    pub start: Instant,
    pub end: Instant,
}

/// The log of timed transfers: reserved once, never grown (records past its capacity are
/// counted, not kept), so the I/O thread allocates nothing per transfer.
struct TimedLog {
    done: Vec<Timed>,
    dropped: u64,
}

/// The offload file's I/O thread: transfers run one after the other, beside the compute.
pub struct IoThread {
    disk: Arc<DiskTier>,
    /// Nanoseconds the thread spent in transfers.
    busy_ns: Arc<AtomicU64>,
    log: Arc<Mutex<TimedLog>>,
    jobs: Option<mpsc::Sender<(Job, mpsc::Sender<Result<()>>)>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl IoThread {
    /// Starts the thread, with room to log `log_capacity` transfers between two calls of
    /// [`IoThread::take_timed`].
    pub fn new(disk: DiskTier, log_capacity: usize) -> Result<IoThread> {
        let disk = Arc::new(disk);
        let (tx, rx) = mpsc::channel::<(Job, mpsc::Sender<Result<()>>)>();
        let d = disk.clone();
        let busy_ns = Arc::new(AtomicU64::new(0));
        let busy = busy_ns.clone();
        let log = Arc::new(Mutex::new(TimedLog {
            done: Vec::with_capacity(log_capacity),
            dropped: 0,
        }));
        let log_w = log.clone();
        let worker = std::thread::Builder::new()
            .name("memwall-io".into())
            .spawn(move || {
                for (job, done) in rx {
                    let start = Instant::now();
                    let Job {
                        read,
                        offset,
                        ptr,
                        len,
                        tag,
                    } = job;
                    // SAFETY: the submitter keeps the memory valid and untouched until it
                    // has waited on the ticket (`IoThread::read`/`write`'s contract).
                    let r = unsafe {
                        if read {
                            d.read(offset, std::slice::from_raw_parts_mut(ptr as *mut u8, len))
                        } else {
                            d.write(offset, std::slice::from_raw_parts(ptr as *const u8, len))
                        }
                    };
                    let end = Instant::now();
                    busy.fetch_add((end - start).as_nanos() as u64, SeqCst);
                    if let Ok(mut log) = log_w.lock() {
                        if log.done.len() < log.done.capacity() {
                            log.done.push(Timed {
                                tag,
                                read,
                                bytes: len as u64,
                                start,
                                end,
                            });
                        } else {
                            log.dropped += 1;
                        }
                    }
                    let _ = done.send(r);
                }
            })
            .map_err(|e| crate::util::threads::refused("the offload I/O thread", e))?;
        Ok(IoThread {
            disk,
            busy_ns,
            log,
            jobs: Some(tx),
            worker: Some(worker),
        })
    }

    /// Hands `f` the transfers finished since the last call, in the order they ran, and
    /// empties the log (keeping its reservation); returns how many did not fit the log.
    pub fn take_timed(&self, f: &mut dyn FnMut(Timed)) -> u64 {
        let mut log = self.log.lock().expect("not poisoned");
        log.done.drain(..).for_each(&mut *f);
        std::mem::take(&mut log.dropped)
    }

    /// Seconds the thread has spent in transfers.
    pub fn busy_s(&self) -> f64 {
        self.busy_ns.load(SeqCst) as f64 * 1e-9
    }

    /// The file, for transfers made between steps (none in flight then).
    pub fn disk(&self) -> &DiskTier {
        &self.disk
    }

    fn submit(&self, job: Job) -> Ticket {
        let (done, ticket) = mpsc::channel();
        let jobs = self.jobs.as_ref().expect("open until dropped");
        if let Err(mpsc::SendError((_, done))) = jobs.send((job, done)) {
            let _ = done.send(Err(anyhow::anyhow!("the offload I/O thread stopped")));
        }
        Ticket(ticket)
    }

    /// Starts reading `buf.len()` bytes at `offset` into `buf`; `tag` names the transfer in
    /// its [`Timed`] record.
    ///
    /// # Safety
    /// `buf` must stay valid, and be neither read nor written by anyone else, until the
    /// returned ticket has been waited on (or this thread dropped).
    pub unsafe fn read(&self, offset: u64, buf: &mut [u8], tag: usize) -> Ticket {
        self.submit(Job {
            read: true,
            offset,
            ptr: buf.as_mut_ptr() as usize,
            len: buf.len(),
            tag,
        })
    }

    /// Starts writing `buf` at `offset`; `tag` names the transfer in its [`Timed`] record.
    ///
    /// # Safety
    /// `buf` must stay valid and unwritten until the returned ticket has been waited on.
    pub unsafe fn write(&self, offset: u64, buf: &[u8], tag: usize) -> Ticket {
        self.submit(Job {
            read: false,
            offset,
            ptr: buf.as_ptr() as usize,
            len: buf.len(),
            tag,
        })
    }
}

impl Drop for IoThread {
    /// Finishes the transfers in flight (their memory is still the caller's), then stops.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

fn check_aligned(offset: u64, ptr: *const u8, len: usize) {
    let a = IO_ALIGN as usize;
    assert!(
        offset.is_multiple_of(IO_ALIGN)
            && (ptr as usize).is_multiple_of(a)
            && len.is_multiple_of(a),
        "internal error: unaligned disk transfer (offset {offset}, length {len})"
    );
}

/// Bytes free to an unprivileged user on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .with_context(|| format!("--offload-dir {}: a path with a NUL byte", dir.display()))?;
    // SAFETY: statvfs fills the zeroed struct; c is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| {
            format!(
                "--offload-dir {}: cannot read its free space",
                dir.display()
            )
        });
    }
    let free = st.f_bavail as u64 * st.f_frsize as u64;
    Ok(
        match std::env::var(DISK_FREE_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
        {
            Some(cap) => free.min(cap),
            None => free,
        },
    )
}

/// The free bytes of the disk `dir` is (or will be) on, when they hold `bytes` of `what`
/// (e.g. "the offload file"); else an error naming the directory and both sizes.
pub fn check_room(dir: &Path, bytes: u64, what: &str) -> Result<u64> {
    let free = free_bytes_for(dir)?;
    if free < bytes {
        bail!(
            "--offload-dir {}: {what} needs {} but the disk has {} free; free space there, \
             choose another --offload-dir, or offload less (--offload auto with --max-memory \
             picks what fits)",
            dir.display(),
            fmt_bytes(bytes),
            fmt_bytes(free)
        );
    }
    Ok(free)
}

/// [`free_bytes`] of the file system that `dir` will be on: its own, or its nearest existing
/// ancestor's when it is not there yet (the offload directory is created when a run starts).
pub fn free_bytes_for(dir: &Path) -> Result<u64> {
    let mut at = dir;
    while !at.exists() {
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p,
            _ => {
                at = Path::new(".");
                break;
            }
        }
    }
    free_bytes(at).with_context(|| format!("--offload-dir {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Arena;

    #[test]
    fn round_trip_and_removal() {
        let dir = tempfile::tempdir().unwrap();
        let n = 3 * IO_ALIGN as usize;
        let tier = DiskTier::create(dir.path(), "t.bin", 4 * n as u64).unwrap();
        let path = tier.path().to_path_buf();
        let a = Arena::new(2 * n as u64).unwrap();
        // SAFETY: two disjoint views of a fresh arena.
        let (src, dst) = unsafe { (a.view_mut::<u8>(0, n), a.view_mut::<u8>(n as u64, n)) };
        for (i, x) in src.iter_mut().enumerate() {
            *x = (i * 7 % 251) as u8;
        }
        tier.write(IO_ALIGN, src).unwrap();
        tier.read(IO_ALIGN, dst).unwrap();
        assert_eq!(src, dst);
        drop(tier);
        assert!(!path.exists(), "the scratch file is removed");
    }

    #[test]
    fn the_io_thread_times_its_transfers_in_a_bounded_log() {
        let dir = tempfile::tempdir().unwrap();
        let n = IO_ALIGN as usize;
        let io = IoThread::new(
            DiskTier::create(dir.path(), "t.bin", 4 * n as u64).unwrap(),
            2,
        )
        .unwrap();
        let a = Arena::new(3 * n as u64).unwrap();
        // SAFETY: two disjoint views of a fresh arena, untouched until the tickets are waited.
        let (src, dst) = unsafe { (a.view_mut::<u8>(0, n), a.view_mut::<u8>(n as u64, 2 * n)) };
        let t0 = Instant::now();
        // SAFETY: each buffer is left alone until its ticket is waited on.
        unsafe {
            io.write(0, src, 7).wait().unwrap();
            io.read(0, dst, 9).wait().unwrap();
            io.read(0, &mut dst[..n], 11).wait().unwrap(); // past the log's room: counted
        }
        let mut got = Vec::new();
        assert_eq!(io.take_timed(&mut |t| got.push(t)), 1);
        let kinds: Vec<_> = got.iter().map(|t| (t.tag, t.read, t.bytes)).collect();
        assert_eq!(kinds, [(7, false, n as u64), (9, true, 2 * n as u64)]);
        assert!(got[0].start >= t0 && got[0].end <= got[1].start && got[1].start <= got[1].end);
        // Taken means gone; the room is kept.
        assert_eq!(io.take_timed(&mut |_| panic!("taken twice")), 0);
        unsafe { io.read(0, src, 1).wait().unwrap() };
        assert_eq!(io.take_timed(&mut |t| assert_eq!(t.tag, 1)), 0);
    }

    #[test]
    fn errors_name_the_directory() {
        // A directory that cannot be created: its parent is a file.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a_file");
        std::fs::write(&file, "x").unwrap();
        let bad = file.join("mw");
        let e = DiskTier::create(&bad, "t.bin", 4096).err().unwrap();
        let e = format!("{e:#}");
        assert!(
            e.contains(&format!("--offload-dir {}", bad.display()))
                && e.contains("not a directory"),
            "{e}"
        );
        let e = DiskTier::create(dir.path(), "t.bin", u64::MAX / 2)
            .err()
            .unwrap();
        let e = format!("{e:#}");
        assert!(e.contains("free") && e.contains("needs"), "{e}");
    }
}
