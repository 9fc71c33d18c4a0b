//! Allocator settings for training processes (glibc), and handing freed memory back.
//!
//! The `gemm` crate allocates its packing scratch (at most a few MiB per call, see
//! `plan::build::gemm_packing_bytes`) on every call. With glibc's default, adaptive mmap
//! threshold, blocks of that size may be mapped and unmapped on every call: a page fault
//! per 4 KiB, every GEMM. A fixed threshold above those blocks and a high trim threshold keep
//! them in the heap, reused, so the scratch is resident once (and counted by the plan).
//!
//! Reused only if each block fits where the last one was freed. `gemm` asks for its blocks
//! cache-line aligned, and glibc serves an aligned request by carving a larger chunk and
//! freeing the slivers before and after it; those slivers go to the thread cache and the fast
//! bins, which never coalesce, so the freed block stays too small for the next, equal request
//! and the heap grows instead: up to 7 MB over a few hundred GEMMs, in about half the runs
//! (it depends on where the heap's top happens to lie). [`PaddedAligned`], the binary's global
//! allocator, serves over-aligned heap requests as plain `malloc` blocks with room to align
//! inside, so equal requests get equal chunks and reuse them.

use std::alloc::{GlobalAlloc, Layout, System};

/// The system allocator, except for over-aligned requests glibc would serve from its heap
/// (alignment above `malloc`'s 16 bytes, up to a page, below the mmap threshold): those are
/// `malloc(size + align)` blocks, aligned inside, the block's address kept in the 8 bytes
/// below the returned pointer (module documentation for why).
pub struct PaddedAligned;

/// `malloc`'s alignment on 64-bit glibc.
const MALLOC_ALIGN: usize = 16;

/// Whether `l` is served padded.
fn padded(l: Layout) -> bool {
    cfg!(all(
        target_os = "linux",
        target_env = "gnu",
        target_pointer_width = "64"
    )) && l.align() > MALLOC_ALIGN
        && l.align() <= 4096
        && l.size() < MMAP_THRESHOLD
}

/// The `malloc` block behind a padded request.
fn outer(l: Layout) -> Layout {
    // SAFETY: 16 is a power of two, and size + align (below 17 MiB for a padded request)
    // rounded up to 16 does not overflow.
    unsafe { Layout::from_size_align_unchecked(l.size() + l.align(), MALLOC_ALIGN) }
}

/// The aligned address inside a `malloc` block `raw` (16-aligned), with the block's address
/// stored just below it: the gap is a multiple of 16 in [16, align], so 8 bytes fit.
///
/// # Safety
/// `raw` is a live block of `outer(l)` bytes.
unsafe fn inside(raw: *mut u8, l: Layout) -> *mut u8 {
    let gap = l.align() - (raw as usize & (l.align() - 1));
    // SAFETY: gap ≤ align, so gap + size ≤ the block's size; gap ≥ 16, so the 8 bytes below
    // the result are inside the block and 8-aligned.
    unsafe {
        let p = raw.add(gap);
        p.cast::<*mut u8>().sub(1).write(raw);
        p
    }
}

/// A block for `l` from `system` (`System`'s `alloc` or `alloc_zeroed`): `l` itself, or the
/// padded block's inside.
///
/// # Safety
/// `l` has a non-zero size, and `system` returns a block of the layout it is given, or null.
unsafe fn through(l: Layout, system: impl FnOnce(Layout) -> *mut u8) -> *mut u8 {
    if !padded(l) {
        return system(l);
    }
    let raw = system(outer(l));
    if raw.is_null() {
        raw
    } else {
        unsafe { inside(raw, l) }
    }
}

// SAFETY: every pointer handed out is aligned as asked and valid for the size asked (see
// `inside`); padded blocks are freed through the address stored below them, others go
// straight to `System`, chosen by the same `padded(layout)` on both sides.
unsafe impl GlobalAlloc for PaddedAligned {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        unsafe { through(l, |l| System.alloc(l)) }
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        unsafe { through(l, |l| System.alloc_zeroed(l)) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if !padded(l) {
            return unsafe { System.dealloc(p, l) };
        }
        unsafe {
            let raw = p.cast::<*mut u8>().sub(1).read();
            System.dealloc(raw, outer(l))
        }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        // SAFETY (caller's contract): new_size rounded up to l.align() does not overflow.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, l.align()) };
        if !padded(l) && !padded(new) {
            return unsafe { System.realloc(p, l, new_size) };
        }
        unsafe {
            let q = self.alloc(new);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
                self.dealloc(p, l);
            }
            q
        }
    }
}

/// glibc's mmap threshold as [`keep_library_scratch_resident`] sets it: larger blocks are
/// mapped, page-aligned, and leave no slivers.
const MMAP_THRESHOLD: usize = 16 << 20;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
unsafe extern "C" {
    fn mallopt(param: i32, value: i32) -> i32;
    fn malloc_trim(pad: usize) -> i32;
}

/// Hands the allocator's free pages back to the system (glibc's `malloc_trim(0)`, every
/// arena; a no-op elsewhere): after work whose allocations are all freed (the `--fit`
/// search builds hundreds of plans on every core), so what stays resident, and is measured
/// as the process baseline, is what lives on.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory to the system.
    unsafe {
        malloc_trim(0);
    }
}

/// Applies the settings (idempotent; a no-op off glibc). Returns false if glibc refused.
pub fn keep_library_scratch_resident() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only adjusts allocator parameters.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD as i32) == 1
                && mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks of every class come back aligned and writable, keep their bytes through
    /// `realloc` across the padded/plain boundary, and equal padded requests reuse one
    /// address once freed (what the module is for).
    #[test]
    fn padded_blocks_are_aligned_keep_their_bytes_and_are_reused() {
        // Freed blocks of this size stay in the heap, as in a training process.
        keep_library_scratch_resident();
        let a = PaddedAligned;
        for (size, align) in [(1, 1), (100, 8), (4096, 64), (524_288, 128), (65_536, 4096)] {
            let l = Layout::from_size_align(size, align).unwrap();
            unsafe {
                let p = a.alloc(l);
                assert!(
                    !p.is_null() && (p as usize).is_multiple_of(align),
                    "{size} / {align}"
                );
                for i in 0..size {
                    p.add(i).write(i as u8);
                }
                // Grown within the heap, or past the mmap threshold (padded to plain).
                let grown = if size > 4096 {
                    MMAP_THRESHOLD + size
                } else {
                    2 * size
                };
                let q = a.realloc(p, l, grown);
                assert!((q as usize).is_multiple_of(align));
                assert!(
                    (0..size).all(|i| q.add(i).read() == i as u8),
                    "{size} / {align}"
                );
                let big = Layout::from_size_align(grown, align).unwrap();
                a.dealloc(q, big);
                let z = a.alloc_zeroed(l);
                assert!((0..size).all(|i| z.add(i).read() == 0));
                a.dealloc(z, l);
            }
        }
        if cfg!(all(target_os = "linux", target_env = "gnu")) {
            let l = Layout::from_size_align(524_288, 128).unwrap();
            unsafe {
                let first = a.alloc(l);
                a.dealloc(first, l);
                for _ in 0..64 {
                    let again = a.alloc(l);
                    assert_eq!(
                        again, first,
                        "an equal request after a free reuses the block"
                    );
                    a.dealloc(again, l);
                }
            }
        }
    }
}
