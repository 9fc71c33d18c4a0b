//! `memwall calibrate`: measure what this machine does per second, once, for the step-time
//! model ([`crate::plan::time`]).
//!
//! It trains a suite of small models (GPT-2 and Llama shaped, 2 blocks, a 4096-token
//! vocabulary, widths from 256 to 2048, 512 to 2048 rows) for one warm-up and one timed step
//! in every storage precision, and a small one in every optimizer-state format, with every op
//! timed. Per op kind it fits `seconds = s_per_flop · flops + s_per_byte · bytes + s_per_op`
//! (non-negative least squares on relative error). It then measures the offload directory's
//! disk ([`crate::mem::probe`]) and the FMA peak, and saves the whole as JSON in the user
//! cache, one file per thread count. The ops run through the executor on the real backend,
//! so what is fitted is what a training step runs.
//!
//! A saved file is checked when it is loaded ([`load`]; the transport's too): one that does
//! not parse, or has values no calibration produces (a negative, NaN or infinite coefficient,
//! a disk rate of 0, no threads), is refused naming the file, the field and the command that
//! remakes it, rather than predicting negative or infinite times.

use super::calibrate_fit::{Sample, fit};
use super::executor::{Executor, OptimHparams};
use crate::backend::{Backend, DeviceId};
use crate::dtype::GgmlType;
use crate::ir::BaseQuant;
use crate::ir::{OptimState, Precision};
use crate::model::ModelSpec;
use crate::model::lora::{LoraSpec, Target};
use crate::plan::time::{Bandwidth, Calibration, Cost, Source, op_bytes, op_kind};
use crate::plan::{Mode, StepConfig, build_plan};
use crate::profile::OpRecorder;
use crate::util::clock::utc_now;
use crate::util::machine::cpu_name;
use crate::util::rng::Rng;
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What to calibrate.
#[derive(Clone, Debug)]
pub struct CalibrateOptions {
    pub threads: usize,
    /// Directory whose disk is measured (the offload file's); `None`: not measured.
    pub offload_dir: Option<PathBuf>,
    /// A few seconds instead of a minute: fp32 only, the three smallest models of the suite
    /// (kinds it misses are estimated from the FMA peak, and predictions say so).
    pub quick: bool,
    /// The backend measured.
    pub device: DeviceId,
}

/// One model of the suite: a preset's family with these dimensions, at `b × t`.
struct Case {
    preset: &'static str,
    c: usize,
    heads: usize,
    kv_heads: usize,
    mlp: usize,
    b: usize,
    t: usize,
}

/// The suite: widths and row counts around those of the presets (hd 64 and 128; GPT-2's
/// 4·C MLP, Llama's 8/3·C SwiGLU with grouped-query attention).
const SUITE: [Case; 7] = [
    Case {
        preset: "gpt2",
        c: 256,
        heads: 4,
        kv_heads: 4,
        mlp: 1024,
        b: 4,
        t: 128,
    },
    Case {
        preset: "gpt2",
        c: 768,
        heads: 12,
        kv_heads: 12,
        mlp: 3072,
        b: 2,
        t: 256,
    },
    Case {
        preset: "gpt2",
        c: 768,
        heads: 12,
        kv_heads: 12,
        mlp: 3072,
        b: 4,
        t: 512,
    },
    Case {
        preset: "gpt2",
        c: 1280,
        heads: 20,
        kv_heads: 20,
        mlp: 5120,
        b: 1,
        t: 1024,
    },
    Case {
        preset: "gpt2",
        c: 1600,
        heads: 25,
        kv_heads: 25,
        mlp: 6400,
        b: 2,
        t: 256,
    },
    Case {
        preset: "smollm2-135m",
        c: 576,
        heads: 9,
        kv_heads: 3,
        mlp: 1536,
        b: 4,
        t: 256,
    },
    Case {
        preset: "smollm2-135m",
        c: 2048,
        heads: 16,
        kv_heads: 8,
        mlp: 5632,
        b: 1,
        t: 512,
    },
];

