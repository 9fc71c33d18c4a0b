//! Checks of the layer ops, forward and backward: each declares a one-op plan with small odd
//! shapes (B = 2, T = 5, widths that are no multiple of a vector), fills its inputs, runs the
//! op on the backend and compares every buffer it writes (its workspace excepted: attention's
//! tiles, the LM head's logits chunk) with a plain f64 reference written here from the op's
//! documented formula, computed on the inputs as stored. Outputs that an op overwrites are
//! filled with random values first (an element left unwritten fails); gradients that
//! accumulate start random (an op that overwrites them fails); the parameter and gradient
//! buffers are compared whole (an op that writes outside its ranges fails).
//!
//! Rows that pack examples (an op given `positions`, [`POSITIONS`]) are checked on the ops
//! that read them: the encoder's and RoPE's positions, attention's mask, forward and backward.
//!
//! `StepCtx::seq` (generation runs the forward on a prefix of each sequence) is checked where
//! it changes more than the number of rows (the encoder's and RoPE's positions, attention's
//! sequences, the LM head's last row) and on the matmul; generation plans are fp32 only, so
//! in fp32.
//!
//! Gemma's variants of the ops are checked beside the others': the RMS norms' gain `1 + w`
//! (`offset` 1, with weights near 0, as Gemma's start) forward and backward, the q/k norms'
//! likewise, the forward's residual (its post-norms), GeGLU beside SwiGLU ([`GluAct`]), and
//! the embedding's scale (√C) on the token rows, forward and backward.

use super::rig::*;
use memwall::backend::{Backend, StepCtx};
use memwall::ir::schedule::{GluAct, WeightLayout};
use memwall::ir::{IGNORE_TARGET, Op, Precision, Rows};
use std::ops::Range;

const ROWS: Rows = Rows { b: B, t: T };
const N: usize = B * T;

/// Indices in the parameter (or gradient) buffer of parameter range `r`.
fn local(r: &Range<usize>) -> Range<usize> {
    r.start - PARAM_BASE..r.end - PARAM_BASE
}

/// The sequence lengths each check runs with: the plan's, and in fp32 a prefix of 3.
fn seqs(p: Precision) -> Vec<Option<usize>> {
    match p {
        Precision::F32 => vec![None, Some(3)],
        _ => vec![None],
    }
}

/// Checks the first `want.len()` values of `got` and that the rest still hold `before`.
fn check_prefix(what: &str, got: &[f32], want: &[f64], before: &[f32], tol: Tol) {
    let n = want.len();
    check(what, &got[..n], want, tol);
    same(
        &format!("{what} (beyond the rows run)"),
        &got[n..],
        &before[n..],
    );
}

/// Statistics (mean, 1/std, log-sum-exp) are f32 whatever the storage: a few f32 roundings.
const STAT: Tol = Tol::rel(1e-5, 1e-5);

pub fn zero(be: &dyn Backend, p: Precision) {
    let mut rig = Rig::new(p);
    let a = rig.act("a", 37); // [37]
    let f = rig.f32("f", 37); // [37]
    let keep = rig.act("keep", 37); // [37], untouched
    let za = rig.op(Op::Zero { buf: a }, Bind::None);
    let zf = rig.op(Op::Zero { buf: f }, Bind::None);
    let mut s = rig.start(be);
    let mut rng = Rng::new(1);
    s.fill(a, &mut rng, 1.0, 2.0);
    s.fill(f, &mut rng, 1.0, 2.0);
    let k = s.fill(keep, &mut rng, 1.0, 2.0);
    s.run(za, &ctx());
    s.run(zf, &ctx());
    for id in [a, f] {
        let bytes = s.get_bytes(id);
        assert!(
            bytes.iter().all(|&b| b == 0),
            "zero: does not match the reference: {:?} is not all zero bits",
            s.plan.buffer(id).name
        );
    }
    same("zero: the buffer beside", &s.get(keep), &k);
}

/// An embedding scale as Gemma's (√C, for C = 6: not a power of two, so every product by it
/// rounds); 1 elsewhere.
fn embedding_scales() -> [f32; 2] {
    [1.0, 6f32.sqrt()]
}

pub fn encoder(be: &dyn Backend, p: Precision) {
    const V: usize = 13;
    const C: usize = 6;
    const MAXT: usize = 8;
    let variants = [true, false]
        .into_iter()
        .flat_map(|l| embedding_scales().map(|s| (l, s)));
    for (learned, scale) in variants {
        for (seq, packed) in runs(p) {
            let mut rig = Rig::new(p);
            let wte = rig.param(V * C); // [V, C]
            let wpe = learned.then(|| rig.param(MAXT * C)); // [maxT, C]
            let tokens = rig.u32("tokens", N); // [B, T]
            let positions = packed.then(|| rig.u32("positions", N)); // [B, T]
            let out = rig.act("out", N * C); // [N, C]
            let op = Op::Encoder {
                positions,
                tokens,
                out,
                wte: wte.clone(),
                wpe: wpe.clone(),
                first_token: 0,
                rows: ROWS,
                c: C,
                scale,
            };
            let op = rig.op(op, Bind::Params);
            let mut s = rig.start(be);
            let mut rng = Rng::new(2);
            let w = s.fill(s.params(), &mut rng, -1.0, 1.0);
            let tok: Vec<u32> = (0..N).map(|_| rng.below(V as u64) as u32).collect();
            s.put_u32(tokens, &tok);
            if let Some(id) = positions {
                s.put_u32(id, &POSITIONS);
            }
            let before = s.fill(out, &mut rng, -1.0, 1.0);
            s.run(op, &StepCtx { seq, ..ctx() });
            let tl = seq.unwrap_or(T);
            let mut want = vec![0.0; B * tl * C];
            for (i, row) in want.chunks_mut(C).enumerate() {
                let t = if packed {
                    POSITIONS[i] as usize
                } else {
                    i % tl
                };
                let wte = &w[local(&wte)];
                for (j, o) in row.iter_mut().enumerate() {
                    *o = wte[tok[i] as usize * C + j] as f64 * scale as f64;
                    if let Some(wpe) = &wpe {
                        *o += w[local(wpe)][t * C + j] as f64;
                    }
                }
            }
            let what = format!(
                "encoder out (learned positions: {learned}, scale {scale}, seq {seq:?}, packed \
                 {packed})"
            );
            check_prefix(&what, &s.get(out), &want, &before, rounded(p));
        }
    }
}

pub fn encoder_backward(be: &dyn Backend, p: Precision) {
    const V: usize = 13;
    const C: usize = 6;
    const MAXT: usize = 8;
    let gemma = embedding_scales()[1];
    let variants = [
        (true, false, 1.0),
        (true, true, 1.0),
        (false, false, 1.0),
        (true, true, gemma),
        (false, false, gemma),
    ];
    for (learned, packed, scale) in variants {
        let mut rig = Rig::new(p);
        let wte = rig.param(V * C); // [V, C]
        let wpe = learned.then(|| rig.param(MAXT * C)); // [maxT, C]
        let tokens = rig.u32("tokens", N); // [B, T]
        let positions = packed.then(|| rig.u32("positions", N)); // [B, T]
        let dout = rig.act("dout", N * C); // [N, C]
        let op = Op::EncoderBackward {
            positions,
            dout,
            tokens,
            wte: wte.clone(),
            wpe: wpe.clone(),
            first_token: 0,
            rows: ROWS,
            c: C,
            scale,
        };
        let op = rig.op(op, Bind::Grads);
        let mut s = rig.start(be);
        let mut rng = Rng::new(3);
        let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
        // Tokens from a few ids, so rows repeat.
        let tok: Vec<u32> = (0..N).map(|_| rng.below(4) as u32 * 3).collect();
        s.put_u32(tokens, &tok);
        if let Some(id) = positions {
            s.put_u32(id, &POSITIONS);
        }
        let d = s.fill(dout, &mut rng, -1.0, 1.0);
        s.run(op, &ctx());
        let mut want = wide(&g0);
        for i in 0..N {
            let t = if packed { POSITIONS[i] as usize } else { i % T };
            for j in 0..C {
                // The token rows' gradient scaled, the positions' not.
                want[local(&wte).start + tok[i] as usize * C + j] +=
                    scale as f64 * d[i * C + j] as f64;
                if let Some(wpe) = &wpe {
                    want[local(wpe).start + t * C + j] += d[i * C + j] as f64;
                }
            }
        }
        let what = format!(
            "encoder_backward grads (learned positions: {learned}, packed {packed}, scale \
             {scale})"
        );
        check(&what, &s.get(s.grads()), &want, rounded(p));
    }
}

