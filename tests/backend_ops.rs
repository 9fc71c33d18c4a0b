//! The backend conformance suite: every op kind a backend runs, checked through
//! `&dyn Backend` alone, so a second backend inherits every op's test (candle's
//! `test_device!` habit, turned around: candle writes one line per op listing the devices;
//! here one line per backend instantiates every op).
//!
//! Each check builds a small plan by hand (`backend_ops/rig.rs`: the buffers the op needs,
//! packed and verified as the planner's are), starts it with `Backend::start`, fills the
//! inputs with `Device::upload`, runs the op with `Device::run` (a collective among ranks
//! started with a `Local` group, then its `AwaitCollective`), reads the outputs with
//! `Device::download`, and compares them
//! with a reference written in the check in plain f64 loops from the op's documented formula
//! (`backend_ops/layers.rs`, `backend_ops/state.rs`), never with the CPU kernels.
//!
//! A new backend adds one line: `backend_suite!(name, expression giving the backend)`
//! (the expression is evaluated once per test; anything that coerces to `&dyn Backend` by
//! reference works). It runs every storage precision a plan can have (fp32, bf16, fp16):
//! a backend that cannot start a plan of one fails those tests, rather than skipping them.
//!
//! Tolerances, in units of the storage type's unit roundoff u (bf16 2^-8, f16 2^-11; the
//! most rounding to nearest moves a value): an output computed elementwise in f32 and
//! stored once within u·(1 + 1/64) relative (`rig::rounded`; f32: 2e-6); a sum of products
//! (matmuls, attention, the norms' backward, the LM head), whose operands a backend may
//! round to the storage type (the fp32 weights too), within that plus 2u of the largest
//! output (`rig::reduced`; f32: 2e-6 of it); a sum over ranks within u plus u of the largest
//! (f32: 1e-6). Whatever the storage: f32 statistics (mean, rstd, lse) 1e-5 relative; AdamW's
//! parameters 1e-6, f32 moments 1e-6 (+1e-7 of the largest, for cancellation), bf16 moments
//! the bf16 u, int8 codes the format's own bound (a level every 2^(1/8): 2^(1/16) − 1);
//! the gradient norm's share 1e-5. Values an op must leave alone, copies (all-gather,
//! transfers) and zeroing: bitwise.
//!
//! Every kind of `ir::Op` has a check (`rig::kind` names them all without a wildcard, so a
//! new kind stops the suite compiling until it is named there); `AwaitCollective` is checked
//! with the collectives, which read their results after it and nothing else. Narrower than the op: `LmHeadLast`
//! and `StepCtx::seq` (a prefix of each sequence) are checked in fp32 only, the only
//! precision of generation plans, their one user. The collectives are started and awaited
//! in one place (`state::run_collective`).
//!
//! LoRA's ops (`backend_ops/adapters.rs`): an adapter's forward and backward on a column
//! window of a wider output, and the frozen layers' backward (the entry's `frozen`: the
//! input gradient bitwise the trained op's, the gradients untouched).
//!
//! That the checks can fail: `mod flawed` runs some of them on a backend that gets one thing
//! wrong before the backend under test runs the op (a transposed weight, RoPE turned the wrong
//! way, the loss scale or the weight decay ignored, a norm's epsilon, an element left
//! unwritten, the rows of a sequence misread, gradients overwritten instead of added to,
//! Gemma's gain offset, residual, GeGLU or embedding scale ignored), and each must fail with
//! the checks' mismatch message; the same wrapper without a flaw passes.

mod backend_ops {
    pub mod adapters;
    pub mod flawed;
    pub mod layers;
    pub mod rig;
    pub mod state;
    pub mod vocab;
}

use backend_ops::{adapters, layers, state, vocab};
use memwall::ir::Precision;

