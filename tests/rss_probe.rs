//! The RSS probe the profiler reads after every op, checked against `/proc/self/status`.
//!
//! Alone in its own test binary: the probe reads the whole process's resident set, and tests
//! running beside it in one process (allocating and freeing) would move that figure.

use memwall::profile::record::RssProbe;

#[test]
fn rss_probe_agrees_with_proc_status_and_sees_touched_pages() {
    let probe = RssProbe::open();
    let statm = probe.read();
    let status = memwall::util::rss::current_rss().expect("Linux /proc");
    // Both read the same counter at slightly different moments.
    let diff = (statm as f64 - status as f64).abs();
    assert!(diff < 8e6, "statm {statm} vs VmRSS {status}");
    // Touching 64 MiB shows up.
    let v = std::hint::black_box(vec![1u8; 64 << 20]);
    let after = probe.read();
    assert!(after >= statm + (60 << 20), "{statm} -> {after}");
    assert_eq!(std::hint::black_box(&v)[12345], 1);
}
