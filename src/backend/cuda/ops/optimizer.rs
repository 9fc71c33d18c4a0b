//! The optimizer family on the GPU (`kernels/optimizer.cu`), as the CPU's `ops/optimizer.rs`:
//!
//! - [`Op::GradNorm`]: `gradnorm_partials_<S>(g, len, partials)` into the scratch's
//!   `norm_partials` (one f64 per [`GRADNORM_CHUNK`] gradients; blocks of exactly 256, grid
//!   min(parts, 65535)), then `gradnorm_finish(partials, parts, out, slot)` (one block of
//!   256), which WRITES `out[slot]`. An empty range runs only the finish (`out[slot] = 0`).
//! - [`Op::AdamW`]: per tensor ([`ParamSlice`]), by the moments' format: `adamw_m32_<S>`,
//!   `adamw_mbf16_<S>` (grid-stride over the tensor) or `adamw_m8_<S>` (a block of 256 per
//!   QBLOCK of 2048 values); the master weights and gradients at the tensor's range, the
//!   moments at `range.start − state.base`, the 8-bit scales at block `state_block −
//!   state.block_base`, and the step's 9 constants (the CPU's own `adamw::consts`, weight
//!   decay 0 for a tensor without decay). Nothing runs without the
//!   step's update (`ctx.update`: a skipped step; the executor does not run it then either).
//!
//! [`GRADNORM_CHUNK`]: super::super::sizing::GRADNORM_CHUNK

use super::super::gpu::GpuDevice;
use super::super::launch::{BLOCK, grid_stride};
use super::super::launch::{int, launch_kernel};
use super::super::sizing::gradnorm_parts;
use crate::backend::{AdamWStep, StepCtx};
use crate::dtype::DType;
use crate::ir::BufId;
use crate::ir::schedule::{Op, OpEntry, OptimBufs, ParamSlice};
use crate::ir::strategy::OptimState;
use anyhow::{Result, bail};
use cudarc::driver::LaunchConfig;

/// Values per 8-bit block of the moments (the plan's, which `kernels/optimizer.cu` has as
/// QBLOCK = 2048).
const QBLOCK: u64 = crate::ir::strategy::QBLOCK as u64;

/// Threads of the gradient norm's blocks (`GN_THREADS`: the kernels trap on any other).
const GN_THREADS: u32 = 256;

impl GpuDevice {
    /// Runs `e`, an op of the optimizer family.
    pub(in crate::backend::cuda) fn run_optimizer(&self, e: &OpEntry, ctx: &StepCtx) -> Result<()> {
        match &e.op {
            Op::GradNorm {
                range, out, slot, ..
            } => self.grad_norm(e, range, *out, *slot),
            Op::AdamW {
                tensors,
                state,
                scales: None,
            } => {
                let Some(step) = &ctx.update else {
                    return Ok(());
                };
                tensors
                    .iter()
                    .try_for_each(|t| self.adamw_tensor(e, t, state, step))
            }
            // Agreed 8-bit block scales come with tensor ranks, which run on the CPU only.
            Op::AdamW {
                scales: Some(_), ..
            }
            | Op::AdamWBlockMax { .. } => bail!(
                "{}: 8-bit moments of tensor-parallel parts are not run on the GPU yet; use \
                 --device cpu",
                e.name
            ),
            _ => bail!("internal error: {} is not an optimizer op", e.name),
        }
    }

    /// `out[slot] = Σ grad²` (f64) over the gradients of `range`.
    fn grad_norm(
        &self,
        e: &OpEntry,
        range: &std::ops::Range<usize>,
        out: BufId,
        slot: usize,
    ) -> Result<()> {
        let (out, out_bytes) = self.addr(out)?;
        if (slot as u64 + 1) * 8 > out_bytes {
            bail!(
                "internal error: {}: slot {slot} is beyond its {out_bytes}-byte shares",
                e.name
            );
        }
        let slot = int(e, "slot", slot)?;
        let len = range.len() as u64;
        let parts = gradnorm_parts(len);
        let (partials, have) = self.scratch().norm_partials;
        if len > 0 {
            if partials == 0 || have < parts * 8 {
                bail!(
                    "internal error: {}: the backend's scratch has {have} bytes of gradient \
                     norm partials, the op needs {}",
                    e.name,
                    parts * 8
                );
            }
            let (name, f) = self.entry("gradnorm_partials")?;
            let (g, n) = (self.grad_ptr(e, range)?, len as i64);
            // SAFETY: gradnorm_partials_<S>(const T* g, long long len, double* partials): g
            // [len] T (the range's gradients), partials f64 [ceil(len / GN_CHUNK)] (checked).
            launch_kernel!(self, e, name, f, gradnorm_grid(parts), [&g, &n, &partials])?;
        }
        let f = self.plain_kernel("gradnorm_finish")?;
        let parts = parts as i64;
        // SAFETY: gradnorm_finish(const double* partials, long long nparts, double* out, int
        // slot): partials f64 [nparts] from gradnorm_partials (none read when 0), out f64
        // [groups] with slot inside it (checked).
        launch_kernel!(
            self,
            e,
            "gradnorm_finish",
            f,
            single_block(),
            [&partials, &parts, &out, &slot]
        )
    }