/// The suite on a GPU: the same roles, index by index (GPT-2 shapes first, the LoRA runs on
/// entry 5, the optimizer-state runs on 0 and 1), at the rows a GPU trains on (2K to 16K),
/// widths up to a Llama 3 8B layer's, so the fitted rates are those of full-size kernels.
const GPU_SUITE: [Case; 7] = [
    Case {
        preset: "gpt2",
        c: 768,
        heads: 12,
        kv_heads: 12,
        mlp: 3072,
        b: 2,
        t: 256,
    },
    Case {
        preset: "gpt2",
        c: 768,
        heads: 12,
        kv_heads: 12,
        mlp: 3072,
        b: 8,
        t: 1024,
    },
    Case {
        preset: "gpt2",
        c: 1024,
        heads: 16,
        kv_heads: 16,
        mlp: 4096,
        b: 16,
        t: 1024,
    },
    Case {
        preset: "gpt2",
        c: 1280,
        heads: 20,
        kv_heads: 20,
        mlp: 5120,
        b: 4,
        t: 1024,
    },
    Case {
        preset: "gpt2",
        c: 1600,
        heads: 25,
        kv_heads: 25,
        mlp: 6400,
        b: 8,
        t: 512,
    },
    Case {
        preset: "smollm2-135m",
        c: 576,
        heads: 9,
        kv_heads: 3,
        mlp: 1536,
        b: 16,
        t: 1024,
    },
    Case {
        preset: "smollm2-135m",
        c: 4096,
        heads: 32,
        kv_heads: 8,
        mlp: 14336,
        b: 1,
        t: 2048,
    },
];

impl Case {
    fn spec(&self) -> Result<ModelSpec> {
        let mut s = ModelSpec::preset(self.preset)?;
        s.name = format!(
            "calibration {} C={} {}x{}",
            self.preset, self.c, self.b, self.t
        );
        s.n_layer = 2;
        s.vocab_size = 4096;
        s.n_embd = self.c;
        s.n_head = self.heads;
        s.n_kv_head = self.kv_heads;
        s.head_dim = self.c / self.heads;
        s.mlp_hidden = self.mlp;
        s.n_positions = s.n_positions.max(self.t);
        s.validate()?;
        Ok(s)
    }
}

/// Trains `cfg` on `spec` for a warm-up and one timed step, every op timed.
fn time_ops(
    spec: &ModelSpec,
    cfg: &StepConfig,
    backend: &dyn Backend,
    out: &mut Vec<Sample>,
) -> Result<()> {
    let plan = build_plan(spec, cfg, Mode::Train, backend)?;
    let n_ops = plan.schedule.ops.len();
    let layout = plan.layout.clone();
    let mut ex = Executor::on(plan, backend)?;
    let mut init = layout.initializer(1);
    ex.fill_params(|range, p| {
        init.fill(range, p);
        Ok(())
    })?;
    if let Some(lora) = ex.plan.lora.clone() {
        let mut init = lora.base.initializer(2);
        ex.fill_base(|range, p| {
            init.fill(range, p);
            Ok(())
        })?;
    }
    let mut rng = Rng::new(1);
    let batch: Vec<u32> = (0..cfg.grad_accum * cfg.batch * (cfg.seq + 1))
        .map(|_| rng.below(spec.vocab_size as u64) as u32)
        .collect();
    ex.upload_batch(&batch)?;
    ex.record_ops(Some(OpRecorder::new(Instant::now(), 2 * n_ops)));
    let hp = |step| OptimHparams {
        lr: 1e-4,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        grad_clip: 1.0,
        step,
    };
    if cfg.precision == Precision::F16 {
        ex.set_loss_scale(super::loss_scale::LossScaler::INITIAL);
    }
    ex.train_step(&hp(1))?;
    let warm = ex.recorder_mut().map_or(0, |r| r.spans.len());
    ex.train_step(&hp(2))?;
    let rec = ex.record_ops(None).context("the recorder is set")?;
    for s in &rec.spans[warm..] {
        let e = &ex.plan.schedule.ops[s.op as usize];
        if let Some(kind) = op_kind(&ex.plan, e) {
            out.push(Sample {
                kind,
                flops: e.flops as f64,
                bytes: op_bytes(&ex.plan, e) as f64,
                secs: ((s.end_us - s.start_us) * 1e-6).max(1e-7),
            });
        }
    }
    Ok(())
}

