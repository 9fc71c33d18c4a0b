//! Distillation's teacher (`train --distill-from`): a frozen model run as `sample` runs it
//! (a generation plan of one sequence: its weights and one sequence's activations), whose
//! final-norm output for each row of a step's batch the student's head reads
//! ([`crate::plan::Distill`]), with the teacher's own head, to compute the teacher's logits a
//! chunk of rows at a time. The teacher's logits never exist whole. A teacher given as a GGUF
//! file is kept as the file's blocks (its plan's frozen base, as QLoRA keeps one), so it
//! holds about the file's bytes, not four per weight.

use super::Executor;
use super::resolve::base::base_storage;
use crate::backend::DeviceId;
use crate::ckpt;
use crate::data::examples::{EXAMPLE_START, UNTRAINED};
use crate::ir::BufId;
use crate::ir::schedule::Op;
use crate::model::ModelSpec;
use crate::plan::{Distill, Mode, Plan, StepConfig, build_plan};
use anyhow::{Context, Result, bail};
use std::path::Path;

/// A teacher ready to run.
pub struct Teacher {
    ex: Executor,
    pub spec: ModelSpec,
    /// Its model directory (a GGUF file's conversion): the head is read from it.
    dir: std::path::PathBuf,
    /// The op that reads the final norm's output, and that buffer `[T, Ct]`.
    watch: (usize, BufId),
    /// One step's outputs `[rows, T, Ct]`, reused.
    out: Vec<f32>,
}

/// The teacher's plan for sequences of `seq` tokens (what its memory is): its weights as
/// the GGUF file `gguf` keeps them where it has one (each tensor's blocks), else f32.
pub fn plan(
    spec: &ModelSpec,
    gguf: Option<&Path>,
    (seq, threads, device): (usize, usize, DeviceId),
) -> Result<Plan> {
    let mut cfg = StepConfig::new(1, seq, threads);
    let flag = "--distill-from";
    (cfg.base_quant, cfg.base_types) =
        base_storage(gguf, spec.family, true, None, flag, &mut Vec::new())?;
    build_plan(spec, &cfg, Mode::Generate, device.sizing())
}

/// The distillation a student `student` of sequences of `seq` tokens gets from the teacher
/// in `dir` (a model directory, the conversion of `gguf` where it is one; checked as
/// [`Teacher::open`] checks it) with the KL's weight `alpha`: the teacher's width and its
/// plan's bytes and arithmetic, which the student's plan counts. Planning only: nothing is
/// loaded but the teacher's config (and the GGUF's tensor types).
pub fn distill(
    (dir, gguf): (&Path, Option<&Path>),
    student: &ModelSpec,
    alpha: f32,
    at: (usize, usize, DeviceId),
) -> Result<Distill> {
    let spec = ckpt::load_spec(dir).with_context(|| format!("--distill-from {}", dir.display()))?;
    check(&spec, student, dir)?;
    let plan = plan(&spec, gguf, at)?;
    Ok(Distill {
        teacher_width: spec.n_embd,
        alpha,
        teacher_bytes: plan.total_bytes(),
        teacher_flops: plan.schedule.ops.iter().map(|e| e.flops).sum(),
    })
}

impl Teacher {
    /// Opens the model in `dir` (a Hugging Face directory or checkpoint; the conversion of
    /// `gguf` where it is one, whose blocks the teacher keeps) as the teacher of `student`,
    /// for sequences of `seq` tokens: the vocabularies must be the same.
    pub fn open(
        (dir, gguf): (&Path, Option<&Path>),
        student: &ModelSpec,
        (seq, threads, device): (usize, usize, DeviceId),
    ) -> Result<Teacher> {
        let spec = ckpt::load_spec(dir).context("--distill-from")?;
        check(&spec, student, dir)?;
        let plan = plan(&spec, gguf, (seq, threads, device))?;
        let watch = plan
            .schedule
            .ops
            .iter()
            .enumerate()
            .find_map(|(i, e)| match e.op {
                Op::LmHeadLast { inp, .. } => Some((i, inp)),
                _ => None,
            })
            .context("internal error: a generation plan without its head")?;
        let (layout, kept) = (plan.layout.clone(), plan.lora.is_some());
        let mut ex = Executor::on(plan, device.open()?)?;
        match (kept, gguf) {
            (true, Some(gguf)) => {
                let src = crate::gguf::base::BaseSource::open(gguf)?;
                ex.fill_base_bytes(|t, storage, dst| src.copy(t, storage, dst))
                    .with_context(|| format!("--distill-from {}", gguf.display()))?
            }
            _ => ex
                .with_params_mut(|p| ckpt::load_params(dir, &layout, p))?
                .with_context(|| format!("--distill-from {}", dir.display()))?,
        }
        Ok(Teacher {
            ex,
            spec,
            dir: dir.to_path_buf(),
            watch,
            out: Vec::new(),
        })
    }

    /// The bytes of the teacher's plan (its weights, one sequence's activations): what a
    /// distilled run holds beside the student's plan ([`Distill::teacher_bytes`]).
    pub fn plan_bytes(&self) -> u64 {
        self.ex.plan.total_bytes()
    }

    /// Copies the teacher's LM head `[V, Ct]` (its tied embedding, where it has one) into
    /// `dst`, in f32 from its model directory (its plan may keep it as blocks).
    pub fn copy_head(&self, dst: &mut [f32]) -> Result<()> {
        let w = match &self.ex.plan.schedule.ops[self.watch.0].op {
            Op::LmHeadLast { w, .. } => w.clone(),
            _ => unreachable!("the watched op is the head"),
        };
        if dst.len() != w.len() {
            bail!(
                "internal error: a teacher head of {} values for {}",
                w.len(),
                dst.len()
            );
        }
        let layout = crate::model::ParamLayout::new(&self.spec);
        ckpt::load_params_by(&self.dir, &layout, |copy| copy(w, dst))
            .with_context(|| format!("--distill-from {}: its LM head", self.dir.display()))
    }

    /// The teacher's final-norm output for every row of `batch` (`[rows, T + 1]` token ids
    /// as the loader draws them, chat markers allowed): `[rows, T, Ct]`.
    pub fn outputs(&mut self, batch: &[u32], seq: usize) -> Result<&[f32]> {
        let c = self.spec.n_embd;
        let rows = batch.len() / (seq + 1);
        self.out.resize(rows * seq * c, 0.0);
        let mut ids = vec![0u32; seq];
        for (r, row) in batch.chunks_exact(seq + 1).enumerate() {
            for (d, &x) in ids.iter_mut().zip(&row[..seq]) {
                *d = x & !(UNTRAINED | EXAMPLE_START);
            }
            let out = &mut self.out[r * seq * c..(r + 1) * seq * c];
            self.ex
                .forward_watching(&ids, &[self.watch], &mut |_, x| {
                    out.copy_from_slice(&x[..seq * c]);
                    Ok(())
                })
                .context("running the teacher (--distill-from)")?;
        }
        Ok(&self.out)
    }
}

/// Refuses a teacher whose vocabulary is not the student's, naming both.
pub fn check(teacher: &ModelSpec, student: &ModelSpec, dir: &Path) -> Result<()> {
    if teacher.vocab_size != student.vocab_size {
        bail!(
            "--distill-from {}: its vocabulary has {} tokens and the model's {}; a teacher's \
             logits must be over the student's tokens (the same tokenizer)",
            dir.display(),
            teacher.vocab_size,
            student.vocab_size
        );
    }
    Ok(())
}
