//! The op → kernel mapping of the CUDA backend, one file per op family
//! ([`crate::ir::OpFamily`]), as the CPU backend's `ops`: each `run_<family>` launches the
//! kernels of `kernels/<family>.cu` (and cuBLASLt's GEMMs) for one op on the device's stream.
//! Every family is wired; none has run on a GPU yet (issue #45: `scripts/gpu-check.sh`).

mod activation;
mod adapter;
mod attention;
mod embedding;
mod fill;
mod linear;
mod lm_head;
mod norm;
mod optimizer;
