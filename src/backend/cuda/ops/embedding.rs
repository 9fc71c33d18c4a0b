//! The embedding family on the GPU: not wired yet.

use super::super::gpu::GpuDevice;
use super::not_yet;
use crate::backend::StepCtx;
use crate::ir::schedule::OpEntry;
use anyhow::Result;

impl GpuDevice {
    /// Runs `e`, an op of the embedding family.
    pub(in crate::backend::cuda) fn run_embedding(
        &self,
        e: &OpEntry,
        _ctx: &StepCtx,
    ) -> Result<()> {
        not_yet(e)
    }
}