/// The checks that run at every storage precision, by name (each `fn(&dyn Backend,
/// Precision)` of `layers` or `state`), each test carrying `$attr` (`cfg(all())`, which
/// changes nothing, or an `ignore` saying what the backend needs).
macro_rules! storage_checks {
    ($backend:expr, $p:expr, $attr:meta; $($module:ident :: $check:ident),* $(,)?) => {
        $(
            #[test]
            #[$attr]
            fn $check() {
                $module::$check(&$backend, $p)
            }
        )*
    };
}

/// Every op check for one backend: `backend_suite!(name, expression giving the backend)`
/// makes module `name` with a module per storage precision (`fp32`, `bf16`, `fp16`), one for
/// what only fp32 plans have (`fp32_generation`), the transfers between tiers, the
/// collectives among ranks and the tensor-parallel vocabulary's ops (`vocab`). `backend_suite!(@one_process name, expression, attribute)` makes
/// the compute ops' checks and the transfers only (a backend of one process: the CUDA
/// backend's today), each test with the attribute (`ignore = "needs ..."`).
macro_rules! backend_suite {
    ($name:ident, $backend:expr) => {
        mod $name {
            use super::*;

            /// Checks of ops that only fp32 plans have (generation's `LmHeadLast`).
            mod fp32_generation {
                use super::*;
                storage_checks!($backend, Precision::F32, cfg(all()); layers::lm_head_last);
            }

            /// Checks that hold whatever the storage type (bytes moved between tiers).
            #[test]
            fn transfers() {
                state::transfers(&$backend)
            }

            backend_suite!(@storage $backend, fp32, Precision::F32, cfg(all()), ranks);
            backend_suite!(@storage $backend, bf16, Precision::Bf16, cfg(all()), ranks);
            backend_suite!(@storage $backend, fp16, Precision::F16, cfg(all()), ranks);
        }
    };
    (@one_process $name:ident, $backend:expr, $attr:meta) => {
        mod $name {
            use super::*;

            mod fp32_generation {
                use super::*;
                storage_checks!($backend, Precision::F32, $attr; layers::lm_head_last);
            }

            #[test]
            #[$attr]
            fn transfers() {
                state::transfers(&$backend)
            }

            backend_suite!(@storage $backend, fp32, Precision::F32, $attr, one_process);
            backend_suite!(@storage $backend, bf16, Precision::Bf16, $attr, one_process);
            backend_suite!(@storage $backend, fp16, Precision::F16, $attr, one_process);
        }
    };
    (@storage $backend:expr, $module:ident, $p:expr, $attr:meta, $ranks:ident) => {
        mod $module {
            use super::*;
            storage_checks!($backend, $p, $attr;
                layers::zero,
                layers::encoder,
                layers::encoder_backward,
                layers::layernorm,
                layers::layernorm_backward,
                layers::rmsnorm,
                layers::rmsnorm_backward,
                layers::qk_norm,
                layers::qk_norm_backward,
                layers::matmul,
                layers::matmul_backward,
                layers::attention,
                layers::attention_backward,
                layers::rope,
                layers::rope_inverse,
                layers::glu,
                layers::glu_backward,
                layers::gelu,
                layers::gelu_backward,
                layers::lm_head_loss,
                layers::lm_head_eval,
                adapters::lora_forward,
                adapters::lora_backward,
                adapters::frozen_backward,
                adapters::add_bias,
                state::grad_norm,
                state::adamw_f32_state,
                state::adamw_bf16_state,
                state::adamw_int8_state,
            );
            backend_suite!(@$ranks $backend, $p, $attr);
        }
    };
    // What only the CPU backend runs yet: collectives, distillation's head, the head's
    // weight gradient taken after the backward (`--update in-backward`), and 8-bit AdamW of
    // tensor-parallel parts.
    (@ranks $backend:expr, $p:expr, $attr:meta) => {
        storage_checks!($backend, $p, $attr;
            layers::lm_head_distill,
            layers::lm_head_weight_grad,
            state::adamw_int8_part,
            state::all_reduce,
            state::reduce_scatter,
            state::all_gather,
            state::stage_send_recv,
            vocab::encoder_vocab_part,
            vocab::lm_head_vocab_parallel,
        );
    };
    (@one_process $backend:expr, $p:expr, $attr:meta) => {};
}

