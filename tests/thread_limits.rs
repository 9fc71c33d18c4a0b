//! A thread the system refuses (here: no address space left for its stack, as under a tight
//! `ulimit -v`) is an error naming the thread and the limit, not a panic. Alone in its test
//! binary: the limit it sets is the whole process's.

mod common;

use memwall::data::loader::BatchLoader;
use memwall::data::shard::Shard;
use std::sync::Arc;

fn address_space_in_use() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize in /proc/self/status");
    kb * 1024
}

#[test]
fn a_data_loader_thread_the_system_refuses_is_an_error_naming_the_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let data = common::prepared(tmp.path(), &common::small_corpus(tmp.path()));
    let shard = Arc::new(Shard::open(&data.join("train.bin")).unwrap());
    // Room for small allocations, none for a thread's stack (2 MiB).
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    let tight = libc::rlimit {
        rlim_cur: address_space_in_use() + (512 << 10),
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: get/setrlimit on structs owned here.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_AS, &mut old), 0);
        let tight = libc::rlimit {
            rlim_max: old.rlim_max,
            ..tight
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_AS, &tight), 0);
    }
    let result = BatchLoader::new(shard.clone(), 2, 16, 1, 0);
    // SAFETY: as above; the soft limit goes back to what it was.
    unsafe {
        assert_eq!(libc::setrlimit(libc::RLIMIT_AS, &old), 0);
    }
    let e = format!("{:#}", result.err().expect("the thread cannot start"));
    assert!(
        e.contains("the data loader thread") && e.contains("ulimit -v"),
        "{e}"
    );
    // With the limit lifted, the same loader starts.
    BatchLoader::new(shard, 2, 16, 1, 0).unwrap();
}
