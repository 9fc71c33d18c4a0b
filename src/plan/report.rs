//! Presenting a plan: the category table `memwall plan` prints (`plan.json` is
//! [`crate::run_dir::PlanJson`]).
//!
//! Per category, three figures: the sum of its buffers' bytes (as if nothing were reused),
//! its own peak (the most of its bytes live at one op), and its bytes live at the plan's peak
//! op (the attribution of the peak).

use super::{Budgets, Plan};
use crate::ir::Sizing;
use crate::util::bytes::fmt_bytes;
use std::fmt::Write;

/// The human-readable table: bytes by category, packing, baseline and predicted peak, each
/// tier's peak against its budget (of `budgets`), and how `backend` computes in the plan's
/// precision.
pub fn table(plan: &Plan, baseline: u64, budgets: &Budgets, backend: &dyn Sizing) -> String {
    let mut s = String::new();
    let cfg = &plan.cfg;
    let micro = if cfg.grad_accum > 1 {
        format!(
            "micro-batch {} x grad-accum {} x seq {}",
            cfg.batch, cfg.grad_accum, cfg.seq
        )
    } else {
        format!("batch {} x seq {}", cfg.batch, cfg.seq)
    };
    let _ = writeln!(
        s,
        "plan: {}\n      {:?}, {micro} = {} tokens/step, {}, recompute {}, optimizer state {}, offload {}, {}, {} ops",
        plan.spec.describe(),
        plan.mode,
        cfg.batch * cfg.grad_accum * cfg.seq,
        cfg.precision,
        cfg.recompute,
        cfg.optim_state,
        cfg.offload.set,
        crate::util::count(cfg.threads as u64, "thread"),
        plan.schedule.ops.len()
    );
    if let Some(l) = &plan.lora {
        let _ = writeln!(s, "      {}; base {}", l.describe(), cfg.base_quant);
    }
    if let Some(line) = describe_update(plan) {
        let _ = writeln!(s, "      {line}");
    }
    let mesh = &cfg.mesh;
    if mesh.tensor > 1 {
        let joins = match cfg.sequence_parallel {
            true => format!(
                "sequence parallel: {} of the {} token rows of the residual stream and its \
                 norms, an all-gather before and a reduce-scatter after each attention and MLP",
                cfg.batch * cfg.seq / mesh.tensor,
                cfg.batch * cfg.seq
            ),
            false => "an all-reduce after each attention and MLP, forward and backward".into(),
        };
        let _ = writeln!(
            s,
            "      one rank of {}: tensor rank {} of {} (its part of every layer: {} of {} heads, \
             {} of {} MLP channels; {joins}; token ids {:?} of the embedding and the head), \
             copy {} of {} of the model (the copies split the batch)",
            mesh.world(),
            mesh.coord(crate::ir::Axis::Tensor),
            mesh.tensor,
            plan.spec.n_head / mesh.tensor,
            plan.spec.n_head,
            plan.spec.mlp_hidden / mesh.tensor,
            plan.spec.mlp_hidden,
            mesh.tensor_split().vocab_part(plan.spec.vocab_size),
            mesh.data_rank(),
            mesh.data
        );
    }
    if mesh.pipeline > 1 {
        let stage = cfg.pipeline_stage(plan.spec.n_layer);
        let runs = stage.chunk_layers(plan.spec.n_layer);
        let layers = super::ranks::describe_layers(&runs);
        let (p, m, v) = (stage.size, cfg.grad_accum, stage.chunks);
        // 1F1B's bubble (p − 1)/(m + p − 1) of the step; interleaved, each of the fill and
        // drain's p − 1 slots is one run of the V: (p − 1)/(V·m + p − 1).
        let idle = |m: usize| 100.0 * (p - 1) as f64 / (v * m + p - 1) as f64;
        let more = match m < 4 * (p - 1) {
            true => format!(
                "; {} micro-batches would make it {:.0}%",
                4 * (p - 1),
                idle(4 * (p - 1))
            ),
            false => String::new(),
        };
        let order = match v {
            1 => format!("the 1F1B order: at most {} in flight", stage.in_flight(m)),
            _ => format!(
                "the interleaved 1F1B order, {v} runs of layers each: at most {} runs' \
                 activations in flight ({:.1} micro-batches')",
                stage.in_flight(m),
                stage.in_flight(m) as f64 / v as f64
            ),
        };
        let formula = match v {
            1 => "(p - 1)/(m + p - 1)".to_string(),
            _ => format!("(p - 1)/({v}m + p - 1)"),
        };
        let _ = writeln!(
            s,
            "      one rank of {}: pipeline stage {} of {p} ({layers} of {}{}{}), its {m} \
             micro-batches in {order}; the pipeline idles {formula} = {:.0}% of the step \
             filling and draining{more}",
            mesh.world(),
            stage.rank,
            plan.spec.n_layer,
            if stage.is_first() {
                "; the embedding"
            } else {
                ""
            },
            if stage.is_last() {
                "; the head and the loss"
            } else {
                ""
            },
            idle(m),
        );
    }
    let per_rank = (mesh.world() > 1 || cfg.zero.0 > 0).then(|| super::zero::per_rank(plan));
    if let Some(r) = per_rank.as_ref().filter(|r| r.ranks > 1 || r.zero > 0) {
        let stage = match r.zero {
            0 => "plain data parallelism: every rank keeps everything",
            1 => "optimizer state sharded",
            2 => "optimizer state and gradients sharded",
            _ => "optimizer state, gradients and parameters sharded",
        };
        let who = match mesh.tensor * mesh.pipeline {
            1 => format!("one rank of {}", r.ranks),
            _ => format!("data rank {} of {}", mesh.data_rank(), r.ranks),
        };
        let _ = writeln!(
            s,
            "      {who} (--zero {}: {stage}); each data rank runs this plan on its own batch",
            r.zero
        );
    }
    // The compute tier's name, as the figures below are its: RAM on the CPU.
    let compute = plan.compute_tier();
    let on_gpu = compute == crate::ir::Tier::Device;
    let own_label = if on_gpu {
        "own GPU peak"
    } else {
        "own RAM peak"
    };
    let _ = writeln!(
        s,
        "\n  {:<18} {:>8} {:>14} {:>14} {:>14}",
        "category", "buffers", "sum of bytes", own_label, "live at peak"
    );
    let at_peak = plan.live_by_category(plan.peak_op);
    let own_peak = plan.peak_by_category();
    for (((cat, bytes), (_, live)), (_, own)) in plan
        .bytes_by_category()
        .into_iter()
        .zip(at_peak)
        .zip(own_peak)
    {
        let count = plan.buffers.iter().filter(|b| b.category == cat).count();
        if count == 0 {
            continue;
        }
        let _ = writeln!(
            s,
            "  {:<18} {:>8} {:>14} {:>14} {:>14}",
            cat.name(),
            count,
            fmt_bytes(bytes),
            fmt_bytes(own),
            fmt_bytes(live)
        );
    }
    let sum: u64 = plan.buffers.iter().map(|b| b.bytes).sum();
    let _ = writeln!(
        s,
        "  {:<18} {:>8} {:>14}",
        "sum of buffers",
        plan.buffers.len(),
        fmt_bytes(sum)
    );
    let _ = writeln!(
        s,
        "  {own_label}: the most of that category in {} at any one op.\n  \
         live at peak: what it holds at the op where the whole plan peaks ({}).",
        compute.describe(),
        plan.schedule.ops[plan.peak_op].name
    );
    if let Some(beneath) = plan.tiers.get(1).filter(|t| t.bytes > 0) {
        let _ = writeln!(
            s,
            "  sum of bytes: every buffer once, on every tier: an offloaded buffer's home ({}) \
             and each of its staging copies.",
            plan.tier_name(beneath.tier)
        );
    }
    let _ = writeln!(
        s,
        "\n  arena (packed by lifetime)  {:>12}   lower bound {} (peak live, at op {})",
        fmt_bytes(plan.arena_bytes()),
        fmt_bytes(plan.peak_live_bytes),
        plan.schedule.ops[plan.peak_op].name
    );
    for b in plan.buffers.iter().filter(|b| b.is_owned()) {
        let _ = writeln!(
            s,
            "  + outside the arena: {:<15} {:>12}{}",
            b.name,
            fmt_bytes(b.bytes),
            if on_gpu { "   (host RAM)" } else { "" }
        );
    }
    let _ = writeln!(
        s,
        "  plan total                  {:>12}",
        fmt_bytes(plan.total_bytes())
    );
    let _ = writeln!(
        s,
        "  {:<27} {:>12}",
        if on_gpu {
            "CUDA context (estimated)"
        } else {
            "process baseline (measured)"
        },
        fmt_bytes(baseline)
    );
    let _ = writeln!(
        s,
        "  runtime reserve             {:>12}   {} + 1/{} of the plan: what runs touch outside it",
        fmt_bytes(plan.runtime_reserve()),
        fmt_bytes(super::RESERVE_FIXED),
        super::RESERVE_PLAN_DIV
    );
    let _ = writeln!(
        s,
        "  {:<27} {:>12}",
        if on_gpu {
            "predicted device peak"
        } else {
            "predicted peak RSS"
        },
        fmt_bytes(plan.predicted_peak(baseline))
    );
    if plan.nvme_bytes() > 0 {
        let (read, written) = plan.io_bytes_per_step();
        let _ = writeln!(
            s,
            "  on disk (offload file)      {:>12}   per step: {} read, {} written",
            fmt_bytes(plan.nvme_bytes()),
            fmt_bytes(read),
            fmt_bytes(written)
        );
    }
    s.push_str(&tiers(plan, baseline, budgets));
    if let Some(r) = &per_rank {
        let parts: Vec<String> = r
            .comm_by_collective
            .iter()
            .map(|(k, v)| format!("{} {}", k.replace('_', "-"), fmt_bytes(*v)))
            .collect();
        let _ = writeln!(
            s,
            "  sent per step by each rank  {:>12}   ({})",
            fmt_bytes(r.comm_bytes_per_step),
            parts.join(", ")
        );
        let (m, z) = (&r.model_state, &r.zero_paper);
        let _ = writeln!(
            s,
            "  model state per rank        {:>12}   params {}, grads {} (peak), optimizer {}",
            fmt_bytes(m.total()),
            fmt_bytes(m.params),
            fmt_bytes(m.grads),
            fmt_bytes(m.optimizer)
        );
        let _ = writeln!(
            s,
            "    ZeRO paper's formula      {:>12}   params {}, grads {}, optimizer {} (same bytes per parameter)",
            fmt_bytes(z.total()),
            fmt_bytes(z.params),
            fmt_bytes(z.grads),
            fmt_bytes(z.optimizer)
        );
    }
    let flops = plan.flops();
    let _ = writeln!(
        s,
        "  arithmetic per step         {:>10.1} GFLOP",
        flops as f64 / 1e9
    );
    if let Some(note) = backend.compute_note(cfg.precision.storage()) {
        let _ = writeln!(s, "  {} compute                {note}", cfg.precision);
    }
    let re = plan.recompute_flops();
    if re > 0 {
        let _ = writeln!(
            s,
            "    of which recomputation    {:>10.1} GFLOP ({:.1}%)",
            re as f64 / 1e9,
            100.0 * re as f64 / flops as f64
        );
    }
    s
}

