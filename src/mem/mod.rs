//! Memory tiers: host RAM, held in one [`arena::Arena`] per plan, and the disk tier
//! ([`disk::DiskTier`], `--offload`), one preallocated file per run. Device tiers come with
//! the CUDA backend.
//!
//! - [`arena`]: one page-aligned allocation, touched up front, so resident memory equals the
//!   plan from step 1 and an impossible allocation fails before training.
//! - [`disk`]: the offload file, its space checked and reserved (`fallocate`), opened
//!   `O_DIRECT` (else buffered with `posix_fadvise(DONTNEED)`), errors naming the file and
//!   offset, removed when dropped; [`disk::IoThread`] runs transfers in order beside the
//!   compute, each timed for the profiler; [`disk::check_room`] is the free-space check at plan
//!   time and at creation. For the tests, `MEMWALL_OFFLOAD_FAIL_AFTER=N` fails the disk after N
//!   transfers and `MEMWALL_DISK_FREE_BYTES=N` caps the free space it reads.
//! - [`probe`]: a short direct-I/O measurement of a disk (`plan --offload-dir`, `calibrate`);
//!   [`probe::check`] creates and removes the file unmeasured, so `calibrate` refuses a bad
//!   `--offload-dir` before its suite.
//!
//! **Invariant:** the disk tier moves whole buffers at offsets aligned to
//! [`crate::ir::IO_ALIGN`], in the order the plan starts them, and never grows the page cache
//! behind the plan's back.

pub mod arena;
pub mod disk;
pub mod probe;

pub use arena::Arena;