/// The FMA peak of `threads` threads (GFLOP/s), measured by `backend` in a pool of that size.
pub fn fma_peak(threads: usize, backend: &dyn Backend) -> Result<f64> {
    Ok(peak_on(threads, backend)?.map_or(0.0, |p| p.gflops_per_s))
}

/// Every loop `backend` measures (see [`Backend::measure_peak`]), run in a pool of `threads`
/// threads: the ceiling of a step that runs on that many.
pub fn peak_on(threads: usize, backend: &dyn Backend) -> Result<Option<crate::backend::Peak>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| crate::util::threads::refused(&format!("{threads} worker threads"), e))?;
    Ok(pool.install(|| backend.measure_peak()))
}

/// Where the calibration of `threads` threads is kept in the user cache.
pub fn cache_file(threads: usize) -> Option<PathBuf> {
    crate::util::cache::memwall_cache().map(|d| {
        d.join("calibration")
            .join(format!("threads-{threads}.json"))
    })
}

/// Measures this machine on `opts.threads` threads (about a minute on 2 cores), reporting
/// each model of the suite to `progress`.
pub fn run(opts: &CalibrateOptions, progress: &mut dyn FnMut(&str)) -> Result<Calibration> {
    if opts.threads == 0 {
        bail!("--threads must be at least 1");
    }
    // The disk is measured last; a bad --offload-dir must fail now, not after the suite.
    if let Some(dir) = &opts.offload_dir {
        let size = crate::mem::probe::probe_size(dir)?;
        crate::mem::probe::check(dir, size)?;
    }
    let mut samples = Vec::new();
    let mut runs: Vec<(ModelSpec, StepConfig)> = Vec::new();
    let backend = opts.device.open()?;
    let gpu = opts.device.kind == crate::backend::DeviceKind::Cuda;
    let all: &[Case; 7] = if gpu { &GPU_SUITE } else { &SUITE };
    let (precisions, suite): (&[Precision], Vec<&Case>) = if opts.quick {
        (
            &[Precision::F32],
            [0, 1, 5].iter().map(|&i| &all[i]).collect(),
        )
    } else {
        (
            &[Precision::F32, Precision::Bf16, Precision::F16],
            all.iter().collect(),
        )
    };
    for &precision in precisions {
        for case in &suite {
            let mut cfg = StepConfig::new(case.b, case.t, opts.threads);
            cfg.precision = precision;
            runs.push((case.spec()?, cfg));
        }
        // LoRA (r 16, every linear layer) on the Llama shape: the adapters' ops, the frozen
        // layers' input-gradient GEMMs, and those on a quantized base.
        for quant in [BaseQuant::F32, BaseQuant::Blocks(GgmlType::Q4_0)] {
            let case = &all[5];
            let spec = case.spec()?;
            let mut cfg = StepConfig::new(case.b, case.t, opts.threads);
            cfg.precision = precision;
            cfg.base_quant = quant;
            cfg.lora = Some(LoraSpec {
                r: 16,
                alpha: 32.0,
                dropout: 0.0,
                targets: Target::all(spec.family).to_vec(),
            });
            runs.push((spec, cfg));
        }
        // The optimizer-state formats' AdamW, on the smaller GPT-2 shapes.
        for state in [OptimState::Bf16, OptimState::Int8] {
            for case in &all[..2] {
                let mut cfg = StepConfig::new(case.b, case.t, opts.threads);
                cfg.precision = precision;
                cfg.optim_state = state;
                runs.push((case.spec()?, cfg));
            }
        }
    }
    let t0 = Instant::now();
    for (i, (spec, cfg)) in runs.iter().enumerate() {
        progress(&format!(
            "[{}/{}] {}, {}, optimizer state {} ({:.0} s)",
            i + 1,
            runs.len(),
            spec.name,
            cfg.precision,
            cfg.optim_state,
            t0.elapsed().as_secs_f64()
        ));
        time_ops(spec, cfg, backend, &mut samples)
            .with_context(|| format!("calibrating on {}", spec.name))?;
    }
    let mut by_kind: BTreeMap<String, Vec<&Sample>> = BTreeMap::new();
    for s in &samples {
        by_kind.entry(s.kind.clone()).or_default().push(s);
    }
    let mut kinds: BTreeMap<String, Cost> =
        by_kind.into_iter().map(|(k, ss)| (k, fit(&ss))).collect();
    if gpu {
        // Updates of state in pinned RAM run on the host's cores (`--offload
        // optimizer,params,grads`).
        progress("the host's AdamW, for updates in pinned RAM");
        kinds.extend(super::calibrate_host::measure(opts.threads)?);
    }
    let disk = match &opts.offload_dir {
        Some(dir) => {
            let size = crate::mem::probe::probe_size(dir)?;
            progress(&format!(
                "disk at {} ({} written, then read)",
                dir.display(),
                crate::util::bytes::fmt_bytes(size)
            ));
            let d = crate::mem::probe::probe(dir, size)?;
            Some(Bandwidth {
                read_bytes_per_s: d.read_bytes_per_s,
                write_bytes_per_s: d.write_bytes_per_s,
            })
        }
        None => None,
    };
    Ok(Calibration {
        source: Source::Measured { at: utc_now() },
        cpu: backend.processor(),
        gpu,
        threads: opts.threads,
        // A GPU's ceiling is its bf16 GEMMs' rate as fitted on the suite's GEMMs (what MFU
        // is reported against); a CPU's, its FMA loops measured.
        fma_peak_gflops: match gpu {
            true => gemm_rate_gflops(&kinds, "matmul/bf16").unwrap_or(0.0),
            false => fma_peak(opts.threads, backend)?,
        },
        kinds,
        disk,
        bus: backend.measure_bus()?.map(|(read, write)| Bandwidth {
            read_bytes_per_s: read,
            write_bytes_per_s: write,
        }),
        disk_dir: opts.offload_dir.clone(),
        transport: None,
    })
}