/// One line per tier the plan packs, fastest first: its peak and the budget it must fit; and
/// where the updates run when that is on the host's cores.
pub fn tiers(plan: &Plan, baseline: u64, budgets: &Budgets) -> String {
    let compute = plan.compute_tier();
    let on_host = |e: &&crate::ir::schedule::OpEntry| e.runs_on_host(&plan.buffers, compute);
    let host_updates = plan.schedule.ops.iter().filter(on_host).count();
    let mut s = match host_updates {
        0 => String::from("  tiers (ops compute on the first):\n"),
        _ => String::from(
            "  tiers (ops compute on the first; the AdamW updates on the host, below):\n",
        ),
    };
    for u in plan.tier_uses(baseline, budgets) {
        let budget = match u.budget_bytes {
            Some(b) => format!(
                "   of {} ({}){}",
                fmt_bytes(b),
                Budgets::source(u.tier, plan.compute_tier()),
                if u.over_by() > 0 { ": OVER" } else { "" }
            ),
            None => String::new(),
        };
        let _ = writeln!(
            s,
            "    {:<24}peak {:>12}{budget}",
            u.name,
            fmt_bytes(u.peak_bytes)
        );
    }
    if host_updates > 0 {
        let _ = writeln!(
            s,
            "  AdamW                        on the host's cores ({} threads), in pinned RAM where \
             its state is: the gradients go out over the bus, the weights come back in",
            plan.cfg.threads
        );
    }
    s
}

