//! The host's AdamW rate, for plans whose updates run on the host's cores beneath a GPU
//! ([`crate::ir::schedule::OpEntry::runs_on_host`]; kinds `host_adamw.<state>/<storage>` of
//! the time model). `memwall calibrate --device cuda` measures it beside the GPU's suite:
//! the CPU's own AdamW kernel on the calibration's threads, over f32 master weights and
//! moments of a few sizes, with gradients in each storage type, fitted per byte moved as
//! [`crate::plan::time::op_bytes`] counts them (the other moment formats are priced per byte
//! at the f32 state's rate).

use super::calibrate_fit::{Sample, fit};
use crate::backend::AdamWStep;
use crate::backend::cpu::adamw::adamw_update;
use crate::dtype::{DType, Elem};
use crate::ir::OptimState;
use crate::plan::time::Cost;
use anyhow::Result;
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::time::Instant;

/// Parameters per timed update: small enough to take a second in all, large enough that the
/// largest is far past the host's caches.
const SIZES: [usize; 3] = [1 << 20, 4 << 20, 16 << 20];

/// The fitted cost of the host's AdamW (f32 moments) by gradient storage type, as the kinds
/// `host_adamw.fp32/<storage>` ([`crate::plan::time::op_kind`]'s), on `threads` workers.
pub fn measure(threads: usize) -> Result<BTreeMap<String, Cost>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| crate::util::threads::refused("the host's AdamW threads", e))?;
    let mut kinds = BTreeMap::new();
    pool.install(|| {
        kinds.insert(kind(DType::F32), fit_kind::<f32>());
        kinds.insert(kind(DType::Bf16), fit_kind::<bf16>());
        kinds.insert(kind(DType::F16), fit_kind::<f16>());
    });
    Ok(kinds)
}

/// The kind of a host update of f32 moments with gradients stored as `storage`, spelled as
/// the time model spells it.
pub fn kind(storage: DType) -> String {
    format!("host_adamw.{}/{storage}", OptimState::F32)
}

/// Times the update with gradients stored as `G` over each of [`SIZES`] (one warm-up, then
/// the fastest of three) and fits the samples.
fn fit_kind<G: Elem>() -> Cost {
    let hp = AdamWStep {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
        grad_scale: 1.0,
    };
    let samples: Vec<Sample> = SIZES
        .iter()
        .map(|&n| {
            let (mut p, mut m, mut v) = (vec![0.5f32; n], vec![0.0f32; n], vec![0.0f32; n]);
            let g = vec![G::from_f32(1e-3); n];
            let mut best = f64::INFINITY;
            for round in 0..4 {
                let t0 = Instant::now();
                adamw_update(&mut p, &g, &mut m, &mut v, &hp);
                if round > 0 {
                    best = best.min(t0.elapsed().as_secs_f64());
                }
            }
            // Bytes as the time model counts them: parameters read and written, gradients
            // read, both moments read and written.
            let bytes = n as f64 * (8.0 + std::mem::size_of::<G>() as f64 + 16.0);
            Sample {
                kind: String::new(),
                flops: 0.0,
                bytes,
                secs: best,
            }
        })
        .collect();
    fit(&samples.iter().collect::<Vec<_>>())
}

#[cfg(test)]
mod tests {
    use crate::backend::DeviceKind;
    use crate::dtype::DType;
    use crate::ir::{Precision, Tier};
    use crate::model::ModelSpec;
    use crate::plan::time::op_kind;
    use crate::plan::{Mode, OffloadSet, StepConfig, build_plan};

    /// The kinds measured are those the time model asks for a GPU plan's host updates, in
    /// each storage type.
    #[test]
    fn the_kinds_measured_are_the_host_updates_kinds() {
        let spec = ModelSpec::preset("gpt2-tiny").unwrap();
        for (precision, storage) in [
            (Precision::F32, DType::F32),
            (Precision::Bf16, DType::Bf16),
            (Precision::F16, DType::F16),
        ] {
            let mut cfg = StepConfig::new(1, 32, 1);
            cfg.offload.set = OffloadSet::ALL;
            cfg.precision = precision;
            let p = build_plan(&spec, &cfg, Mode::Train, DeviceKind::Cuda.sizing()).unwrap();
            let ops = &p.schedule.ops;
            let e = ops
                .iter()
                .find(|e| e.runs_on_host(&p.buffers, Tier::Device));
            assert_eq!(op_kind(&p, e.unwrap()).unwrap(), super::kind(storage));
        }
    }

    /// The measurement fits a positive per-byte rate for each storage type (its figures are
    /// the machine's: not checked here).
    #[test]
    fn the_host_update_is_fitted_per_byte_for_each_storage_type() {
        let kinds = super::measure(1).unwrap();
        let names: Vec<&str> = kinds.keys().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "host_adamw.fp32/bf16",
                "host_adamw.fp32/f16",
                "host_adamw.fp32/f32"
            ]
        );
        for (kind, c) in &kinds {
            assert!(c.s_per_byte > 0.0 || c.s_per_op > 0.0, "{kind}: {c:?}");
            c.check(kind).unwrap();
        }
    }
}