backend_suite!(cpu, memwall::backend::cpu::Cpu);

// The CUDA backend on GPU 0 (feature `cuda`): needs a GPU, so its checks are ignored here
// and run by `scripts/gpu-check.sh` on a GPU machine (`--ignored`); without one each fails
// naming what is missing. One process: no collectives yet.
#[cfg(feature = "cuda")]
backend_suite!(@one_process cuda, *memwall::backend::cuda::open(0).expect("a CUDA GPU"), ignore = "needs a CUDA GPU (scripts/gpu-check.sh)");

/// The LM head over a vocabulary, and a linear layer, that the CUDA backend's weight tile holds
/// a chunk of at a time (`layers::lm_head_loss_wide`, `layers::matmul_wide`): 72M and 71M
/// parameters, too slow for every `cargo test`,
/// so run when asked (`--ignored`): on the backend under test (`MEMWALL_TEST_DEVICE`), and
/// on GPU 0 by `scripts/gpu-check.sh` (its `cuda::` filter).
mod wide_weights {
    use super::*;

    #[test]
    #[ignore = "a 72M-parameter head, slow for every cargo test: run with --ignored"]
    fn lm_head_loss_wide() {
        for p in [Precision::Bf16, Precision::F16] {
            layers::lm_head_loss_wide(memwall::backend::under_test(), p);
        }
    }

    #[test]
    #[ignore = "a 71M-parameter weight, slow for every cargo test: run with --ignored"]
    fn matmul_wide() {
        layers::matmul_wide(memwall::backend::under_test(), Precision::Bf16);
    }

    #[cfg(feature = "cuda")]
    mod cuda {
        use super::*;

        #[test]
        #[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
        fn lm_head_loss_wide() {
            let gpu = memwall::backend::cuda::open(0).expect("a CUDA GPU");
            for p in [Precision::Bf16, Precision::F16] {
                layers::lm_head_loss_wide(gpu, p);
            }
        }

        #[test]
        #[ignore = "needs a CUDA GPU (scripts/gpu-check.sh)"]
        fn matmul_wide() {
            let gpu = memwall::backend::cuda::open(0).expect("a CUDA GPU");
            layers::matmul_wide(gpu, Precision::Bf16);
        }
    }
}

