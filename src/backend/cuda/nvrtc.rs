//! Kernel sources to PTX with NVRTC ([`compile`]), and the on-disk cache the backend loads
//! them from ([`cached`]: one file per source, architecture and NVRTC version, keyed by a
//! hash of the three). NVRTC needs no GPU or driver, only its library (`libnvrtc.so.13`,
//! found by the dynamic loader: `LD_LIBRARY_PATH` for a pip-installed one); it is probed
//! first, so a missing library is an error naming it, never cudarc's panic.

use super::kernels::Source;
use crate::backend::Unavailable;
use anyhow::{Context, Result, anyhow};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// A GPU architecture the kernels are compiled for: compute capability `major.minor`
/// (8.0 the A100, 9.0 the H100 and H200).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
}

impl Arch {
    /// The architectures CI compiles every source for.
    pub const CHECKED: [Arch; 2] = [Arch { major: 8, minor: 0 }, Arch { major: 9, minor: 0 }];

    /// NVRTC's virtual architecture (`compute_90`): PTX the driver compiles for the card.
    fn virtual_arch(self) -> &'static str {
        // CompileOptions wants a 'static str; the architectures are few.
        match (self.major, self.minor) {
            (7, 0) => "compute_70",
            (7, 5) => "compute_75",
            (8, 0) => "compute_80",
            (8, 6) => "compute_86",
            (8, 7) => "compute_87",
            (8, 9) => "compute_89",
            (9, 0) => "compute_90",
            (10, 0) => "compute_100",
            (12, 0) => "compute_120",
            _ => "compute_80",
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// Refuses, naming the library, when NVRTC cannot be loaded.
pub fn probe() -> Result<()> {
    // SAFETY: only loads the library (dlopen) and drops it.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    Err(Unavailable(
        "NVRTC (libnvrtc.so.13, the CUDA 13 runtime compiler) could not be loaded: install the \
         CUDA toolkit, or `python3 -m pip install nvidia-cuda-nvrtc==13.0.88` and add its \
         nvidia/cu13/lib folder to LD_LIBRARY_PATH"
            .into(),
    )
    .into())
}

/// Compiles `src` (after the prelude) to PTX for `arch`; an error names the source, the
/// architecture and NVRTC's log.
pub fn compile(src: &Source, arch: Arch) -> Result<Ptx> {
    probe()?;
    let opts = CompileOptions {
        arch: Some(arch.virtual_arch()),
        options: vec!["--std=c++17".into()],
        name: Some(src.name.into()),
        ..CompileOptions::default()
    };
    compile_ptx_with_opts(src.full_text(), opts).map_err(|e| match e {
        CompileError::CompileError { log, .. } => anyhow!(
            "CUDA kernel source {} does not compile for {arch} (NVRTC's log):\n{}",
            src.name,
            log.to_string_lossy()
        ),
        other => anyhow!(
            "CUDA kernel source {}: NVRTC failed for {arch}: {other:?}",
            src.name
        ),
    })
}

/// NVRTC's version, `(major, minor)`.
pub fn version() -> Result<(i32, i32)> {
    probe()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow!("NVRTC's version: {e:?}"))?;
    Ok((major, minor))
}

/// The PTX of `src` for `arch`, from the user's cache (`~/.cache/memwall/cuda/`) when an
/// earlier run compiled the same text with the same NVRTC, else compiled and kept there.
/// The cache is an optimisation only: a failure to read or write it compiles again.
pub fn cached(src: &Source, arch: Arch) -> Result<Ptx> {
    let (major, minor) = version()?;
    let key = {
        let mut h = Sha256::new();
        h.update(src.full_text().as_bytes());
        h.update(format!("\0{arch}\0nvrtc {major}.{minor}").as_bytes());
        let d = h.finalize();
        d.iter()
            .take(16)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let path: Option<PathBuf> = crate::util::cache::memwall_cache()
        .map(|d| d.join("cuda").join(format!("{}-{key}.ptx", src.name)));
    if let Some(p) = &path
        && let Ok(text) = std::fs::read_to_string(p)
    {
        return Ok(Ptx::from_src(text));
    }
    let ptx = compile(src, arch)?;
    if let Some(p) = &path {
        let write = || -> Result<()> {
            std::fs::create_dir_all(crate::util::atomic::parent_dir(p))
                .with_context(|| format!("creating {}", p.display()))?;
            crate::util::atomic::write_file(p, ptx.to_src().as_bytes())
        };
        // A cache that cannot be written is not an error: the next start compiles again.
        let _ = write();
    }
    Ok(ptx)
}