    /// AdamW on one tensor, the moments in `state`'s format.
    fn adamw_tensor(
        &self,
        e: &OpEntry,
        t: &ParamSlice,
        state: &OptimBufs,
        step: &AdamWStep,
    ) -> Result<()> {
        let n = t.range.len();
        if n == 0 {
            return Ok(());
        }
        if step.step < 1 {
            bail!(
                "internal error: {}: AdamW step 0 (steps are 1-based)",
                e.name
            );
        }
        // The CPU's constants, the same bits (weight decay zeroed for a tensor without it).
        let hp = AdamWStep {
            weight_decay: if t.decay { step.weight_decay } else { 0.0 },
            ..*step
        };
        let k = crate::backend::cpu::adamw::consts(&hp);
        let Some(local) = t.range.start.checked_sub(state.base) else {
            bail!(
                "internal error: {}: tensor {:?} before its moments' first element {}",
                e.name,
                t.range,
                state.base
            );
        };
        let (p, g) = (
            self.f32_param_ptr(e, &t.range)?,
            self.grad_ptr(e, &t.range)?,
        );
        let len = n as i64;
        let [b1, b2, c1, c2, eps, gs, step_size, inv_sqrt_bc2, decay] = k.args();
        match state.format {
            OptimState::F32 | OptimState::Bf16 => {
                let (elem, stem) = match state.format {
                    OptimState::F32 => (DType::F32, "adamw_m32"),
                    _ => (DType::Bf16, "adamw_mbf16"),
                };
                let m = self.moments(e, state.m, elem, local)?;
                let v = self.moments(e, state.v, elem, local)?;
                let (name, f) = self.entry(stem)?;
                // SAFETY: adamw_m32_<S>(float* p, const T* g, float* m, float* v, long long
                // n, 9 floats) and adamw_mbf16_<S> (bf16 m, v): p f32 [n] (the master weights
                // of the range), g T [n], m, v [n] at the tensor's element.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    grid_stride(n as u64),
                    [
                        &p,
                        &g,
                        &m,
                        &v,
                        &len,
                        &b1,
                        &b2,
                        &c1,
                        &c2,
                        &eps,
                        &gs,
                        &step_size,
                        &inv_sqrt_bc2,
                        &decay
                    ]
                )
            }
            OptimState::Int8 => {
                let (Some(m_scale), Some(v_scale)) = (state.m_scale, state.v_scale) else {
                    bail!("internal error: {}: 8-bit moments without scales", e.name);
                };
                let Some(block) = t.state_block.checked_sub(state.block_base) else {
                    bail!(
                        "internal error: {}: block {} before the scales' first block {}",
                        e.name,
                        t.state_block,
                        state.block_base
                    );
                };
                let mq = self.moments(e, state.m, DType::I8, local)?;
                let vq = self.moments(e, state.v, DType::U8, local)?;
                let ms = self.moments(e, m_scale, DType::F32, block)?;
                let vs = self.moments(e, v_scale, DType::F32, block)?;
                let (name, f) = self.entry("adamw_m8")?;
                // SAFETY: adamw_m8_<S>(float* p, const T* g, signed char* mq, float* ms,
                // unsigned char* vq, float* vs, long long n, 9 floats): p f32 [n], g T [n],
                // mq i8, vq u8 [n] at the tensor's element, ms, vs f32 [ceil(n / 2048)] at its
                // first block.
                launch_kernel!(
                    self,
                    e,
                    name,
                    f,
                    m8_grid(n as u64),
                    [
                        &p,
                        &g,
                        &mq,
                        &ms,
                        &vq,
                        &vs,
                        &len,
                        &b1,
                        &b2,
                        &c1,
                        &c2,
                        &eps,
                        &gs,
                        &step_size,
                        &inv_sqrt_bc2,
                        &decay
                    ]
                )
            }
        }
    }

    /// Device address of element `at` of moment buffer `id`, checked to store `dtype`.
    fn moments(&self, e: &OpEntry, id: BufId, dtype: DType, at: usize) -> Result<u64> {
        let have = self.dtypes[id.0];
        if have != dtype {
            bail!(
                "internal error: {}: an optimizer state buffer of {have}, not {dtype}",
                e.name
            );
        }
        let size = dtype.size().unwrap_or(1) as u64;
        Ok(self.ptr(id)? + at as u64 * size)
    }
}