/// Rows of `[N, C]` with a different mean per row (so a norm that skips the mean fails).
fn rows_with_offsets(rng: &mut Rng, n: usize, c: usize) -> Vec<f32> {
    let mut x = rng.uniform(n * c, -1.0, 1.0);
    for (i, row) in x.chunks_mut(c).enumerate() {
        row.iter_mut()
            .for_each(|v| *v += 0.5 * (i % 3) as f32 - 0.4);
    }
    x
}

/// Layer-norm statistics of `[n, c]` rows: (mean, rstd), biased variance.
fn ln_stats(x: &[f32], c: usize, eps: f32) -> (Vec<f64>, Vec<f64>) {
    x.chunks(c)
        .map(|row| {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
            (mean, 1.0 / (var + eps as f64).sqrt())
        })
        .unzip()
}

pub fn layernorm(be: &dyn Backend, p: Precision) {
    const C: usize = 12;
    const EPS: f32 = 1e-5;
    let mut rig = Rig::new(p);
    let w = rig.param(C); // [C]
    let b = rig.param(C); // [C]
    let inp = rig.act("inp", N * C); // [N, C]
    let out = rig.act("out", N * C); // [N, C]
    let mean = rig.f32("mean", N); // [N]
    let rstd = rig.f32("rstd", N); // [N]
    let op = Op::LayerNorm {
        inp,
        out,
        mean,
        rstd,
        w: w.clone(),
        b: b.clone(),
        rows: ROWS,
        c: C,
        eps: EPS,
    };
    let op = rig.op(op, Bind::Params);
    let mut s = rig.start(be);
    let mut rng = Rng::new(4);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let x = s.put(inp, &rows_with_offsets(&mut rng, N, C));
    for id in [out, mean, rstd] {
        s.fill(id, &mut rng, -1.0, 1.0);
    }
    s.run(op, &ctx());
    let (m, r) = ln_stats(&x, C, EPS);
    let (w, b) = (&pw[local(&w)], &pw[local(&b)]);
    let want: Vec<f64> = (0..N * C)
        .map(|k| {
            let (i, j) = (k / C, k % C);
            (x[k] as f64 - m[i]) * r[i] * w[j] as f64 + b[j] as f64
        })
        .collect();
    check("layernorm out", &s.get(out), &want, rounded(p));
    check("layernorm mean", &s.get(mean), &m, STAT);
    check("layernorm rstd", &s.get(rstd), &r, STAT);
}

pub fn layernorm_backward(be: &dyn Backend, p: Precision) {
    const C: usize = 12;
    let mut rig = Rig::new(p);
    let w = rig.param(C); // [C]
    let b = rig.param(C); // [C]
    let dinp = rig.act("dinp", N * C); // [N, C], accumulated into
    let dout = rig.act("dout", N * C); // [N, C]
    let inp = rig.act("inp", N * C); // [N, C]
    let mean = rig.f32("mean", N); // [N]
    let rstd = rig.f32("rstd", N); // [N]
    let op = Op::LayerNormBackward {
        dinp,
        dout,
        inp,
        mean,
        rstd,
        w: w.clone(),
        b: b.clone(),
        rows: ROWS,
        c: C,
    };
    let op = rig.op(op, Bind::Both);
    let mut s = rig.start(be);
    let mut rng = Rng::new(5);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
    let x = s.put(inp, &rows_with_offsets(&mut rng, N, C));
    let (m, r) = ln_stats(&x, C, 1e-5);
    let m = s.put(mean, &m.iter().map(|&v| v as f32).collect::<Vec<_>>());
    let r = s.put(rstd, &r.iter().map(|&v| v as f32).collect::<Vec<_>>());
    let dy = s.fill(dout, &mut rng, -1.0, 1.0);
    let dx0 = s.fill(dinp, &mut rng, -1.0, 1.0);
    s.run(op, &ctx());
    let (wv, (wr, br)) = (&pw[local(&w)], (local(&w), local(&b)));
    let mut dx = wide(&dx0);
    let mut g = wide(&g0);
    for i in 0..N {
        let row = i * C..(i + 1) * C;
        let (m, r) = (m[i] as f64, r[i] as f64);
        let xhat: Vec<f64> = x[row.clone()].iter().map(|&v| (v as f64 - m) * r).collect();
        let dyr = &dy[row.clone()];
        let dnorm: Vec<f64> = (0..C).map(|j| dyr[j] as f64 * wv[j] as f64).collect();
        let a = dnorm.iter().sum::<f64>() / C as f64;
        let bb = (0..C).map(|j| dnorm[j] * xhat[j]).sum::<f64>() / C as f64;
        for j in 0..C {
            dx[i * C + j] += (dnorm[j] - a - xhat[j] * bb) * r;
            g[wr.start + j] += dyr[j] as f64 * xhat[j];
            g[br.start + j] += dyr[j] as f64;
        }
    }
    check("layernorm_backward dinp", &s.get(dinp), &dx, reduced(p));
    check(
        "layernorm_backward grads",
        &s.get(s.grads()),
        &g,
        reduced(p),
    );
}

/// The range of a norm's weights: the suite's usual for the gain `w` (offset 0), near 0 for
/// Gemma's `1 + w` (offset 1: its weights start at 0), so a backend that drops the offset is
/// far off.
fn gain_weights(offset: f32) -> (f32, f32) {
    if offset == 0.0 {
        (-1.0, 1.0)
    } else {
        (-0.1, 0.1)
    }
}

pub fn rmsnorm(be: &dyn Backend, p: Precision) {
    const C: usize = 12;
    const EPS: f32 = 1e-5;
    // Llama's (gain w), Gemma's pre-norm (1 + w) and post-norm (1 + w, a residual added).
    for (offset, with_residual) in [(0.0, false), (1.0, false), (1.0, true)] {
        let mut rig = Rig::new(p);
        let w = rig.param(C); // [C]
        let inp = rig.act("inp", N * C); // [N, C]
        let out = rig.act("out", N * C); // [N, C]
        let residual = with_residual.then(|| rig.act("residual", N * C)); // [N, C]
        let rstd = rig.f32("rstd", N); // [N]
        let op = Op::RmsNorm {
            inp,
            out,
            residual,
            rstd,
            w: w.clone(),
            offset,
            rows: ROWS,
            c: C,
            eps: EPS,
        };
        let op = rig.op(op, Bind::Params);
        let mut s = rig.start(be);
        let mut rng = Rng::new(6);
        let (lo, hi) = gain_weights(offset);
        let pw = s.fill(s.params(), &mut rng, lo, hi);
        let x = s.put(inp, &rows_with_offsets(&mut rng, N, C));
        let y = residual.map(|id| s.fill(id, &mut rng, -1.0, 1.0));
        s.fill(out, &mut rng, -1.0, 1.0);
        s.fill(rstd, &mut rng, -1.0, 1.0);
        s.run(op, &ctx());
        let r: Vec<f64> = x
            .chunks(C)
            .map(|row| {
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / C as f64;
                1.0 / (ms + EPS as f64).sqrt()
            })
            .collect();
        let w = &pw[local(&w)];
        let want: Vec<f64> = (0..N * C)
            .map(|k| {
                let v = x[k] as f64 * r[k / C] * (offset as f64 + w[k % C] as f64);
                v + y.as_ref().map_or(0.0, |y| y[k] as f64)
            })
            .collect();
        let what = format!("rmsnorm (offset {offset}, residual {with_residual})");
        check(&format!("{what} out"), &s.get(out), &want, rounded(p));
        check(&format!("{what} rstd"), &s.get(rstd), &r, STAT);
    }
}