/// What `--update in-backward` does in `plan` (`None` for an update after the backward): where
/// the groups' updates run, and the LM head's slices with the arithmetic they add.
pub fn describe_update(plan: &Plan) -> Option<String> {
    use crate::ir::schedule::Op;
    if plan.cfg.update != crate::ir::Update::InBackward || plan.mode != super::Mode::Train {
        return None;
    }
    let slices: Vec<u64> = (plan.schedule.ops.iter())
        .filter(|e| matches!(e.op, Op::LmHeadWeightGrad { .. }))
        .map(|e| e.flops)
        .collect();
    let on_host =
        (plan.schedule.ops.iter()).any(|e| e.runs_on_host(&plan.buffers, plan.compute_tier()));
    Some(match slices.len() {
        0 if on_host => "update in-backward: each group's AdamW step on the host's cores once \
             its gradients are final and written out, while the GPU runs the next group's \
             backward (the LM head's gradient whole: slices would read its weights from pinned \
             RAM once each)"
            .to_string(),
        0 => format!(
            "update in-backward: each group's AdamW step in the last micro-batch's backward, \
             once its gradients are final (they add up over the {} micro-batches, so the LM \
             head's gradient is whole, not sliced)",
            plan.cfg.grad_accum
        ),
        n => format!(
            "update in-backward: each group's AdamW step as soon as its gradients are final; \
             the LM head's weight gradient after the backward in {n} slice{} of the \
             vocabulary ({:.1} GFLOP a step, its logits computed again)",
            if n == 1 { "" } else { "s" },
            slices.iter().sum::<u64>() as f64 / 2e9
        ),
    })
}
