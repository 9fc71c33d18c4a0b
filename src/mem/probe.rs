//! A short measurement of a disk: sequential direct-I/O writes, then reads, of 8 MiB blocks
//! (what `dd oflag=direct` / `iflag=direct` measures) through the same [`DiskTier`] the
//! offload file uses, so `plan` can say how long a step's transfers take on it. The scratch
//! file is 512 MiB, or half the free space of a smaller disk ([`probe_size`]).

use super::disk::DiskTier;
use crate::ir::IO_ALIGN;
use anyhow::Result;
use std::path::Path;
use std::time::Instant;

/// Bytes per transfer of the probe.
const BLOCK: usize = 8 << 20;

/// What [`probe`] measured.
#[derive(Clone, Copy, Debug)]
pub struct DiskSpeed {
    pub read_bytes_per_s: f64,
    pub write_bytes_per_s: f64,
    /// Bytes written and read back.
    pub bytes: u64,
    /// Direct I/O (else buffered: the figures then include the page cache's help).
    pub direct: bool,
}

impl DiskSpeed {
    /// Seconds to read `read` bytes and then write `written` bytes at the measured rates: a
    /// step with that traffic takes at least this, however well it overlaps its arithmetic
    /// (when reads and writes do not overlap each other).
    pub fn io_seconds(&self, read: u64, written: u64) -> f64 {
        read as f64 / self.read_bytes_per_s + written as f64 / self.write_bytes_per_s
    }
}

/// Checks, without measuring, that [`probe`] can run in `dir`: the directory exists (or is
/// created), is writable and has room for `bytes` (the scratch file is created, reserved
/// and removed). Errors name `--offload-dir` and the directory, as [`probe`]'s do; a
/// command that probes after minutes of other work checks first.
pub fn check(dir: &Path, bytes: u64) -> Result<()> {
    let blocks = bytes.div_ceil(BLOCK as u64).max(1);
    DiskTier::create(dir, "memwall-probe.bin", blocks * BLOCK as u64).map(drop)
}

/// The most a probe writes: 512 MiB.
pub const MAX_PROBE: u64 = 512 << 20;

/// How much to probe in `dir` (created if needed): [`MAX_PROBE`], or half the disk's free
/// space where that is less (whole 8 MiB blocks), so a small disk is measured, not refused,
/// and the probe leaves room. Refuses a disk with less than two blocks free, naming the probe.
pub fn probe_size(dir: &Path) -> Result<u64> {
    let free = super::disk::free_bytes_for(dir)?;
    let size = (free / 2).min(MAX_PROBE) / BLOCK as u64 * BLOCK as u64;
    if size == 0 {
        anyhow::bail!(
            "--offload-dir {}: {} free, too little for the disk probe's scratch file (at least {}); \
             free space there or point --offload-dir at a larger disk",
            dir.display(),
            crate::util::bytes::fmt_bytes(free),
            crate::util::bytes::fmt_bytes(2 * BLOCK as u64)
        );
    }
    Ok(size)
}

/// Writes then reads `bytes` (rounded up to whole 8 MiB blocks) in a scratch file in `dir`,
/// removed afterwards. Errors name the directory (missing, unwritable, full) and say they
/// are the probe's ([`probe_size`] picks `bytes` that fit).
pub fn probe(dir: &Path, bytes: u64) -> Result<DiskSpeed> {
    let blocks = bytes.div_ceil(BLOCK as u64).max(1);
    let tier = DiskTier::create_as(
        dir,
        "memwall-probe.bin",
        blocks * BLOCK as u64,
        "the disk probe's scratch file",
    )?;
    let align = IO_ALIGN as usize;
    let mut raw = vec![0xa5u8; BLOCK + align];
    let at = raw.as_ptr().align_offset(align);
    let buf = &mut raw[at..at + BLOCK]; // [BLOCK] bytes, IO_ALIGN-aligned
    let t0 = Instant::now();
    for k in 0..blocks {
        tier.write(k * BLOCK as u64, buf)?;
    }
    let write_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    for k in 0..blocks {
        tier.read(k * BLOCK as u64, buf)?;
    }
    let read_s = t0.elapsed().as_secs_f64();
    let total = blocks * BLOCK as u64;
    Ok(DiskSpeed {
        read_bytes_per_s: total as f64 / read_s.max(1e-9),
        write_bytes_per_s: total as f64 / write_s.max(1e-9),
        bytes: total,
        direct: tier.direct,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_and_removes_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = probe(dir.path(), 3 << 20).unwrap();
        assert_eq!(s.bytes, BLOCK as u64, "rounded up to one block");
        assert!(
            s.read_bytes_per_s > 0.0 && s.write_bytes_per_s > 0.0,
            "{s:?}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "scratch left"
        );
        let missing = dir.path().join("no/such\0dir");
        assert!(probe(&missing, 1).is_err());
    }
}
