//! Process memory readings from `/proc/self/status` (Linux). Other systems report `None`.

/// Reads a `kB` field such as `VmRSS` or `VmHWM` from `/proc/self/status`, in bytes.
fn status_field(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kb * 1024)
    })
}

/// Current resident set size in bytes.
pub fn current_rss() -> Option<u64> {
    status_field("VmRSS")
}

/// Peak resident set size ("high-water mark") of this process in bytes.
pub fn peak_rss() -> Option<u64> {
    status_field("VmHWM")
}

/// Resets the kernel's peak-RSS counter to the current RSS (Linux ≥ 4.0, writes
/// `/proc/self/clear_refs`). Returns false when the kernel refuses.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The memory the kernel says is available for new work without swapping (`MemAvailable`
/// in `/proc/meminfo`), in bytes; `None` where it cannot be read.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}
