//! Every CUDA kernel source compiles with NVRTC for the architectures CI checks (sm_80 and
//! sm_90), through the backend's own compile path, and its PTX holds every entry the backend
//! will load. Needs NVRTC's library (`libnvrtc.so.13` on the loader's path: `.ci/run`
//! installs PyPI's `nvidia-cuda-nvrtc==13.0.88`), no GPU and no driver; fails naming the
//! library when it is missing.
#![cfg(feature = "cuda")]

use memwall::backend::cuda::kernels::SOURCES;
use memwall::backend::cuda::nvrtc::{Arch, compile};

#[test]
fn every_kernel_source_compiles_for_every_checked_architecture() {
    assert!(!SOURCES.is_empty());
    let mut failures = Vec::new();
    for src in SOURCES {
        for arch in Arch::CHECKED {
            match compile(src, arch) {
                Ok(ptx) => {
                    let text = ptx.to_src();
                    for name in src.entries() {
                        if !text.contains(&format!(".entry {name}(")) {
                            failures
                                .push(format!("{} ({arch}): no entry {name} in the PTX", src.name));
                        }
                    }
                }
                Err(e) => failures.push(format!("{e:#}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// A source that does not compile is refused naming the file and quoting NVRTC's log.
#[test]
fn a_kernel_that_does_not_compile_is_named_with_the_log() {
    use memwall::backend::cuda::kernels::Source;
    let bad = Source {
        name: "broken.cu",
        text: "extern \"C\" __global__ void broken_f32(float* x) { x[0] = undeclared; }\n",
        per_storage: &[],
        plain: &["broken_f32"],
    };
    let e = format!("{:#}", compile(&bad, Arch::CHECKED[1]).unwrap_err());
    assert!(
        e.contains("broken.cu") && e.contains("sm_90") && e.contains("undeclared"),
        "{e}"
    );
}
