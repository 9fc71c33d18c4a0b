//! The fill family ([`OpFamily::Fill`]) on the CPU: [`Op::Zero`] clears a buffer.

use super::not_of;
use crate::backend::cpu::device::CpuDevice;
use crate::ir::OpFamily;
use crate::ir::schedule::{Op, OpEntry};

impl CpuDevice {
    /// Runs `e`, an op of [`OpFamily::Fill`].
    pub(super) fn run_fill(&self, e: &OpEntry) {
        match &e.op {
            Op::Zero { buf } => self.zero(*buf),
            _ => not_of(OpFamily::Fill, e),
        }
    }
}
