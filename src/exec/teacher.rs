//! Distillation's teacher (`train --distill-from`): a frozen model run as `sample` runs it
//! (a generation plan of one sequence: its weights and one sequence's activations), whose
//! final-norm output for each row of a step's batch the student's head reads
//! ([`crate::plan::Distill`]), with the teacher's own head, to compute the teacher's logits a
//! chunk of rows at a time. The teacher's logits never exist whole.

use super::Executor;
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
    /// The op that reads the final norm's output, and that buffer `[T, Ct]`.
    watch: (usize, BufId),
    /// One step's outputs `[rows, T, Ct]`, reused.
    out: Vec<f32>,
}

/// The teacher's plan for sequences of `seq` tokens (what its memory is).
pub fn plan(spec: &ModelSpec, seq: usize, threads: usize, device: DeviceId) -> Result<Plan> {
    build_plan(
        spec,
        &StepConfig::new(1, seq, threads),
        Mode::Generate,
        device.sizing(),
    )
}

/// The distillation a student `student` of sequences of `seq` tokens gets from the teacher
/// in `dir` (a model directory; checked as [`Teacher::open`] checks it) with the KL's weight
/// `alpha`: the teacher's width and its plan's bytes, which the student's plan holds beside
/// its own. Planning only: nothing is loaded but the teacher's config.
pub fn distill(
    dir: &Path,
    student: &ModelSpec,
    alpha: f32,
    (seq, threads, device): (usize, usize, DeviceId),
) -> Result<Distill> {
    let spec = ckpt::load_spec(dir).with_context(|| format!("--distill-from {}", dir.display()))?;
    check(&spec, student, dir)?;
    let plan = plan(&spec, seq, threads, device)?;
    Ok(Distill {
        teacher_width: spec.n_embd,
        alpha,
        teacher_bytes: plan.total_bytes(),
        teacher_flops: plan.schedule.ops.iter().map(|e| e.flops).sum(),
    })
}

impl Teacher {
    /// Opens the model in `dir` (a Hugging Face directory or checkpoint) as the teacher of
    /// `student`, for sequences of `seq` tokens: the vocabularies must be the same.
    pub fn open(
        dir: &Path,
        student: &ModelSpec,
        seq: usize,
        threads: usize,
        device: DeviceId,
    ) -> Result<Teacher> {
        let spec = ckpt::load_spec(dir).context("--distill-from")?;
        check(&spec, student, dir)?;
        let plan = plan(&spec, seq, threads, device)?;
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
        let layout = plan.layout.clone();
        let mut ex = Executor::on(plan, device.open()?)?;
        ex.with_params_mut(|p| ckpt::load_params(dir, &layout, p))?
            .with_context(|| format!("--distill-from {}", dir.display()))?;
        Ok(Teacher {
            ex,
            spec,
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
    /// `dst`.
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
        self.ex.with_params(|p| dst.copy_from_slice(&p[w]))
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