pub fn rmsnorm_backward(be: &dyn Backend, p: Precision) {
    const C: usize = 12;
    // Llama's gain w and Gemma's 1 + w (the weight's gradient is the gain's).
    for offset in [0.0, 1.0] {
        let mut rig = Rig::new(p);
        let w = rig.param(C); // [C]
        let dinp = rig.act("dinp", N * C); // [N, C], accumulated into
        let dout = rig.act("dout", N * C); // [N, C]
        let inp = rig.act("inp", N * C); // [N, C]
        let rstd = rig.f32("rstd", N); // [N]
        let op = Op::RmsNormBackward {
            dinp,
            dout,
            inp,
            rstd,
            w: w.clone(),
            offset,
            rows: ROWS,
            c: C,
        };
        let op = rig.op(op, Bind::Both);
        let mut s = rig.start(be);
        let mut rng = Rng::new(7);
        let (lo, hi) = gain_weights(offset);
        let pw = s.fill(s.params(), &mut rng, lo, hi);
        let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
        let x = s.put(inp, &rows_with_offsets(&mut rng, N, C));
        let r: Vec<f32> = x
            .chunks(C)
            .map(|row| {
                let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / C as f64;
                (1.0 / (ms + 1e-5).sqrt()) as f32
            })
            .collect();
        let r = s.put(rstd, &r);
        let dy = s.fill(dout, &mut rng, -1.0, 1.0);
        let dx0 = s.fill(dinp, &mut rng, -1.0, 1.0);
        s.run(op, &ctx());
        let (wv, wr) = (&pw[local(&w)], local(&w));
        let mut dx = wide(&dx0);
        let mut g = wide(&g0);
        for i in 0..N {
            let ri = r[i] as f64;
            let xhat: Vec<f64> = (0..C).map(|j| x[i * C + j] as f64 * ri).collect();
            let gy: Vec<f64> = (0..C)
                .map(|j| dy[i * C + j] as f64 * (offset as f64 + wv[j] as f64))
                .collect();
            let c = (0..C).map(|j| gy[j] * xhat[j]).sum::<f64>() / C as f64;
            for j in 0..C {
                dx[i * C + j] += ri * (gy[j] - xhat[j] * c);
                g[wr.start + j] += dy[i * C + j] as f64 * xhat[j];
            }
        }
        let what = format!("rmsnorm_backward (offset {offset})");
        check(&format!("{what} dinp"), &s.get(dinp), &dx, reduced(p));
        check(&format!("{what} grads"), &s.get(s.grads()), &g, reduced(p));
    }
}

/// Qwen3's q/k norm shape: 4 query heads, 2 key/value heads of 6 channels (QKV = 48).
const QK: (usize, usize, usize) = (4, 2, 6);

/// 1/rms of each query and key head of fused `[N, QKV]` rows, `[N, NH + NKV]`.
fn qk_rstd(x: &[f32], eps: f64) -> Vec<f64> {
    let (nh, nkv, hd) = QK;
    let qkv = (nh + 2 * nkv) * hd;
    x.chunks(qkv)
        .flat_map(|row| {
            row[..(nh + nkv) * hd].chunks(hd).map(move |h| {
                let ms = h.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / hd as f64;
                1.0 / (ms + eps).sqrt()
            })
        })
        .collect()
}

pub fn qk_norm(be: &dyn Backend, p: Precision) {
    let (nh, nkv, hd) = QK;
    let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
    const EPS: f32 = 1e-6;
    // Qwen3's gain w and Gemma's 1 + w.
    for offset in [0.0, 1.0] {
        let mut rig = Rig::new(p);
        let w = rig.param(2 * hd); // [2, hd]: q_norm, k_norm
        let inp = rig.act("inp", N * qkv); // [N, QKV]
        let out = rig.act("out", N * qkv); // [N, QKV]
        let rstd = rig.f32("rstd", N * heads); // [N, NH + NKV]
        let op = Op::QkNorm {
            inp,
            out,
            rstd,
            w: w.clone(),
            offset,
            rows: ROWS,
            nh,
            nkv,
            hd,
            eps: EPS,
        };
        let op = rig.op(op, Bind::Params);
        let mut s = rig.start(be);
        let mut rng = Rng::new(16);
        let (lo, hi) = gain_weights(offset);
        let pw = s.fill(s.params(), &mut rng, lo, hi);
        let x = s.put(inp, &rows_with_offsets(&mut rng, N * (nh + 2 * nkv), hd));
        s.fill(out, &mut rng, -1.0, 1.0);
        s.fill(rstd, &mut rng, -1.0, 1.0);
        s.run(op, &ctx());
        let r = qk_rstd(&x, EPS as f64);
        let w = &pw[local(&w)];
        let gain = |i: usize| offset as f64 + w[i] as f64;
        let want: Vec<f64> = (0..N * qkv)
            .map(|k| {
                let (i, h, j) = (k / qkv, (k % qkv) / hd, k % hd);
                match h {
                    h if h < nh => x[k] as f64 * r[i * heads + h] * gain(j),
                    h if h < heads => x[k] as f64 * r[i * heads + h] * gain(hd + j),
                    _ => x[k] as f64,
                }
            })
            .collect();
        let what = format!("qk_norm (offset {offset})");
        check(&format!("{what} out"), &s.get(out), &want, rounded(p));
        check(&format!("{what} rstd"), &s.get(rstd), &r, STAT);
    }
}

pub fn qk_norm_backward(be: &dyn Backend, p: Precision) {
    let (nh, nkv, hd) = QK;
    let (qkv, heads) = ((nh + 2 * nkv) * hd, nh + nkv);
    // Qwen3's gain w and Gemma's 1 + w (the weight's gradient is the gain's).
    for offset in [0.0, 1.0] {
        let mut rig = Rig::new(p);
        let w = rig.param(2 * hd); // [2, hd]
        let d = rig.act("d", N * qkv); // [N, QKV]: dout in, dinp out
        let inp = rig.act("inp", N * qkv); // [N, QKV]
        let rstd = rig.f32("rstd", N * heads); // [N, NH + NKV]
        let op = Op::QkNormBackward {
            d,
            inp,
            rstd,
            w: w.clone(),
            offset,
            rows: ROWS,
            nh,
            nkv,
            hd,
        };
        let op = rig.op(op, Bind::Both);
        let mut s = rig.start(be);
        let mut rng = Rng::new(17);
        let (lo, hi) = gain_weights(offset);
        let pw = s.fill(s.params(), &mut rng, lo, hi);
        let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
        let x = s.put(inp, &rows_with_offsets(&mut rng, N * (nh + 2 * nkv), hd));
        let r: Vec<f32> = qk_rstd(&x, 1e-6).iter().map(|&v| v as f32).collect();
        let r = s.put(rstd, &r);
        let dy = s.fill(d, &mut rng, -1.0, 1.0);
        s.run(op, &ctx());
        let wv = &pw[local(&w)];
        let wr = local(&w);
        let mut dx = wide(&dy); // value heads pass through
        let mut g = wide(&g0);
        for i in 0..N {
            for h in 0..heads {
                let (at, which) = (i * qkv + h * hd, usize::from(h >= nh));
                let ri = r[i * heads + h] as f64;
                let xhat: Vec<f64> = (0..hd).map(|j| x[at + j] as f64 * ri).collect();
                let gy: Vec<f64> = (0..hd)
                    .map(|j| dy[at + j] as f64 * (offset as f64 + wv[which * hd + j] as f64))
                    .collect();
                let c = (0..hd).map(|j| gy[j] * xhat[j]).sum::<f64>() / hd as f64;
                for j in 0..hd {
                    dx[at + j] = ri * (gy[j] - xhat[j] * c);
                    g[wr.start + which * hd + j] += dy[at + j] as f64 * xhat[j];
                }
            }
        }
        let what = format!("qk_norm_backward (offset {offset})");
        check(&format!("{what} d"), &s.get(d), &dx, reduced(p));
        check(&format!("{what} grads"), &s.get(s.grads()), &g, reduced(p));
    }
}

/// Element (k, o) of a linear layer's weight `w` in `layout` (W as `[IC, OC]`).
fn weight(w: &[f32], layout: WeightLayout, ic: usize, oc: usize, k: usize, o: usize) -> f64 {
    (match layout {
        WeightLayout::InOut => w[k * oc + o],
        WeightLayout::OutIn => w[o * ic + k],
    }) as f64
}

/// The index in `w` of element (k, o), as [`weight`].
fn weight_at(layout: WeightLayout, ic: usize, oc: usize, k: usize, o: usize) -> usize {
    match layout {
        WeightLayout::InOut => k * oc + o,
        WeightLayout::OutIn => o * ic + k,
    }
}

const LAYOUTS: [WeightLayout; 2] = [WeightLayout::InOut, WeightLayout::OutIn];

pub fn matmul(be: &dyn Backend, p: Precision) {
    const IC: usize = 7;
    const OC: usize = 9;
    for layout in LAYOUTS {
        for (bias, residual) in [(true, false), (false, true), (true, true), (false, false)] {
            for seq in seqs(p) {
                matmul_case(be, p, layout, bias, residual, seq, IC, OC);
            }
        }
    }
}

