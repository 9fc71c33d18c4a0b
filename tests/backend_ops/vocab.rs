//! Checks of the ops of a vocabulary cut among tensor-parallel ranks (Megatron's
//! vocabulary-parallel embedding and cross-entropy): the embedding's gather and scatter on a
//! table holding the token ids `first_token..` ([`Op::Encoder`], [`Op::EncoderBackward`]),
//! a head's statistics of its part of each row ([`Op::LmHeadStats`]) and its loss and
//! gradients from every rank's statistics ([`Op::LmHeadLoss`] with `vocab`). The rank
//! checked holds the second part of V = 13 (token ids 6..13); the other rank's statistics
//! are the reference's, as the all-gather would bring them. References as in `layers`:
//! plain f64 loops from the whole model's formula.

use super::rig::*;
use memwall::backend::{Backend, StepCtx};
use memwall::ir::{IGNORE_TARGET, Op, Precision, Rows, VocabShare};
use std::ops::Range;

const ROWS: Rows = Rows { b: B, t: T };
const N: usize = B * T;
const C: usize = 8;
const V: usize = 13;
/// The checked rank's token ids.
const PART: Range<usize> = 6..13;
const VP: usize = PART.end - PART.start;
const MAXT: usize = 8;
const LOSS_ROWS: usize = 20;
const LOSS_SCALE: f32 = 4.0;

/// Indices in the parameter (or gradient) buffer of parameter range `r`.
fn local(r: &Range<usize>) -> Range<usize> {
    r.start - PARAM_BASE..r.end - PARAM_BASE
}

/// Tokens over the whole vocabulary, both parts' ids among them.
fn tokens(rng: &mut Rng) -> Vec<u32> {
    let mut tok: Vec<u32> = (0..N).map(|_| rng.below(V as u64) as u32).collect();
    (tok[0], tok[1]) = (2, 9);
    tok
}

pub fn encoder_vocab_part(be: &dyn Backend, p: Precision) {
    for learned in [true, false] {
        let mut rig = Rig::new(p);
        let wte = rig.param(VP * C); // [Vpart, C]
        let wpe = learned.then(|| rig.param(MAXT * C)); // [maxT, C]
        let tokens_buf = rig.u32("tokens", N); // [B, T]
        let out = rig.act("out", N * C); // [N, C]
        let dout = rig.act("dout", N * C); // [N, C]
        let fwd = Op::Encoder {
            tokens: tokens_buf,
            positions: None,
            out,
            wte: wte.clone(),
            wpe: wpe.clone(),
            first_token: PART.start,
            rows: ROWS,
            c: C,
            scale: 1.0,
        };
        let fwd = rig.op(fwd, Bind::Params);
        let bwd = Op::EncoderBackward {
            dout,
            tokens: tokens_buf,
            positions: None,
            wte: wte.clone(),
            wpe: wpe.clone(),
            first_token: PART.start,
            rows: ROWS,
            c: C,
            scale: 1.0,
        };
        let bwd = rig.op(bwd, Bind::Grads);
        let mut s = rig.start(be);
        let mut rng = Rng::new(31);
        let w = s.fill(s.params(), &mut rng, -1.0, 1.0);
        let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
        let tok = tokens(&mut rng);
        s.put_u32(tokens_buf, &tok);
        s.fill(out, &mut rng, -1.0, 1.0);
        let d = s.fill(dout, &mut rng, -1.0, 1.0);
        s.run(fwd, &ctx());
        s.run(bwd, &ctx());
        let (mut want, mut grads) = (vec![0.0; N * C], wide(&g0));
        for (i, &t) in tok.iter().enumerate() {
            let held = PART.contains(&(t as usize));
            let row = (t as usize).wrapping_sub(PART.start);
            for j in 0..C {
                if held {
                    want[i * C + j] += w[local(&wte)][row * C + j] as f64;
                    grads[local(&wte).start + row * C + j] += d[i * C + j] as f64;
                }
                if let Some(wpe) = &wpe {
                    want[i * C + j] += w[local(wpe)][(i % T) * C + j] as f64;
                    grads[local(wpe).start + (i % T) * C + j] += d[i * C + j] as f64;
                }
            }
        }
        let what = format!("encoder of token ids {PART:?} (learned positions: {learned})");
        check(&format!("{what} out"), &s.get(out), &want, rounded(p));
        check(
            &format!("{what} grads"),
            &s.get(s.grads()),
            &grads,
            rounded(p),
        );
    }
}

/// The whole head's logits of each row `[N][V]` in f64, from `x` `[N, C]` and `w` `[V, C]`.
fn logits(x: &[f32], w: &[f64]) -> Vec<Vec<f64>> {
    x.chunks(C)
        .map(|xr| {
            (0..V)
                .map(|v| (0..C).map(|c| xr[c] as f64 * w[v * C + c]).sum())
                .collect()
        })
        .collect()
}

/// A part's statistics of a row of logits: (maximum, Σ exp(z − maximum), target logit or 0).
fn stats_ref(z: &[f64], part: Range<usize>, target: u32) -> [f64; 3] {
    let zp = &z[part.clone()];
    let m = zp.iter().cloned().fold(f64::MIN, f64::max);
    let held = target != IGNORE_TARGET && part.contains(&(target as usize));
    let t = if held { z[target as usize] } else { 0.0 };
    [m, zp.iter().map(|&v| (v - m).exp()).sum(), t]
}

