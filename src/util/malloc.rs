//! Allocator settings for training processes (glibc), and handing freed memory back.
//!
//! The `gemm` crate allocates its packing scratch (at most a few MiB per call, see
//! `plan::build::gemm_packing_bytes`) on every call. With glibc's default, adaptive mmap
//! threshold, blocks of that size may be mapped and unmapped on every call: a page fault
//! per 4 KiB, every GEMM. A fixed threshold above those blocks and a high trim threshold keep
//! them in the heap, reused, so the scratch is resident once (and counted by the plan).

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
            mallopt(M_MMAP_THRESHOLD, 16 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        true
    }
}