/// One [`matmul`] case: `out[N,OC] = (residual) + inp[N,IC] @ W (+ b)`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_case(
    be: &dyn Backend,
    p: Precision,
    layout: WeightLayout,
    bias: bool,
    residual: bool,
    seq: Option<usize>,
    ic: usize,
    oc: usize,
) {
    let mut rig = Rig::new(p);
    let w = rig.param(ic * oc); // [IC, OC] or [OC, IC]
    let b = bias.then(|| rig.param(oc)); // [OC]
    let inp = rig.act("inp", N * ic); // [N, IC]
    let out = rig.act("out", N * oc); // [N, OC]
    let res = residual.then(|| rig.act("residual", N * oc)); // [N, OC]
    let op = Op::Matmul {
        inp,
        out,
        residual: res,
        w: w.clone(),
        b: b.clone(),
        layout,
        rows: ROWS,
        ic,
        oc,
    };
    let op = rig.op(op, Bind::Params);
    let mut s = rig.start(be);
    let mut rng = Rng::new(8);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let x = s.fill(inp, &mut rng, -1.0, 1.0);
    let r = res.map(|id| s.fill(id, &mut rng, -1.0, 1.0));
    let before = s.fill(out, &mut rng, -1.0, 1.0);
    s.run(op, &StepCtx { seq, ..ctx() });
    let n = B * seq.unwrap_or(T);
    let wv = &pw[local(&w)];
    let want: Vec<f64> = (0..n * oc)
        .map(|e| {
            let (i, o) = (e / oc, e % oc);
            let mut acc: f64 = (0..ic)
                .map(|k| x[i * ic + k] as f64 * weight(wv, layout, ic, oc, k, o))
                .sum();
            if let Some(b) = &b {
                acc += pw[local(b)][o] as f64;
            }
            if let Some(r) = &r {
                acc += r[e] as f64;
            }
            acc
        })
        .collect();
    let what = format!("matmul out ({layout:?}, bias {bias}, residual {residual}, seq {seq:?})");
    check_prefix(&what, &s.get(out), &want, &before, reduced(p));
}

pub fn matmul_backward(be: &dyn Backend, p: Precision) {
    const IC: usize = 7;
    const OC: usize = 9;
    for layout in LAYOUTS {
        for bias in [true, false] {
            matmul_backward_case(be, p, layout, bias, IC, OC);
        }
    }
}

/// A linear layer whose weight the CUDA backend's weight tile holds a chunk of at a time
/// (`sizing::linear_tile`): IC = OC = 8448, 136 MiB in bf16/f16, over its 128 MiB
/// (`sizing::WEIGHT_CHUNK_BYTES`), so the forward converts it in two chunks of output features
/// (7936 and 512: each GEMM writing a column block of `out`, the bias added once after) and
/// the backward in two chunks of input features (a column block of `dinp` each), in both
/// layouts. A 71M-parameter weight, so the suite runs it only when asked (`--ignored`).
pub fn matmul_wide(be: &dyn Backend, p: Precision) {
    const WIDE: usize = 8448;
    for layout in LAYOUTS {
        matmul_case(be, p, layout, true, true, None, WIDE, WIDE);
        matmul_backward_case(be, p, layout, true, WIDE, WIDE);
    }
}

/// One [`matmul_backward`] case: `dinp = dout @ Wᵀ`, `dW += inpᵀ @ dout` (`[IC, OC]` in
/// `InOut`), `db += Σ dout`.
pub fn matmul_backward_case(
    be: &dyn Backend,
    p: Precision,
    layout: WeightLayout,
    bias: bool,
    ic: usize,
    oc: usize,
) {
    let mut rig = Rig::new(p);
    let w = rig.param(ic * oc); // [IC, OC] or [OC, IC]
    let b = bias.then(|| rig.param(oc)); // [OC]
    let dinp = rig.act("dinp", N * ic); // [N, IC], overwritten
    let dout = rig.act("dout", N * oc); // [N, OC]
    let inp = rig.act("inp", N * ic); // [N, IC]
    let op = Op::MatmulBackward {
        dinp,
        dout,
        inp,
        w: w.clone(),
        b: b.clone(),
        layout,
        rows: ROWS,
        ic,
        oc,
    };
    let op = rig.op(op, Bind::Both);
    let mut s = rig.start(be);
    let mut rng = Rng::new(9);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
    let x = s.fill(inp, &mut rng, -1.0, 1.0);
    let dy = s.fill(dout, &mut rng, -1.0, 1.0);
    s.fill(dinp, &mut rng, -1.0, 1.0);
    s.run(op, &ctx());
    let wv = &pw[local(&w)];
    let dx: Vec<f64> = (0..N * ic)
        .map(|e| {
            let (i, k) = (e / ic, e % ic);
            (0..oc)
                .map(|o| dy[i * oc + o] as f64 * weight(wv, layout, ic, oc, k, o))
                .sum()
        })
        .collect();
    let mut g = wide(&g0);
    for k in 0..ic {
        for o in 0..oc {
            let at = local(&w).start + weight_at(layout, ic, oc, k, o);
            g[at] += (0..N)
                .map(|i| x[i * ic + k] as f64 * dy[i * oc + o] as f64)
                .sum::<f64>();
        }
    }
    if let Some(b) = &b {
        for o in 0..oc {
            g[local(b).start + o] += (0..N).map(|i| dy[i * oc + o] as f64).sum::<f64>();
        }
    }
    let what = format!("matmul_backward ({layout:?}, bias {bias}, IC {ic}, OC {oc})");
    check(&format!("{what} dinp"), &s.get(dinp), &dx, reduced(p));
    check(&format!("{what} grads"), &s.get(s.grads()), &g, reduced(p));
}

/// Attention shapes: (NH, NKV, hd): grouped-query (2 query heads per KV head) and
/// multi-head with an odd head count.
const HEADS: [(usize, usize, usize); 2] = [(4, 2, 8), (3, 3, 4)];

/// Packed rows (B = 2, T = 5): each token's place in its example, row 0 examples of 2 and 3
/// tokens, row 1 of 1, 1 and 3.
const POSITIONS: [u32; N] = [0, 1, 0, 1, 2, 0, 0, 0, 1, 2];

/// A sliding window shorter than the rows' T (each query sees its last 2 keys, itself
/// included), run next to no window.
const WINDOWS: [Option<usize>; 2] = [None, Some(2)];

/// The first key query `i` of row `bb` attends: its example's first token (`pos` given: packed
/// rows), else 0; with a sliding window `w`, no earlier than `i + 1 - w`.
fn first_key(pos: Option<&[u32]>, w: Option<usize>, t: usize, bb: usize, i: usize) -> usize {
    let example = pos.map_or(0, |p| i - p[bb * t + i] as usize);
    example.max(w.map_or(0, |w| (i + 1).saturating_sub(w)))
}

/// Causal attention of `qkv` `[b, t, (nh + 2·nkv)·hd]`: (out `[b, t, nh·hd]`, lse
/// `[b, nh, t]`), scores scaled by 1/√[`scale_dim`], KV head h / g serving query head h; with
/// `pos` (packed rows) query i attends only keys `i − pos[i] ..= i`, with a sliding window
/// `win` only keys `i − win < j` as well.
/// What the attention checks divide scores by the square root of: not the head size (as
/// Gemma 3's `query_pre_attn_scalar` may not be), so the ops must read it.
fn scale_dim(hd: usize) -> f32 {
    hd as f32 + 3.0
}