/// The GFLOP/s of op kind `kind`'s fitted arithmetic term (1 / `s_per_flop`), if it was
/// fitted with one.
pub fn gemm_rate_gflops(kinds: &BTreeMap<String, Cost>, kind: &str) -> Option<f64> {
    let c = kinds.get(kind)?;
    (c.s_per_flop > 0.0).then(|| 1e-9 / c.s_per_flop)
}

/// Where the calibration of the GPU named `gpu` is kept in the user cache
/// (`calibration/cuda-<name>.json`, the name's letters and digits, `-` for the rest).
pub fn gpu_cache_file(gpu: &str) -> Option<PathBuf> {
    let slug: String = gpu
        .chars()
        .map(|c| match c.is_ascii_alphanumeric() {
            true => c.to_ascii_lowercase(),
            false => '-',
        })
        .collect();
    crate::util::cache::memwall_cache()
        .map(|d| d.join("calibration").join(format!("cuda-{slug}.json")))
}

/// Where `cal` is kept: by thread count for the CPU ([`cache_file`]), by name for a GPU
/// ([`gpu_cache_file`]).
pub fn cache_file_of(cal: &Calibration) -> Option<PathBuf> {
    match cal.gpu {
        true => gpu_cache_file(&cal.cpu),
        false => cache_file(cal.threads),
    }
}

