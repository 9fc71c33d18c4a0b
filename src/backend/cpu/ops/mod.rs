//! The op → kernel mapping of the CPU backend: the only place that knows which kernel runs an
//! [`Op`](crate::ir::Op). Generic over the plan's storage type `T` (f32, bf16, f16):
//! activations and gradients are `T`; weights are always the fp32 parameters (the master
//! weights under mixed precision: kernels convert them per tile, so no reduced-precision copy
//! is stored); layernorm statistics, attention log-sum-exps, losses and the LM head's logits
//! chunk are f32. Every dimension comes from the op itself; nothing here reads the model.
//!
//! One file per op family ([`OpFamily`]), each a method of [`CpuDevice`] matching that
//! family's ops: [`fill`], [`embedding`], [`norm`], [`linear`], [`attention`] (with RoPE),
//! [`activation`], [`lm_head`], [`adapter`], [`optimizer`] (the gradient norm's share and
//! AdamW). This file holds what they share ([`Args`]: an op's weights, gradients,
//! activations and workspaces; the bound gradients and quantized weights) and the CPU's
//! [`Kernels`], which [`Kernels::run_by_family`] dispatches to.

mod activation;
mod adapter;
mod attention;
mod embedding;
mod fill;
mod linear;
mod lm_head;
mod norm;
mod optimizer;

use super::device::{CpuDevice, two_ranges};
use super::gemm::quantized::QuantWeight;
use crate::backend::{Kernels, StepCtx};
use crate::dtype::Elem;
use crate::ir::schedule::{OpEntry, Rows};
use crate::ir::{BufId, OpFamily};
use std::marker::PhantomData;
use std::ops::Range;

impl Kernels for CpuDevice {
    fn fill<T: Elem>(&self, e: &OpEntry, _ctx: &StepCtx) {
        self.run_fill(e)
    }

    fn embedding<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        self.run_embedding::<T>(e, ctx)
    }

    fn norm<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        self.run_norm::<T>(e, ctx)
    }

    fn linear<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        self.run_linear::<T>(e, ctx)
    }

    fn attention<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        self.run_attention::<T>(e, ctx)
    }

    fn activation<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        self.run_activation::<T>(e, ctx)
    }

    fn lm_head<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        self.run_lm_head::<T>(e, ctx)
    }

    fn adapter<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        self.run_adapter::<T>(e, ctx)
    }

    fn optimizer<T: Elem>(&self, e: &OpEntry, ctx: &StepCtx) {
        self.run_optimizer::<T>(e, ctx)
    }
}

/// The arm of a family's match that [`Kernels::run_by_family`] never reaches: an op of
/// another family.
fn not_of(family: OpFamily, e: &OpEntry) -> ! {
    unreachable!(
        "internal error: op {} ({:?}) is not of family {family:?}",
        e.name,
        e.op.family()
    )
}

/// What the kernels of op `e` take besides the buffers it names, activations stored as `T`:
/// the fp32 (master) weights of its parameter ranges where it is bound to them, its bound
/// gradients, the device's workspaces, and views of its buffers.
struct Args<'a, T> {
    dev: &'a CpuDevice,
    e: &'a OpEntry,
    /// The bound fp32 parameters (empty where the op has none or is bound to a quantized
    /// base), whose element 0 is parameter `base`.
    params: &'a [f32],
    base: usize,
    storage: PhantomData<T>,
}

impl<'a, T: Elem> Args<'a, T> {
    fn new(dev: &'a CpuDevice, e: &'a OpEntry) -> Self {
        // The fp32 (master) weights of the op's parameter ranges, where the op is bound.
        let (params, base): (&[f32], usize) = match e.params {
            Some(b) if dev.dtype(b.buf).ggml().is_none() => (dev.view(b.buf), b.base),
            _ => (&[], 0),
        };
        Args {
            dev,
            e,
            params,
            base,
            storage: PhantomData,
        }
    }

    /// The fp32 weights of parameter range `r`.
    fn weights(&self, r: &Range<usize>) -> &'a [f32] {
        &self.params[r.start - self.base..r.end - self.base]
    }

    /// The gradients of parameter range `r`.
    fn grad(&self, r: &Range<usize>) -> &'a mut [T] {
        self.dev.grad::<T>(self.e, r)
    }

    /// The gradients of two disjoint parameter ranges of one group (a weight and its bias).
    fn grad2(&self, a: &Range<usize>, b: &Range<usize>) -> (&'a mut [T], &'a mut [T]) {
        self.dev.grad2::<T>(self.e, a, b)
    }

    /// The mixed-precision GEMM's f32 tiles (empty in fp32 plans).
    #[allow(clippy::mut_from_ref)]
    fn ws(&self) -> &'a mut [f32] {
        match self.dev.state.gemm_ws {
            Some(id) => self.dev.view::<f32>(id),
            None => &mut [],
        }
    }

    /// The tile a quantized base's weights are decoded into (empty without one).
    #[allow(clippy::mut_from_ref)]
    fn quant_ws(&self) -> &'a mut [f32] {
        match self.dev.state.quant_ws {
            Some(id) => self.dev.view::<f32>(id),
            None => &mut [],
        }
    }

    /// Activation buffer `id`, read.
    fn act(&self, id: BufId) -> &'a [T] {
        &self.dev.view::<T>(id)[..]
    }

    /// The rows' places in their examples (packed rows), `[B, T]` of the op's shape.
    fn positions(&self, p: &Option<BufId>, r: Rows) -> Option<&'a [u32]> {
        p.map(|id| &self.dev.u32_mut(id)[..r.n()])
    }
}

impl CpuDevice {
    /// The gradients of parameter range `r`, in the buffer `e` is bound to.
    #[allow(clippy::mut_from_ref)]
    fn grad<T: Elem>(&self, e: &OpEntry, r: &Range<usize>) -> &mut [T] {
        let b = e
            .grads
            .expect("internal error: an op with gradients has them bound");
        &mut self.view::<T>(b.buf)[b.local(r)]
    }

    /// The gradients of two disjoint parameter ranges of one group (a weight and its bias).
    fn grad2<T: Elem>(
        &self,
        e: &OpEntry,
        a: &Range<usize>,
        c: &Range<usize>,
    ) -> (&mut [T], &mut [T]) {
        let b = e
            .grads
            .expect("internal error: an op with gradients has them bound");
        two_ranges(self.view::<T>(b.buf), b.local(a), b.local(c))
    }

    /// The `[rows, cols]` weight of parameter range `r` where `e` is bound to a quantized
    /// base (a buffer of [`crate::dtype::DType::Ggml`] blocks); `None` where it is bound to
    /// f32.
    fn quant_weight(
        &self,
        e: &OpEntry,
        r: &Range<usize>,
        (rows, cols): (usize, usize),
    ) -> Option<QuantWeight<'_>> {
        let b = e.params?;
        let ty = self.dtype(b.buf).ggml()?;
        let at = |n: usize| {
            ty.bytes_for(n as u64)
                .expect("internal error: a quantized range of whole blocks") as usize
        };
        let start = at(r.start - b.base);
        let bytes = &self.bytes(b.buf)[start..start + at(r.len())];
        Some(
            QuantWeight::new(ty, bytes, rows, cols)
                .expect("internal error: a quantized weight of its shape"),
        )
    }
}