fn attention_ref(
    qkv: &[f32],
    (b, t): (usize, usize),
    (nh, nkv, hd): (usize, usize, usize),
    (pos, win): (Option<&[u32]>, Option<usize>),
) -> (Vec<f64>, Vec<f64>) {
    let w = (nh + 2 * nkv) * hd;
    let (g, scale) = (nh / nkv, 1.0 / (scale_dim(hd) as f64).sqrt());
    let at = |bb: usize, i: usize, off: usize, c: usize| qkv[(bb * t + i) * w + off + c] as f64;
    let mut out = vec![0.0; b * t * nh * hd];
    let mut lse = vec![0.0; b * nh * t];
    for bb in 0..b {
        for h in 0..nh {
            let (qo, ko, vo) = (h * hd, (nh + h / g) * hd, (nh + nkv + h / g) * hd);
            for i in 0..t {
                let k0 = first_key(pos, win, t, bb, i);
                let s: Vec<f64> = (k0..=i)
                    .map(|j| {
                        (0..hd)
                            .map(|c| at(bb, i, qo, c) * at(bb, j, ko, c))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let l = m + s.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
                lse[(bb * nh + h) * t + i] = l;
                for c in 0..hd {
                    out[(bb * t + i) * nh * hd + h * hd + c] = (k0..=i)
                        .map(|j| (s[j - k0] - l).exp() * at(bb, j, vo, c))
                        .sum();
                }
            }
        }
    }
    (out, lse)
}

/// The gradient of [`attention_ref`]'s `out` with respect to `qkv`, given `dout`.
fn attention_backward_ref(
    qkv: &[f32],
    dout: &[f32],
    (b, t): (usize, usize),
    (nh, nkv, hd): (usize, usize, usize),
    (pos, win): (Option<&[u32]>, Option<usize>),
) -> Vec<f64> {
    let w = (nh + 2 * nkv) * hd;
    let (g, scale) = (nh / nkv, 1.0 / (scale_dim(hd) as f64).sqrt());
    let at = |bb: usize, i: usize, off: usize, c: usize| qkv[(bb * t + i) * w + off + c] as f64;
    let mut d = vec![0.0; b * t * w];
    for bb in 0..b {
        for h in 0..nh {
            let (qo, ko, vo) = (h * hd, (nh + h / g) * hd, (nh + nkv + h / g) * hd);
            for i in 0..t {
                let dy = |c: usize| dout[(bb * t + i) * nh * hd + h * hd + c] as f64;
                let k0 = first_key(pos, win, t, bb, i);
                let s: Vec<f64> = (k0..=i)
                    .map(|j| {
                        (0..hd)
                            .map(|c| at(bb, i, qo, c) * at(bb, j, ko, c))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|&v| (v - m).exp()).sum();
                let pr: Vec<f64> = s.iter().map(|&v| (v - m).exp() / z).collect();
                let dp: Vec<f64> = (k0..=i)
                    .map(|j| (0..hd).map(|c| dy(c) * at(bb, j, vo, c)).sum())
                    .collect();
                let dsum: f64 = pr.iter().zip(&dp).map(|(p, d)| p * d).sum();
                for j in k0..=i {
                    let (pj, dpj) = (pr[j - k0], dp[j - k0]);
                    let ds = pj * (dpj - dsum) * scale;
                    for c in 0..hd {
                        d[(bb * t + i) * w + qo + c] += ds * at(bb, j, ko, c);
                        d[(bb * t + j) * w + ko + c] += ds * at(bb, i, qo, c);
                        d[(bb * t + j) * w + vo + c] += pj * dy(c);
                    }
                }
            }
        }
    }
    d
}

/// The check's runs: each sequence length of [`seqs`] one example a row, then (training
/// plans only: the plan's sequence) rows packing examples at [`POSITIONS`].
fn runs(p: Precision) -> Vec<(Option<usize>, bool)> {
    let mut r: Vec<_> = seqs(p).into_iter().map(|s| (s, false)).collect();
    r.push((None, true));
    r
}

pub fn attention(be: &dyn Backend, p: Precision) {
    let all = HEADS.into_iter().flat_map(|h| WINDOWS.map(|win| (h, win)));
    for (heads @ (nh, nkv, hd), window) in all {
        for (seq, packed) in runs(p) {
            let mut rig = Rig::new(p);
            let w = (nh + 2 * nkv) * hd;
            let ws_len = be.attention_workspace_elems(rig.storage(), T, hd, window, THREADS);
            let qkv = rig.act("qkv", N * w); // [N, (NH + 2·NKV)·hd]
            let positions = packed.then(|| rig.u32("positions", N)); // [B, T]
            let out = rig.act("out", N * nh * hd); // [N, NH·hd]
            let lse = rig.f32("lse", B * nh * T); // [B, NH, T]
            let ws = rig.f32("ws", ws_len.max(1)); // the backend's attention workspace
            let op = Op::Attention {
                positions,
                qkv,
                out,
                lse,
                ws,
                rows: ROWS,
                nh,
                nkv,
                hd,
                window,
                scale_dim: scale_dim(hd),
            };
            let op = rig.op(op, Bind::None);
            let mut s = rig.start(be);
            let mut rng = Rng::new(10);
            let x = s.fill(qkv, &mut rng, -1.0, 1.0);
            let out0 = s.fill(out, &mut rng, -1.0, 1.0);
            let lse0 = s.fill(lse, &mut rng, -1.0, 1.0);
            if let Some(id) = positions {
                s.put_u32(id, &POSITIONS);
            }
            s.run(op, &StepCtx { seq, ..ctx() });
            let tl = seq.unwrap_or(T);
            let pos = packed.then_some(&POSITIONS[..]);
            let (o, l) = attention_ref(&x[..B * tl * w], (B, tl), heads, (pos, window));
            let what = format!(
                "attention (NH {nh}, NKV {nkv}, hd {hd}, seq {seq:?}, packed {packed}, \
                 window {window:?})"
            );
            check_prefix(&format!("{what} out"), &s.get(out), &o, &out0, reduced(p));
            check_prefix(&format!("{what} lse"), &s.get(lse), &l, &lse0, STAT);
        }
    }
}

pub fn attention_backward(be: &dyn Backend, p: Precision) {
    let all = HEADS
        .into_iter()
        .flat_map(|h| [(h, false), (h, true)])
        .flat_map(|hp| WINDOWS.map(|win| (hp, win)));
    for ((heads @ (nh, nkv, hd), packed), window) in all {
        let mut rig = Rig::new(p);
        let w = (nh + 2 * nkv) * hd;
        let ws_len = be.attention_workspace_elems(rig.storage(), T, hd, window, THREADS);
        let dqkv = rig.act("dqkv", N * w); // [N, (NH + 2·NKV)·hd], overwritten
        let dout = rig.act("dout", N * nh * hd); // [N, NH·hd]
        let qkv = rig.act("qkv", N * w); // [N, (NH + 2·NKV)·hd]
        let out = rig.act("out", N * nh * hd); // [N, NH·hd]
        let lse = rig.f32("lse", B * nh * T); // [B, NH, T]
        let ws = rig.f32("ws", ws_len.max(1)); // the backend's attention workspace
        let positions = packed.then(|| rig.u32("positions", N)); // [B, T]
        let op = Op::AttentionBackward {
            positions,
            dqkv,
            dout,
            qkv,
            out,
            lse,
            ws,
            rows: ROWS,
            nh,
            nkv,
            hd,
            window,
            scale_dim: scale_dim(hd),
        };
        let op = rig.op(op, Bind::None);
        let mut s = rig.start(be);
        let mut rng = Rng::new(11);
        let x = s.fill(qkv, &mut rng, -1.0, 1.0);
        let pos = packed.then_some(&POSITIONS[..]);
        if let Some(id) = positions {
            s.put_u32(id, &POSITIONS);
        }
        // The forward's results, as the plan keeps them for the backward.
        let (o, l) = attention_ref(&x, (B, T), heads, (pos, window));
        s.put(out, &o.iter().map(|&v| v as f32).collect::<Vec<_>>());
        s.put(lse, &l.iter().map(|&v| v as f32).collect::<Vec<_>>());
        let dy = s.fill(dout, &mut rng, -1.0, 1.0);
        s.fill(dqkv, &mut rng, -1.0, 1.0);
        s.run(op, &ctx());
        let want = attention_backward_ref(&x, &dy, (B, T), heads, (pos, window));
        let what = format!(
            "attention_backward dqkv (NH {nh}, NKV {nkv}, hd {hd}, packed {packed}, window \
             {window:?})"
        );
        check(&what, &s.get(dqkv), &want, reduced(p));
    }
}

pub fn rope(be: &dyn Backend, p: Precision) {
    rope_turn(be, p, false)
}

pub fn rope_inverse(be: &dyn Backend, p: Precision) {
    rope_turn(be, p, true)
}

/// RoPE on q|k|v `[N, (NH + 2·NKV)·hd]` in place: queries and keys turned and scaled
/// (LongRoPE's attention factor), values kept.
fn rope_turn(be: &dyn Backend, p: Precision, inverse: bool) {
    const NH: usize = 2;
    const NKV: usize = 1;
    const HD: usize = 8;
    const WIDTH: usize = (NH + 2 * NKV) * HD;
    const ROTATED: usize = (NH + NKV) * HD;
    // √(1 + ln 32 / ln 4096): Phi-3-mini-128k's.
    const SCALE: f32 = 1.190_238_1;
    let inv_freq: Vec<f32> = (0..HD / 2)
        .map(|i| 10000f64.powf(-2.0 * i as f64 / HD as f64) as f32)
        .collect();
    for (seq, packed) in runs(p) {
        let mut rig = Rig::new(p);
        let x = rig.act("qkv", N * WIDTH); // [N, (NH + 2·NKV)·hd]
        let positions = packed.then(|| rig.u32("positions", N)); // [B, T]
        let op = Op::Rope {
            positions,
            x,
            rows: ROWS,
            width: WIDTH,
            rotated: ROTATED,
            hd: HD,
            inv_freq: inv_freq.clone(),
            scale: SCALE,
            inverse,
        };
        let op = rig.op(op, Bind::None);
        let mut s = rig.start(be);
        let mut rng = Rng::new(12);
        let x0 = s.fill(x, &mut rng, -1.0, 1.0);
        if let Some(id) = positions {
            s.put_u32(id, &POSITIONS);
        }
        s.run(op, &StepCtx { seq, ..ctx() });
        let tl = seq.unwrap_or(T);
        let n = B * tl;
        let mut want = wide(&x0[..n * WIDTH]);
        let sign = if inverse { -1.0 } else { 1.0 };
        // Each row's position: its place in its example (packed rows) or in its sequence.
        let place = |r: usize| {
            if packed {
                POSITIONS[r] as usize
            } else {
                r % tl
            }
        };
        for r in 0..n {
            let pos = place(r) as f32;
            for head in 0..ROTATED / HD {
                let base = r * WIDTH + head * HD;
                for i in 0..HD / 2 {
                    // The angle as an f32 product, as transformers computes it.
                    let theta = (pos * inv_freq[i]) as f64 * sign;
                    let (a, b) = (x0[base + i] as f64, x0[base + i + HD / 2] as f64);
                    let (c, sn) = (theta.cos() * SCALE as f64, theta.sin() * SCALE as f64);
                    want[base + i] = a * c - b * sn;
                    want[base + i + HD / 2] = b * c + a * sn;
                }
            }
        }
        let got = s.get(x);
        let what = format!("rope (inverse {inverse}, seq {seq:?}, packed {packed})");
        check_prefix(&what, &got, &want, &x0, rounded(p));
        for r in 0..n {
            let v = r * WIDTH + ROTATED..(r + 1) * WIDTH;
            same(&format!("{what}: values"), &got[v.clone()], &x0[v]);
        }
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// A gated unit's gate activation and its derivative: SwiGLU's silu, GeGLU's tanh GELU.
fn glu_act_ref(act: GluAct, g: f64) -> (f64, f64) {
    match act {
        GluAct::Silu => {
            let sg = sigmoid(g);
            (g * sg, sg * (1.0 + g * (1.0 - sg)))
        }
        GluAct::GeluTanh => gelu_ref(g),
    }
}

const GLU_ACTS: [GluAct; 2] = [GluAct::Silu, GluAct::GeluTanh];

pub fn glu(be: &dyn Backend, p: Precision) {
    const H: usize = 6;
    for act in GLU_ACTS {
        let mut rig = Rig::new(p);
        let inp = rig.act("gate_up", N * 2 * H); // [N, 2H]: gate | up
        let out = rig.act("out", N * H); // [N, H]
        let op = rig.op(
            Op::Glu {
                inp,
                out,
                rows: ROWS,
                h: H,
                act,
            },
            Bind::None,
        );
        let mut s = rig.start(be);
        let mut rng = Rng::new(13);
        let x = s.fill(inp, &mut rng, -4.0, 4.0);
        s.fill(out, &mut rng, -1.0, 1.0);
        s.run(op, &ctx());
        let want: Vec<f64> = (0..N * H)
            .map(|e| {
                let (i, j) = (e / H, e % H);
                let (g, u) = (x[i * 2 * H + j] as f64, x[i * 2 * H + H + j] as f64);
                glu_act_ref(act, g).0 * u
            })
            .collect();
        check(
            &format!("glu ({act:?}) out"),
            &s.get(out),
            &want,
            rounded(p),
        );
    }
}

pub fn glu_backward(be: &dyn Backend, p: Precision) {
    const H: usize = 6;
    for act in GLU_ACTS {
        let mut rig = Rig::new(p);
        let dinp = rig.act("dgate_up", N * 2 * H); // [N, 2H], overwritten
        let dout = rig.act("dout", N * H); // [N, H]
        let inp = rig.act("gate_up", N * 2 * H); // [N, 2H]
        let op = Op::GluBackward {
            dinp,
            dout,
            inp,
            rows: ROWS,
            h: H,
            act,
        };
        let op = rig.op(op, Bind::None);
        let mut s = rig.start(be);
        let mut rng = Rng::new(14);
        let x = s.fill(inp, &mut rng, -4.0, 4.0);
        let dy = s.fill(dout, &mut rng, -1.0, 1.0);
        s.fill(dinp, &mut rng, -1.0, 1.0);
        s.run(op, &ctx());
        let mut want = vec![0.0; N * 2 * H];
        for i in 0..N {
            for j in 0..H {
                let (g, u) = (x[i * 2 * H + j] as f64, x[i * 2 * H + H + j] as f64);
                let ((a, da), d) = (glu_act_ref(act, g), dy[i * H + j] as f64);
                want[i * 2 * H + j] = d * u * da;
                want[i * 2 * H + H + j] = d * a;
            }
        }
        let what = format!("glu_backward ({act:?}) dinp");
        check(&what, &s.get(dinp), &want, rounded(p));
    }
}

/// GPT-2's tanh approximation: (gelu(x), gelu'(x)).
fn gelu_ref(x: f64) -> (f64, f64) {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    let u = k * (x + 0.044715 * x * x * x);
    let th = u.tanh();
    let y = 0.5 * x * (1.0 + th);
    let dy = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
    (y, dy)
}

pub fn gelu(be: &dyn Backend, p: Precision) {
    const WIDTH: usize = 11;
    let mut rig = Rig::new(p);
    let inp = rig.act("inp", N * WIDTH); // [N, width]
    let out = rig.act("out", N * WIDTH); // [N, width]
    let op = Op::Gelu {
        inp,
        out,
        rows: ROWS,
        width: WIDTH,
    };
    let op = rig.op(op, Bind::None);
    let mut s = rig.start(be);
    let mut rng = Rng::new(15);
    let x = s.fill(inp, &mut rng, -4.0, 4.0);
    s.fill(out, &mut rng, -1.0, 1.0);
    s.run(op, &ctx());
    let want: Vec<f64> = x.iter().map(|&v| gelu_ref(v as f64).0).collect();
    check("gelu out", &s.get(out), &want, rounded(p));
}

pub fn gelu_backward(be: &dyn Backend, p: Precision) {
    const WIDTH: usize = 11;
    let mut rig = Rig::new(p);
    let d = rig.act("d", N * WIDTH); // [N, width], in place
    let inp = rig.act("inp", N * WIDTH); // [N, width]
    let op = Op::GeluBackward {
        d,
        inp,
        rows: ROWS,
        width: WIDTH,
    };
    let op = rig.op(op, Bind::None);
    let mut s = rig.start(be);
    let mut rng = Rng::new(16);
    let x = s.fill(inp, &mut rng, -4.0, 4.0);
    let dy = s.fill(d, &mut rng, -1.0, 1.0);
    s.run(op, &ctx());
    let want: Vec<f64> = (0..N * WIDTH)
        .map(|e| dy[e] as f64 * gelu_ref(x[e] as f64).1)
        .collect();
    check("gelu_backward d", &s.get(d), &want, rounded(p));
}

/// The LM head's shapes: C = 8, V = 13, chunks of 4 rows (the last one short), the loss a
/// mean over 20 rows (as with 2 micro-batches), loss scale 4.
const HC: usize = 8;
const HV: usize = 13;
const CHUNK: usize = 4;
const LOSS_ROWS: usize = 20;
const LOSS_SCALE: f32 = 4.0;

/// A head's width C, vocabulary V and rows per logits chunk; its inputs' magnitude, and
/// where its targets lie.
#[derive(Clone, Copy)]
struct HeadShape {
    c: usize,
    v: usize,
    chunk: usize,
    /// Inputs drawn from `-x..x`.
    x: f32,
    /// `Some(s)`: the even rows' targets in `s..V`, the odd rows' below `s` (both sides of a
    /// chunk boundary); `None`: anywhere.
    split: Option<usize>,
}

/// The shape of most LM head checks.
const HEAD: HeadShape = HeadShape {
    c: HC,
    v: HV,
    chunk: CHUNK,
    x: 1.0,
    split: None,
};

/// The LM head's buffers and op: (op, inp, targets, losses, dinp, w).
struct Head {
    op: usize,
    inp: memwall::ir::BufId,
    targets: memwall::ir::BufId,
    losses: memwall::ir::BufId,
    dinp: Option<memwall::ir::BufId>,
    w: Range<usize>,
}

fn lm_head_rig(p: Precision, with_dinp: bool) -> (Rig, Head) {
    let bind = if with_dinp { Bind::Both } else { Bind::Params };
    lm_head_rig_of(p, HEAD, with_dinp, bind)
}

fn lm_head_rig_of(p: Precision, sh: HeadShape, with_dinp: bool, bind: Bind) -> (Rig, Head) {
    let mut rig = Rig::new(p);
    let w = rig.param(sh.v * sh.c); // [V, C]
    let inp = rig.act("inp", N * sh.c); // [N, C]
    let targets = rig.u32("targets", N); // [N]
    let losses = rig.f32("losses", N); // [N]
    let logits = rig.f32("logits", sh.chunk * sh.v); // [rows_per_chunk, V]
    let dinp = with_dinp.then(|| rig.act("dinp", N * sh.c)); // [N, C], overwritten
    let op = Op::LmHeadLoss {
        inp,
        targets,
        losses,
        logits,
        dinp,
        w: w.clone(),
        rows: ROWS,
        c: sh.c,
        v: sh.v,
        rows_per_chunk: sh.chunk,
        vocab: None,
        teacher: None,
        row_stats: None,
    };
    let op = rig.op(op, bind);
    let head = Head {
        op,
        inp,
        targets,
        losses,
        dinp,
        w,
    };
    (rig, head)
}

/// Per row of `x` `[N, C]`: (loss, d(loss · scale)/dlogits `[V]`) against `w` `[V, C]`; an
/// ignored target's row has loss 0 and no gradient.
fn head_ref(x: &[f32], w: &[f32], tg: &[u32], scale: f64) -> Vec<(f64, Vec<f64>)> {
    head_ref_of(HEAD, x, w, tg, scale)
}

fn head_ref_of(
    sh: HeadShape,
    x: &[f32],
    w: &[f32],
    tg: &[u32],
    scale: f64,
) -> Vec<(f64, Vec<f64>)> {
    let (hc, hv) = (sh.c, sh.v);
    x.chunks(hc)
        .zip(tg)
        .map(|(xr, &t)| {
            if t == IGNORE_TARGET {
                return (0.0, vec![0.0; hv]);
            }
            let z: Vec<f64> = (0..hv)
                .map(|v| (0..hc).map(|c| xr[c] as f64 * w[v * hc + c] as f64).sum())
                .collect();
            let m = z.iter().cloned().fold(f64::MIN, f64::max);
            let lse = m + z.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
            let dz = (0..hv)
                .map(|v| ((z[v] - lse).exp() - if v == t as usize { 1.0 } else { 0.0 }) * scale)
                .collect();
            (lse - z[t as usize], dz)
        })
        .collect()
}

pub fn lm_head_loss(be: &dyn Backend, p: Precision) {
    lm_head_loss_of(be, p, HEAD, Bind::Both);
}

/// The LM head over a vocabulary wider than the CUDA backend's weight tile holds at once:
/// V·C = 70000 × 1024, 137 MiB in bf16/f16, over its 128 MiB (`sizing::WEIGHT_CHUNK_BYTES`),
/// so its weight is converted in two chunks of vocabulary rows (65536 and 4464), the logits
/// written a column block per chunk and `dinp` summed over the chunks. Targets on both sides
/// of row 65536, logits of a few units (a peaked softmax), so a chunk misplaced or left out
/// moves the losses, `dinp` and the target rows' gradients past the tolerances. Checked as
/// `lm_head_loss`, trained and frozen (a QLoRA head: no gradient). A 72M-parameter head, so
/// the suite runs it only when asked (`--ignored`).
pub fn lm_head_loss_wide(be: &dyn Backend, p: Precision) {
    let sh = HeadShape {
        c: 1024,
        v: 70_000,
        chunk: 4,
        x: 0.28, // logits of the same few units as 0.4 gave at C = 512
        split: Some(65_536),
    };
    lm_head_loss_of(be, p, sh, Bind::Both);
    lm_head_loss_of(be, p, sh, Bind::Frozen);
}

/// [`lm_head_loss`] for shape `sh`, the op bound as `bind` (`Both`: trained; `Frozen`: the
/// gradients left alone).
fn lm_head_loss_of(be: &dyn Backend, p: Precision, sh: HeadShape, bind: Bind) {
    let (hc, hv) = (sh.c, sh.v);
    let (rig, h) = lm_head_rig_of(p, sh, true, bind);
    let mut s = rig.start(be);
    let mut rng = Rng::new(17);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
    let x = s.fill(h.inp, &mut rng, -sh.x, sh.x);
    let mut tg: Vec<u32> = match sh.split {
        None => (0..N).map(|_| rng.below(hv as u64) as u32).collect(),
        Some(at) => (0..N)
            .map(|i| match i % 2 {
                0 => (at as u64 + rng.below((hv - at) as u64)) as u32,
                _ => rng.below(at as u64) as u32,
            })
            .collect(),
    };
    // Two targets not trained (a chat prompt's, padding): no loss, no gradient.
    tg[1] = IGNORE_TARGET;
    tg[N - 1] = IGNORE_TARGET;
    s.put_u32(h.targets, &tg);
    s.fill(h.losses, &mut rng, -1.0, 1.0);
    let dinp = h.dinp.expect("training head");
    s.fill(dinp, &mut rng, -1.0, 1.0);
    let ctx = StepCtx {
        loss_scale: LOSS_SCALE,
        loss_tokens: LOSS_ROWS,
        ..ctx()
    };
    s.run(h.op, &ctx);
    let wv = &pw[local(&h.w)];
    let rows = head_ref_of(sh, &x, wv, &tg, LOSS_SCALE as f64 / LOSS_ROWS as f64);
    let loss: Vec<f64> = rows.iter().map(|r| r.0).collect();
    let mut dx = vec![0.0; N * hc];
    let mut g = wide(&g0);
    // Row by row of the weight (a large head's columns are far apart in memory).
    for (i, (_, dz)) in rows.iter().enumerate() {
        let (xi, dxi) = (&x[i * hc..][..hc], &mut dx[i * hc..][..hc]);
        for (v, &dzv) in dz.iter().enumerate() {
            for (d, &wc) in dxi.iter_mut().zip(&wv[v * hc..][..hc]) {
                *d += dzv * wc as f64;
            }
            if bind != Bind::Frozen {
                let gv = &mut g[local(&h.w).start + v * hc..][..hc];
                for (gc, &xc) in gv.iter_mut().zip(xi) {
                    *gc += dzv * xc as f64;
                }
            }
        }
    }
    let what = if bind == Bind::Frozen {
        format!("lm_head_loss (V {hv}, C {hc}, frozen)")
    } else {
        format!("lm_head_loss (V {hv}, C {hc})")
    };
    check(
        &format!("{what} losses"),
        &s.get(h.losses),
        &loss,
        reduced(p),
    );
    check(&format!("{what} dinp"), &s.get(dinp), &dx, reduced(p));
    let grads = s.get(s.grads());
    if bind == Bind::Frozen {
        same(&format!("{what} grads"), &grads, &g0);
    } else {
        check(&format!("{what} grads"), &grads, &g, reduced(p));
    }
}

/// The LM head's weight gradient taken after the backward (`--update in-backward`): the head
/// op with `row_stats` writes the losses, `dinp` and each row's statistics but no weight
/// gradient; then [`Op::LmHeadWeightGrad`] over two slices of the vocabulary (words 0..5
/// and 5..V, targets on both sides; the last chunk of rows short) adds each slice's rows
/// of it. Every output against the f64 reference, and the slices' gradient bitwise the one
/// [`Op::LmHeadLoss`] takes whole on the same inputs (the same chunks of rows).
pub fn lm_head_weight_grad(be: &dyn Backend, p: Precision) {
    let run = |sliced: bool| {
        let (mut rig, h) = lm_head_rig(p, true);
        let stats = rig.f32("row_stats", N * 2); // [N, 2]
        let slice_logits = rig.f32("slice.logits", CHUNK * HV); // [rows_per_chunk, v]
        let cut = 5;
        let slices = if sliced {
            let Op::LmHeadLoss { row_stats, .. } = rig.op_mut(h.op) else {
                unreachable!("the rig's op is the head")
            };
            *row_stats = Some(stats);
            [0..cut, cut..HV]
                .into_iter()
                .map(|words| {
                    let w = h.w.start + words.start * HC..h.w.start + words.end * HC;
                    let op = Op::LmHeadWeightGrad {
                        inp: h.inp,
                        targets: h.targets,
                        row_stats: stats,
                        logits: slice_logits,
                        w,
                        first_token: words.start,
                        rows: ROWS,
                        c: HC,
                        v: words.len(),
                        rows_per_chunk: CHUNK,
                    };
                    rig.op(op, Bind::Both)
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut s = rig.start(be);
        let mut rng = Rng::new(17);
        let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
        let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
        let x = s.fill(h.inp, &mut rng, -1.0, 1.0);
        let mut tg: Vec<u32> = (0..N).map(|i| (i * 7 % HV) as u32).collect();
        tg[1] = IGNORE_TARGET;
        s.put_u32(h.targets, &tg);
        let ctx = StepCtx {
            loss_scale: LOSS_SCALE,
            loss_tokens: LOSS_ROWS,
            ..ctx()
        };
        s.run(h.op, &ctx);
        if sliced {
            // The head took no weight gradient.
            same("lm_head_loss with row_stats: grads", &s.get(s.grads()), &g0);
        }
        for &op in &slices {
            s.run(op, &ctx);
        }
        let wv = &pw[local(&h.w)];
        let rows = head_ref(&x, wv, &tg, LOSS_SCALE as f64 / LOSS_ROWS as f64);
        let mut g = wide(&g0);
        for (i, (_, dz)) in rows.iter().enumerate() {
            for (v, &dzv) in dz.iter().enumerate() {
                let gv = &mut g[local(&h.w).start + v * HC..][..HC];
                for (gc, &xc) in gv.iter_mut().zip(&x[i * HC..][..HC]) {
                    *gc += dzv * xc as f64;
                }
            }
        }
        let loss: Vec<f64> = rows.iter().map(|r| r.0).collect();
        let what = format!("lm_head_weight_grad (sliced {sliced})");
        check(
            &format!("{what} losses"),
            &s.get(h.losses),
            &loss,
            reduced(p),
        );
        let grads = s.get(s.grads());
        check(&format!("{what} grads"), &grads, &g, reduced(p));
        (
            s.get(h.losses),
            s.get(h.dinp.expect("training head")),
            grads,
        )
    };
    let (whole, sliced) = (run(false), run(true));
    same("lm_head_weight_grad: losses", &sliced.0, &whole.0);
    same("lm_head_weight_grad: dinp", &sliced.1, &whole.1);
    same("lm_head_weight_grad: grads", &sliced.2, &whole.2);
}

/// The LM head distilling (`teacher`): per row the loss α · KL(softmax(h Wtᵀ) ‖ softmax(x
/// Wᵀ)) + (1 − α) · cross-entropy, its input's and weight's gradients, the teacher's logits
/// computed from its final-norm output `h` `[N, Ct]` and head `Wt` `[V, Ct]` a chunk of rows
/// at a time (the last chunk short); two targets not trained.
pub fn lm_head_distill(be: &dyn Backend, p: Precision) {
    use memwall::ir::schedule::TeacherLogits;
    const TC: usize = 5;
    let alpha = 0.75;
    let (mut rig, h) = lm_head_rig(p, true);
    let hidden = rig.f32("teacher.hidden", N * TC); // [N, Ct]
    let head = rig.f32("teacher.head", HV * TC); // [V, Ct]
    let tl = rig.f32("teacher.logits", CHUNK * HV); // [rows_per_chunk, V]
    let Op::LmHeadLoss { teacher, .. } = rig.op_mut(h.op) else {
        unreachable!("the rig's op is the head")
    };
    *teacher = Some(TeacherLogits {
        hidden,
        w: head,
        logits: tl,
        c: TC,
        alpha,
    });
    let mut s = rig.start(be);
    let mut rng = Rng::new(19);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
    let x = s.fill(h.inp, &mut rng, -1.0, 1.0);
    let th = s.fill(hidden, &mut rng, -1.0, 1.0);
    let tw = s.fill(head, &mut rng, -1.0, 1.0);
    let mut tg: Vec<u32> = (0..N).map(|_| rng.below(HV as u64) as u32).collect();
    tg[0] = IGNORE_TARGET;
    tg[N - 2] = IGNORE_TARGET;
    s.put_u32(h.targets, &tg);
    let dinp = h.dinp.expect("training head");
    s.fill(dinp, &mut rng, -1.0, 1.0);
    let ctx = StepCtx {
        loss_scale: LOSS_SCALE,
        loss_tokens: LOSS_ROWS,
        ..ctx()
    };
    s.run(h.op, &ctx);
    let (wv, scale) = (&pw[local(&h.w)], LOSS_SCALE as f64 / LOSS_ROWS as f64);
    let log_softmax = |z: Vec<f64>| {
        let m = z.iter().cloned().fold(f64::MIN, f64::max);
        let lse = m + z.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
        z.into_iter().map(|v| v - lse).collect::<Vec<f64>>()
    };
    let (mut loss, mut dx, mut g) = (vec![0.0; N], vec![0.0; N * HC], wide(&g0));
    for i in 0..N {
        if tg[i] == IGNORE_TARGET {
            continue;
        }
        let (xi, hi) = (&x[i * HC..][..HC], &th[i * TC..][..TC]);
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&p, &q)| p as f64 * q as f64).sum();
        let ls = log_softmax((0..HV).map(|v| dot(xi, &wv[v * HC..][..HC])).collect());
        let lt = log_softmax((0..HV).map(|v| dot(hi, &tw[v * TC..][..TC])).collect());
        let a = alpha as f64;
        let kl: f64 = (0..HV).map(|v| lt[v].exp() * (lt[v] - ls[v])).sum();
        loss[i] = a * kl - (1.0 - a) * ls[tg[i] as usize];
        for v in 0..HV {
            let onehot = if v == tg[i] as usize { 1.0 } else { 0.0 };
            let dz = scale * (ls[v].exp() - a * lt[v].exp() - (1.0 - a) * onehot);
            for c in 0..HC {
                dx[i * HC + c] += dz * wv[v * HC + c] as f64;
                g[local(&h.w).start + v * HC + c] += dz * xi[c] as f64;
            }
        }
    }
    let what = "lm_head_loss distilling";
    check(
        &format!("{what} losses"),
        &s.get(h.losses),
        &loss,
        reduced(p),
    );
    check(&format!("{what} dinp"), &s.get(dinp), &dx, reduced(p));
    check(&format!("{what} grads"), &s.get(s.grads()), &g, reduced(p));
}

/// The LM head evaluating: not training (or training without `dinp`): losses only, no
/// gradient written.
pub fn lm_head_eval(be: &dyn Backend, p: Precision) {
    for (with_dinp, training) in [(true, false), (false, true)] {
        let (rig, h) = lm_head_rig(p, with_dinp);
        let mut s = rig.start(be);
        let mut rng = Rng::new(18);
        let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
        let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
        let x = s.fill(h.inp, &mut rng, -1.0, 1.0);
        let mut tg: Vec<u32> = (0..N).map(|_| rng.below(HV as u64) as u32).collect();
        tg[2] = IGNORE_TARGET;
        s.put_u32(h.targets, &tg);
        s.fill(h.losses, &mut rng, -1.0, 1.0);
        let d0 = h.dinp.map(|d| s.fill(d, &mut rng, -1.0, 1.0));
        let ctx = StepCtx {
            training,
            loss_scale: LOSS_SCALE,
            ..ctx()
        };
        s.run(h.op, &ctx);
        let rows = head_ref(&x, &pw[local(&h.w)], &tg, 1.0);
        let loss: Vec<f64> = rows.iter().map(|r| r.0).collect();
        let what = format!("lm_head_loss evaluating (dinp {with_dinp}, training {training})");
        check(
            &format!("{what} losses"),
            &s.get(h.losses),
            &loss,
            reduced(p),
        );
        same(&format!("{what} grads"), &s.get(s.grads()), &g0);
        if let (Some(d), Some(d0)) = (h.dinp, d0) {
            same(&format!("{what} dinp"), &s.get(d), &d0);
        }
    }
}

/// Next-token logits of the last row run (generation plans: fp32 only).
pub fn lm_head_last(be: &dyn Backend, p: Precision) {
    for seq in seqs(p) {
        let mut rig = Rig::new(p);
        let w = rig.param(HV * HC); // [V, C]
        let inp = rig.act("inp", N * HC); // [N, C]
        let logits = rig.f32("logits", HV); // [V]
        let op = Op::LmHeadLast {
            inp,
            logits,
            w: w.clone(),
            rows: ROWS,
            c: HC,
            v: HV,
        };
        let op = rig.op(op, Bind::Params);
        let mut s = rig.start(be);
        let mut rng = Rng::new(19);
        let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
        let x = s.fill(inp, &mut rng, -1.0, 1.0);
        s.fill(logits, &mut rng, -1.0, 1.0);
        s.run(op, &StepCtx { seq, ..ctx() });
        let last = B * seq.unwrap_or(T) - 1;
        let wv = &pw[local(&w)];
        let want: Vec<f64> = (0..HV)
            .map(|v| {
                (0..HC)
                    .map(|c| x[last * HC + c] as f64 * wv[v * HC + c] as f64)
                    .sum()
            })
            .collect();
        check(
            &format!("lm_head_last logits (seq {seq:?})"),
            &s.get(logits),
            &want,
            reduced(p),
        );
    }
}