/// The GPU calibrations saved in the user cache, newest first (by when they were measured).
/// A file that cannot be read is an error naming it.
pub fn saved_gpu_calibrations() -> Result<Vec<(PathBuf, Calibration)>> {
    let Some(dir) = crate::util::cache::memwall_cache().map(|d| d.join("calibration")) else {
        return Ok(Vec::new());
    };
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
    };
    let mut found = Vec::new();
    for entry in entries {
        let path = entry
            .with_context(|| format!("cannot list {}", dir.display()))?
            .path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !(name.starts_with("cuda-") && name.ends_with(".json")) {
            continue;
        }
        let redo = "memwall calibrate --device cuda";
        if let Some(cal) = load_json::<Calibration>(&path, redo, Calibration::check)?
            && cal.gpu
        {
            found.push((path, cal));
        }
    }
    let at = |c: &Calibration| match &c.source {
        Source::Measured { at } => at.clone(),
        Source::Estimate => String::new(),
    };
    found.sort_by_key(|f| std::cmp::Reverse(at(&f.1)));
    Ok(found)
}

/// The calibration the time model uses for plans on `device` with `threads` threads: the
/// CPU's ([`current`]: saved, or estimated from the FMA peak); for a GPU, the newest saved
/// GPU calibration (`memwall calibrate --device cuda`, made on a GPU machine and copied with
/// the user cache), or `None`: a GPU's times are not estimated from anything less.
pub fn for_device(device: DeviceId, threads: usize) -> Result<Option<Calibration>> {
    match device.kind {
        crate::backend::DeviceKind::Cuda => {
            Ok(saved_gpu_calibrations()?.into_iter().next().map(|(_, c)| c))
        }
        _ => current(threads).map(Some),
    }
}

/// The calibration that ranks `what`'s choices (`--fit`, `--offload auto`, ...) for plans
/// on `device` ([`for_device`]); for a GPU without one, an error naming `what` and the
/// command that measures one (a GPU's choices are never ranked by the CPU's costs).
pub fn for_ranking(device: DeviceId, threads: usize, what: &str) -> Result<Calibration> {
    for_device(device, threads)?.ok_or_else(|| {
        anyhow::anyhow!(
            "{what} --device {device}: {what} ranks choices by the time model, and there is no \
             GPU calibration here: run `memwall calibrate --device cuda` on the GPU machine \
             (it saves calibration/cuda-<gpu>.json in the user cache; copy that file to plan \
             elsewhere), or give the strategies (or --batch auto with --max-memory, which needs \
             no time model)"
        )
    })
}

/// Writes `cal` to `path` (atomically; the directory is created).
pub fn save(cal: &Calibration, path: &Path) -> Result<()> {
    save_json(cal, path)
}

/// Writes `value` as JSON to `path` (atomically; the directory is created).
pub(super) fn save_json<T: serde::Serialize>(value: &T, path: &Path) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the directory {}", dir.display()))?;
    }
    crate::util::atomic::write_file(path, serde_json::to_string_pretty(value)?.as_bytes())
        .with_context(|| format!("cannot write the calibration {}", path.display()))
}

/// The JSON value saved at `path`: `Ok(None)` when the file is not there, an error naming
/// the file, and saying to run `redo` again, when it cannot be read or parsed, or when
/// `check` refuses its values (a hand-edited file with negative coefficients would predict
/// negative times).
pub(super) fn load_json<T: serde::de::DeserializeOwned>(
    path: &Path,
    redo: &str,
    check: impl FnOnce(&T) -> Result<(), String>,
) -> Result<Option<T>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let refuse = || {
        format!(
            "{} is not a calibration memwall can read: delete it or run `{redo}` again",
            path.display()
        )
    };
    let value: T = serde_json::from_str(&text).with_context(refuse)?;
    check(&value)
        .map_err(anyhow::Error::msg)
        .with_context(refuse)?;
    Ok(Some(value))
}

