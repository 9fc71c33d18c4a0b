//! The op → kernel mapping of the CUDA backend, one file per op family
//! ([`crate::ir::OpFamily`]), as the CPU backend's `ops`: each `run_<family>` launches the
//! kernels of `kernels/<family>.cu` (and cuBLASLt's GEMMs) for one op on the device's stream.
//! A family whose host side is not written yet refuses its ops by name ([`not_yet`]).

mod activation;
mod adapter;
mod attention;
mod embedding;
mod fill;
mod linear;
mod lm_head;
mod norm;
mod optimizer;

pub(super) use attention::{RopeTables, prepare_rope};

use crate::ir::schedule::OpEntry;
use anyhow::{Result, bail};

/// Refuses `e`: its family does not run on the GPU yet.
pub(super) fn not_yet(e: &OpEntry) -> Result<()> {
    bail!(
        "{}: the CUDA backend does not run {:?} ops yet (issue #45: the kernels are written, \
         their host side is wired family by family); use --device cpu",
        e.name,
        e.op.family()
    )
}