/// `gradnorm_partials`: blocks of exactly [`GN_THREADS`], one per partial up to 65535.
fn gradnorm_grid(parts: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (parts.clamp(1, 65535) as u32, 1, 1),
        block_dim: (GN_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `gradnorm_finish`: one block of exactly [`GN_THREADS`].
fn single_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (GN_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `adamw_m8`: a block of [`BLOCK`] threads per QBLOCK values, up to 65535 (strided).
fn m8_grid(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(QBLOCK).clamp(1, 65535) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::sizing::GRADNORM_CHUNK;
    use super::*;
    use crate::backend::cpu::adamw;
    use crate::util::rng::Rng;

    fn hp(step: u64, lr: f32, weight_decay: f32) -> AdamWStep {
        AdamWStep {
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay,
            step,
            grad_scale: 0.731,
        }
    }

    /// The kernel's `adam_elem`, op for op (no FMA).
    fn adam_elem(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, k: [f32; 9]) {
        let [b1, b2, c1, c2, eps, gs, step_size, inv_sqrt_bc2, decay] = k;
        let g = g * gs;
        let mi = b1 * *m + c1 * g;
        let vi = b2 * *v + (c2 * g) * g;
        *m = mi;
        *v = vi;
        *p = *p * decay - (step_size * mi) / (vi.sqrt() * inv_sqrt_bc2 + eps);
    }

    /// The constants give, element for element, the CPU's update's bits (f32 moments).
    #[test]
    fn constants_are_the_cpus() {
        let mut r = Rng::new(7);
        for &(step, lr, wd) in &[
            (1, 6e-4, 0.1),
            (2, 3e-4, 0.0),
            (10, 1e-3, 0.01),
            (1000, 6e-4, 0.1),
            (123457, 2.5e-5, 0.3),
        ] {
            for decay in [false, true] {
                let h = hp(step, lr, wd);
                let n = 4096;
                let p0: Vec<f32> = (0..n).map(|_| r.normal()).collect();
                let g: Vec<f32> = (0..n).map(|_| r.normal() * 3.0).collect();
                let m0: Vec<f32> = (0..n).map(|_| r.normal() * 0.1).collect();
                let v0: Vec<f32> = (0..n).map(|_| r.next_f32() * 0.01).collect();
                let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                let cpu = AdamWStep {
                    weight_decay: if decay { wd } else { 0.0 },
                    ..h
                };
                adamw::adamw_update(&mut p, &g, &mut m, &mut v, &cpu);
                let k = adamw::consts(&cpu).args();
                for i in 0..n {
                    let (mut pi, mut mi, mut vi) = (p0[i], m0[i], v0[i]);
                    adam_elem(&mut pi, g[i], &mut mi, &mut vi, k);
                    assert_eq!(pi.to_bits(), p[i].to_bits(), "p, step {step} decay {decay}");
                    assert_eq!(mi.to_bits(), m[i].to_bits(), "m");
                    assert_eq!(vi.to_bits(), v[i].to_bits(), "v");
                }
            }
        }
        let k = adamw::consts(&hp(3, 1e-3, 0.0)).args();
        assert_eq!(k[8], 1.0, "no decay");
    }

    #[test]
    fn launch_shapes() {
        // The kernels' QBLOCK and GN_CHUNK.
        assert_eq!(QBLOCK, 2048);
        assert_eq!(GRADNORM_CHUNK, 16384);
        assert_eq!(m8_grid(1).grid_dim.0, 1);
        assert_eq!(m8_grid(2049).grid_dim.0, 2);
        assert_eq!(m8_grid(2048 * 70000).grid_dim.0, 65535);
        assert_eq!(m8_grid(5).block_dim.0, 256);
        assert_eq!(gradnorm_parts(0), 0);
        assert_eq!(gradnorm_parts(16384), 1);
        assert_eq!(gradnorm_parts(16385), 2);
        assert_eq!(gradnorm_grid(3).grid_dim.0, 3);
        assert_eq!(gradnorm_grid(0).grid_dim.0, 1);
        assert_eq!(gradnorm_grid(100_000).grid_dim.0, 65535);
        assert_eq!(gradnorm_grid(3).block_dim.0, 256);
        assert_eq!(single_block().block_dim.0, 256);
    }
}