/// The head of the rank holding [`PART`]: statistics, then (for each way: logits computed
/// again in chunks of 4 rows, or kept from the statistics in one chunk; training or
/// evaluating) the loss, the input gradient's share and the part's gradients.
pub fn lm_head_vocab_parallel(be: &dyn Backend, p: Precision) {
    for (kept, training) in [(false, true), (true, true), (false, false)] {
        let chunk = if kept { N } else { 4 };
        let mut rig = Rig::new(p);
        let other = rig.param((V - VP) * C); // [6, C]: the other rank's rows (reference only)
        let w = rig.param(VP * C); // [Vpart, C]
        let inp = rig.act("inp", N * C); // [N, C]
        let targets = rig.u32("targets", N); // [N]
        let losses = rig.f32("losses", N); // [N]
        let logits_buf = rig.f32("logits", chunk * VP); // [rows_per_chunk, Vpart]
        let stats = rig.f32("stats", N * 3); // [N, 3]
        let all = rig.f32("stats.all", 2 * N * 3); // [ranks, N, 3]
        let dinp = rig.act("dinp", N * C); // [N, C]
        let st = Op::LmHeadStats {
            inp,
            targets,
            logits: logits_buf,
            stats,
            w: w.clone(),
            first_token: PART.start,
            rows: ROWS,
            c: C,
            v: VP,
            rows_per_chunk: chunk,
        };
        let st = rig.op(st, Bind::Params);
        let vocab = VocabShare {
            first_token: PART.start,
            stats: all,
            ranks: 2,
            logits_kept: kept,
        };
        let loss = Op::LmHeadLoss {
            inp,
            targets,
            losses,
            logits: logits_buf,
            dinp: Some(dinp),
            w: w.clone(),
            rows: ROWS,
            c: C,
            v: VP,
            rows_per_chunk: chunk,
            vocab: Some(vocab),
            teacher: None,
            row_stats: None,
        };
        let loss = rig.op(loss, Bind::Both);
        let mut s = rig.start(be);
        let mut rng = Rng::new(32);
        let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
        let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
        let x = s.fill(inp, &mut rng, -1.0, 1.0);
        let mut tg = tokens(&mut rng);
        tg[3] = IGNORE_TARGET;
        s.put_u32(targets, &tg);
        s.fill(losses, &mut rng, -1.0, 1.0);
        let d0 = s.fill(dinp, &mut rng, -1.0, 1.0);
        s.run(st, &ctx());
        // The whole head: the other rank's rows, then this one's.
        let wv: Vec<f64> = wide(&pw[local(&other)])
            .into_iter()
            .chain(wide(&pw[local(&w)]))
            .collect();
        let z = logits(&x, &wv);
        let what = format!("lm_head_stats (token ids {PART:?}, chunk {chunk})");
        // The statistics as (maximum, the part's log-sum-exp, target logit): an error in the
        // logits moves the log of the sum by as much.
        let got: Vec<f32> = s
            .get(stats)
            .chunks(3)
            .flat_map(|r| [r[0], r[0] + r[1].ln(), r[2]])
            .collect();
        let want: Vec<f64> = (0..N)
            .flat_map(|i| {
                let [m, sum, t] = stats_ref(&z[i], PART, tg[i]);
                [m, m + sum.ln(), t]
            })
            .collect();
        check(&what, &got, &want, reduced(p));
        // Gathered: the other rank's from the reference, this rank's as it wrote them.
        let mine = s.get(stats);
        let first: Vec<f32> = (0..N)
            .flat_map(|i| stats_ref(&z[i], 0..PART.start, tg[i]).map(|v| v as f32))
            .collect();
        s.put(all, &[first, mine].concat());
        let ctx = StepCtx {
            training,
            loss_scale: LOSS_SCALE,
            loss_tokens: LOSS_ROWS,
            ..ctx()
        };
        s.run(loss, &ctx);
        let scale = LOSS_SCALE as f64 / LOSS_ROWS as f64;
        let (mut want_loss, mut dx, mut g) = (vec![0.0; N], vec![0.0; N * C], wide(&g0));
        for i in 0..N {
            if tg[i] == IGNORE_TARGET {
                continue;
            }
            let m = z[i].iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + z[i].iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
            want_loss[i] = lse - z[i][tg[i] as usize];
            for v in PART {
                let onehot = if v == tg[i] as usize { 1.0 } else { 0.0 };
                let dz = ((z[i][v] - lse).exp() - onehot) * scale;
                let row = v - PART.start;
                for c in 0..C {
                    dx[i * C + c] += dz * pw[local(&w)][row * C + c] as f64;
                    g[local(&w).start + row * C + c] += dz * x[i * C + c] as f64;
                }
            }
        }
        let what =
            format!("lm_head_loss over token ids {PART:?} (kept {kept}, training {training})");
        check(
            &format!("{what} losses"),
            &s.get(losses),
            &want_loss,
            reduced(p),
        );
        if training {
            check(&format!("{what} dinp"), &s.get(dinp), &dx, reduced(p));
            check(&format!("{what} grads"), &s.get(s.grads()), &g, reduced(p));
        } else {
            same(&format!("{what} dinp"), &s.get(dinp), &d0);
            same(&format!("{what} grads"), &s.get(s.grads()), &g0);
        }
    }
}
