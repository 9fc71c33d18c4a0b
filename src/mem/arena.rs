//! The host arena: one aligned allocation per plan, made once, touched up front (so the
//! process's resident memory equals the plan from the first step, and an impossible
//! allocation fails before training rather than mid-step), then handed out as views.

use anyhow::{Result, bail};
use std::alloc::{Layout, alloc, dealloc};
use std::ptr::NonNull;

/// One page-aligned ([`crate::ir::IO_ALIGN`]) block of host memory, so buffers
/// packed at I/O-aligned offsets can be read and written with direct I/O.
pub struct Arena {
    ptr: NonNull<u8>,
    layout: Layout,
    /// Whether the arena allocated its memory (and frees it), or borrows another's
    /// ([`Arena::borrowed`]).
    owned: bool,
}

// SAFETY: the arena is plain memory; synchronisation of views is the executor's job, which
// relies on the plan's verified non-overlap of live buffers.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Arena {
    /// Allocates `bytes` (at least 64) and writes zeros to every page, in parallel.
    pub fn new(bytes: u64) -> Result<Arena> {
        let size = bytes.max(64);
        let Ok(size) = usize::try_from(size) else {
            bail!("the plan's arena ({bytes} bytes) exceeds this machine's address space");
        };
        let layout = Layout::from_size_align(size, crate::ir::IO_ALIGN as usize)?;
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            bail!(
                "cannot allocate the plan's arena of {}: the system refused; use --max-memory to plan within what is free",
                crate::util::bytes::fmt_bytes(bytes)
            );
        };
        let arena = Arena {
            ptr,
            layout,
            owned: true,
        };
        {
            use rayon::prelude::*;
            // SAFETY: the whole allocation, exclusively ours here.
            let all = unsafe { std::slice::from_raw_parts_mut(arena.ptr.as_ptr(), size) };
            all.par_chunks_mut(1 << 20).for_each(|c| c.fill(0));
        }
        Ok(arena)
    }

    /// An arena over `bytes` of memory at `ptr` that another owns (a GPU's pinned host tier,
    /// whose buffers the CPU's kernels then update in place); never freed by the arena.
    ///
    /// # Safety
    /// `ptr` must hold `bytes` writable bytes, aligned to [`crate::ir::IO_ALIGN`], that
    /// outlive the arena and that nothing else touches while its views are live.
    pub unsafe fn borrowed(ptr: *mut u8, bytes: usize) -> Result<Arena> {
        let layout = Layout::from_size_align(bytes.max(1), crate::ir::IO_ALIGN as usize)?;
        let Some(ptr) = NonNull::new(ptr) else {
            bail!("internal error: an arena over a null pointer");
        };
        if !(ptr.as_ptr() as usize).is_multiple_of(layout.align()) {
            bail!(
                "internal error: borrowed memory not aligned to {} bytes",
                layout.align()
            );
        }
        Ok(Arena {
            ptr,
            layout,
            owned: false,
        })
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    /// A typed view of `elems` elements at byte `offset`.
    ///
    /// # Safety
    /// `offset` must be aligned for `T` and the range in bounds; the caller must not create
    /// a mutable view that overlaps any other live view (the plan guarantees this for
    /// buffers used by one op).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn view_mut<T>(&self, offset: u64, elems: usize) -> &mut [T] {
        let end = offset as usize + elems * std::mem::size_of::<T>();
        assert!(end <= self.len() && (offset as usize).is_multiple_of(std::mem::align_of::<T>()));
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset as usize) as *mut T, elems)
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: allocated in `new` with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
        }
    }
}
