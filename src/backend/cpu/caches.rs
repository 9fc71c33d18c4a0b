//! This machine's cache sizes, read once from sysfs (what the kernel reads from CPUID), with
//! common defaults where it does not say: the blocking of the GEMMs and the plan's count of
//! their scratch follow them.

use std::sync::OnceLock;

/// Bytes of cpu0's level-`level` data (or unified) cache, if sysfs says.
fn sysfs_cache_bytes(level: u32) -> Option<u64> {
    (0..8).find_map(|i| {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{i}");
        let lvl: u32 = std::fs::read_to_string(format!("{dir}/level"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let kind = std::fs::read_to_string(format!("{dir}/type")).ok()?;
        if lvl != level || kind.trim() == "Instruction" {
            return None;
        }
        let s = std::fs::read_to_string(format!("{dir}/size")).ok()?;
        crate::util::bytes::parse_bytes(s.trim()).ok()
    })
}

/// This machine's L2 cache size (cpu0), 1 MiB when sysfs does not say.
pub fn l2_bytes() -> u64 {
    static L2: OnceLock<u64> = OnceLock::new();
    *L2.get_or_init(|| sysfs_cache_bytes(2).unwrap_or(1 << 20))
}
