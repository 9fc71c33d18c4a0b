//! The threads memwall starts (compute pool, data loader, offload I/O, communication), the
//! `--threads` rule, and what to say when the system refuses a thread.
//!
//! A thread the system cannot start (a `ulimit -u` on processes, a `ulimit -v` too small
//! for its stack) is an error naming the thread and the limits in force, never a panic.

use anyhow::{Result, anyhow, bail};
use std::fmt::Display;

/// The most `--threads` a plan may be made for (for another machine): above this a count is
/// a typo, not a machine.
pub const MAX_THREADS: usize = 4096;

/// The most threads per core a command that runs here accepts: beyond that, threads only
/// wait for each other (`--threads 5000` on 2 cores took minutes for two tiny steps).
pub const MAX_THREADS_PER_CORE: usize = 8;

/// The error for a thread the system refused to start: `what` names it (e.g. "the data
/// loader thread"), `e` is the system's reason; the process limits that bound threads are
/// named with their values.
pub fn refused(what: &str, e: impl Display) -> anyhow::Error {
    anyhow!(
        "cannot start {what}: {e}. The system limits this process's threads or memory \
         ({}): raise the limit, or run with fewer --threads",
        limits()
    )
}

/// `std::thread::Builder::spawn` with [`refused`]'s error.
pub fn spawn<F, T>(name: &str, what: &str, f: F) -> Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| refused(what, e))
}

/// `ulimit -u` and `ulimit -v` as the process sees them, e.g. `ulimit -u 64, ulimit -v
/// unlimited`.
pub fn limits() -> String {
    let show = |resource, unit: u64| {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into the struct we own.
        let ok = unsafe { libc::getrlimit(resource, &mut r) } == 0;
        match ok {
            false => "unknown".to_string(),
            true if r.rlim_cur == libc::RLIM_INFINITY => "unlimited".to_string(),
            true => (r.rlim_cur / unit).to_string(),
        }
    };
    format!(
        "ulimit -u {}, ulimit -v {}",
        show(libc::RLIMIT_NPROC, 1),
        show(libc::RLIMIT_AS, 1024)
    )
}

/// Checks a `--threads` value against the machine's `cores`: refuses 0 and absurd counts
/// (above [`MAX_THREADS`]; when the command runs here, `runs_here`, above
/// [`MAX_THREADS_PER_CORE`] per core), and returns a warning when it runs here on more
/// threads than cores (threads then share cores, and every step pays for it).
pub fn check_count(threads: usize, cores: usize, runs_here: bool) -> Result<Option<String>> {
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    let cap = match runs_here {
        true => MAX_THREADS.min(MAX_THREADS_PER_CORE * cores.max(1)),
        false => MAX_THREADS,
    };
    if threads > cap {
        bail!(
            "--threads {threads} is more than memwall accepts here ({cap}): this machine has \
             {cores} cores, and threads beyond them only wait for each other; use at most \
             --threads {cores}"
        );
    }
    Ok((runs_here && threads > cores).then(|| {
        format!(
            "--threads {threads} is more than this machine's {cores} cores: threads will share \
             cores and every step will be slower; --threads {cores} is usually fastest"
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_counts_are_checked_against_the_cores() {
        assert!(check_count(0, 2, true).is_err());
        assert_eq!(check_count(2, 2, true).unwrap(), None);
        let w = check_count(3, 2, true).unwrap().unwrap();
        assert!(w.contains("2 cores") && w.contains("--threads 3"), "{w}");
        let e = format!("{:#}", check_count(5000, 2, true).unwrap_err());
        assert!(e.contains("--threads 5000") && e.contains("2 cores"), "{e}");
        assert!(check_count(17, 2, true).is_err());
        // A plan may be made for a larger machine, without a warning; not for any number.
        assert_eq!(check_count(64, 2, false).unwrap(), None);
        assert!(check_count(5000, 2, false).is_err());
    }

    #[test]
    fn a_refused_thread_names_itself_and_the_limits() {
        let e = refused("the data loader thread", "Resource temporarily unavailable");
        let e = format!("{e:#}");
        assert!(
            e.contains("the data loader thread") && e.contains("ulimit -u"),
            "{e}"
        );
    }
}