/// The checks failing on a flawed backend (see `backend_ops/flawed.rs`).
mod flawed {
    use super::backend_ops::flawed::{Flaw, Flawed};
    use super::*;
    use memwall::ir::Op;
    use memwall::ir::schedule::WeightLayout;

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn a_transposed_weight_fails_in_bf16() {
        let flaw = Flaw::Op(|op, _| {
            if let Op::Matmul { layout, .. } = op {
                *layout = match layout {
                    WeightLayout::InOut => WeightLayout::OutIn,
                    WeightLayout::OutIn => WeightLayout::InOut,
                };
            }
        });
        layers::matmul(&Flawed(flaw), Precision::Bf16)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn rope_turned_the_wrong_way_fails_in_bf16() {
        let flaw = Flaw::Op(|op, _| {
            if let Op::Rope { inverse, .. } = op {
                *inverse = !*inverse;
            }
        });
        layers::rope(&Flawed(flaw), Precision::Bf16)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn an_ignored_loss_scale_fails_in_bf16() {
        let flaw = Flaw::Op(|_, ctx| ctx.loss_scale = 1.0);
        layers::lm_head_loss(&Flawed(flaw), Precision::Bf16)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn misread_rows_fail_attention_in_bf16() {
        // The rows read as sequences of 4: keys and values come from the wrong rows.
        let flaw = Flaw::Op(|_, ctx| ctx.seq = Some(4));
        layers::attention(&Flawed(flaw), Precision::Bf16)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn overwritten_gradients_fail_in_bf16() {
        // What an op that overwrote its gradients instead of adding to them would leave.
        layers::encoder_backward(&Flawed(Flaw::ZeroGradsFirst), Precision::Bf16)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn a_dropped_weight_decay_fails_in_f32() {
        let flaw = Flaw::Op(|_, ctx| {
            if let Some(u) = &mut ctx.update {
                u.weight_decay = 0.0;
            }
        });
        state::adamw_f32_state(&Flawed(flaw), Precision::F32)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn another_epsilon_fails_layernorm_in_f32() {
        let flaw = Flaw::Op(|op, _| {
            if let Op::LayerNorm { eps, .. } = op {
                *eps = 1e-3;
            }
        });
        layers::layernorm(&Flawed(flaw), Precision::F32)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn an_element_left_unwritten_fails_in_f32() {
        // GELU over one element fewer: the last one keeps the value it had.
        let flaw = Flaw::Op(|op, _| {
            if let Op::Gelu { width, .. } = op {
                *width -= 1;
            }
        });
        layers::gelu(&Flawed(flaw), Precision::F32)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn a_dropped_gain_offset_fails_rmsnorm_in_bf16() {
        // Gemma's 1 + w computed as w.
        let flaw = Flaw::Op(|op, _| {
            if let Op::RmsNorm { offset, .. } = op {
                *offset = 0.0;
            }
        });
        layers::rmsnorm(&Flawed(flaw), Precision::Bf16)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn a_dropped_gain_offset_fails_qk_norm_backward_in_bf16() {
        let flaw = Flaw::Op(|op, _| {
            if let Op::QkNormBackward { offset, .. } = op {
                *offset = 0.0;
            }
        });
        layers::qk_norm_backward(&Flawed(flaw), Precision::Bf16)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn a_dropped_residual_fails_rmsnorm_in_f32() {
        let flaw = Flaw::Op(|op, _| {
            if let Op::RmsNorm { residual, .. } = op {
                *residual = None;
            }
        });
        layers::rmsnorm(&Flawed(flaw), Precision::F32)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn geglu_run_as_swiglu_fails_in_bf16() {
        let flaw = Flaw::Op(|op, _| {
            if let Op::GluBackward { act, .. } = op {
                *act = memwall::ir::schedule::GluAct::Silu;
            }
        });
        layers::glu_backward(&Flawed(flaw), Precision::Bf16)
    }

    #[test]
    #[should_panic(expected = "does not match the reference")]
    fn an_unscaled_embedding_gradient_fails_in_bf16() {
        let flaw = Flaw::Op(|op, _| {
            if let Op::EncoderBackward { scale, .. } = op {
                *scale = 1.0;
            }
        });
        layers::encoder_backward(&Flawed(flaw), Precision::Bf16)
    }

    /// The wrapper without a flaw passes the same checks: the failures above are the flaws'.
    #[test]
    fn the_wrapper_alone_passes() {
        let honest = Flawed(Flaw::Op(|_, _| {}));
        layers::matmul(&honest, Precision::Bf16);
        layers::rope(&honest, Precision::Bf16);
        layers::lm_head_loss(&honest, Precision::Bf16);
        layers::attention(&honest, Precision::Bf16);
        layers::encoder_backward(&honest, Precision::Bf16);
        state::adamw_f32_state(&honest, Precision::F32);
        layers::layernorm(&honest, Precision::F32);
        layers::gelu(&honest, Precision::F32);
        layers::rmsnorm(&honest, Precision::Bf16);
        layers::rmsnorm(&honest, Precision::F32);
        layers::qk_norm_backward(&honest, Precision::Bf16);
        layers::glu_backward(&honest, Precision::Bf16);
    }
}