/// The saved calibration of `threads` threads on this CPU: `Ok(None)` when there is none (or
/// it was taken on another CPU), an error naming the file when it cannot be read.
pub fn load(threads: usize) -> Result<Option<Calibration>> {
    let Some(path) = cache_file(threads) else {
        return Ok(None);
    };
    let cal: Option<Calibration> = load_json(&path, "memwall calibrate", Calibration::check)?;
    Ok(cal.filter(|c| !c.gpu && c.cpu == cpu_name() && c.threads == threads))
}

/// The calibration the time model uses on `threads` threads: the saved one, else an
/// estimate from the FMA peak measured now (about 0.1 s). Calibrations are the CPU's (kept
/// per CPU model and thread count): a second backend brings its own key.
pub fn current(threads: usize) -> Result<Calibration> {
    match load(threads)? {
        Some(c) => Ok(c),
        None => Ok(Calibration::estimate(
            cpu_name(),
            threads,
            fma_peak(threads, DeviceId::CPU.open()?)?,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::calibrate_fit::sample;

    /// A calibration as `memwall calibrate` writes it, as JSON.
    fn saved() -> serde_json::Value {
        let mut cal = Calibration::estimate("cpu".into(), 2, 500.0);
        cal.kinds
            .insert("matmul/f32".into(), fit(&[&sample(1e9, 1e6, 1e-2)]));
        cal.disk = Some(Bandwidth {
            read_bytes_per_s: 1e9,
            write_bytes_per_s: 5e8,
        });
        serde_json::to_value(&cal).unwrap()
    }

    /// Loads `value` from a file, as `load` does.
    fn load_value(value: &serde_json::Value) -> (String, Result<Option<Calibration>>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("threads-2.json");
        std::fs::write(&path, value.to_string()).unwrap();
        let r = load_json(&path, "memwall calibrate", Calibration::check);
        (path.display().to_string(), r)
    }

    #[test]
    fn hand_broken_calibrations_are_refused_naming_the_file_and_field() {
        let (_, ok) = load_value(&saved());
        assert!(ok.unwrap().is_some(), "a calibration as written loads");
        for (path, value, field) in [
            (
                "/kinds/matmul~1f32/s_per_flop",
                -1e-12,
                "kinds.\"matmul/f32\".s_per_flop is -0.000000000001",
            ),
            ("/kinds/matmul~1f32/s_per_op", -1.0, "s_per_op is -1"),
            ("/disk/read_bytes_per_s", 0.0, "disk.read_bytes_per_s is 0"),
            (
                "/disk/write_bytes_per_s",
                -5.0,
                "disk.write_bytes_per_s is -5",
            ),
            ("/fma_peak_gflops", -1.0, "fma_peak_gflops is -1"),
        ] {
            let mut v = saved();
            *v.pointer_mut(path).unwrap() = serde_json::json!(value);
            let (file, r) = load_value(&v);
            let e = format!("{:#}", r.unwrap_err());
            assert!(
                e.contains(&file)
                    && e.contains("run `memwall calibrate` again")
                    && e.contains(field),
                "{path}: {e}"
            );
        }
        // Wrong shapes: a coefficient that is not a number (NaN is saved as null), a list
        // for the map of kinds, no threads.
        for (path, value) in [
            ("/kinds/matmul~1f32/s_per_byte", serde_json::Value::Null),
            ("/kinds", serde_json::json!([1, 2])),
            ("/threads", serde_json::json!(0)),
        ] {
            let mut v = saved();
            *v.pointer_mut(path).unwrap() = value;
            let (file, r) = load_value(&v);
            let e = format!("{:#}", r.unwrap_err());
            assert!(
                e.contains(&file) && e.contains("memwall calibrate"),
                "{path}: {e}"
            );
        }
    }
}
