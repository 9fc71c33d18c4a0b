//! What the planner asks of a backend ([`Sizing`]): the workspace its kernels need and the
//! scratch its libraries keep for themselves. A backend implements it; the planner takes a
//! `&dyn Sizing` and knows nothing else of the backend that will run the plan.

use super::buffer::Tier;
use super::schedule::OpEntry;
use crate::dtype::DType;

/// What the planner asks of a backend.
pub trait Sizing {
    /// f32 elements of workspace one attention op needs (forward or backward) over `t`
    /// positions with head size `hs` and an optional sliding `window` (keys a query sees at
    /// most) when activations are stored as `storage`, run by `threads` workers (the plan's
    /// `--threads`).
    fn attention_workspace_elems(
        &self,
        storage: DType,
        t: usize,
        hs: usize,
        window: Option<usize>,
        threads: usize,
    ) -> usize;
    /// f32 elements of the tiles matmuls use when operands are not all f32 (mixed precision).
    fn mixed_gemm_workspace_elems(&self) -> usize;
    /// f32 elements of the tile a GEMM on a quantized weight with rows of `cols` values
    /// decodes into (a LoRA plan's quantized base).
    fn quantized_gemm_workspace_elems(&self, cols: usize) -> usize;
    /// Bytes the backend and its libraries allocate for themselves, once, to run `ops` with
    /// activations stored as `storage` on `threads` workers (listed in the plan as an owned
    /// buffer: counted in the compute tier, not packed).
    fn library_scratch_bytes(&self, ops: &[OpEntry], storage: DType, threads: usize) -> u64;
    /// Bytes of scratch the backend keeps in its compute tier for the whole step to run `ops`
    /// with activations stored as `storage` (a GPU's: cuBLASLt's workspace, the weight tile,
    /// the partial sums of its deterministic reductions): a persistent plan buffer
    /// ([`super::schedule::ImplicitBufs::scratch`]), packed like any other; 0 for none.
    fn scratch_bytes(&self, _ops: &[OpEntry], _storage: DType) -> u64 {
        0
    }
    /// One line on how matmuls with operands stored as `storage` are computed, for `plan`
    /// and `bench` (e.g. which bf16 path this machine takes); `None` when there is nothing to say.
    fn compute_note(&self, storage: DType) -> Option<String>;
    /// The tiers this backend plans, fastest first: ops compute on the first, and each
    /// transfer moves a buffer between two adjacent ones. The CPU's: RAM, then the disk.
    fn tiers(&self) -> &'static [Tier] {
        &[Tier::Host, Tier::Nvme]
    }
    /// The tier `--offload` keeps state on between its uses: the one beneath the compute
    /// tier (the CPU's disk, a GPU's pinned host RAM); `None` for a backend of one tier.
    fn offload_tier(&self) -> Option<Tier> {
        self.tiers().get(1).copied()
    }
    /// Bytes of the compute tier the backend holds outside any plan (a GPU's context), the
    /// baseline its peak adds to the plan's; `None` where the baseline is the process's
    /// resident memory, measured when the run plans (the CPU).
    fn baseline_bytes(&self) -> Option<u64> {
        None
    }
}
