//! Checks of the ops on the training state and on bytes: `Zero` is with the layers; here the
//! gradient norm's share, `AdamW` in each optimizer-state format, transfers to and from the
//! disk tier, and the collectives among ranks (as threads, over `dist::Local`).

use super::rig::*;
use memwall::backend::{AdamWStep, Backend, StepCtx};
use memwall::dist::Local;
use memwall::dtype::DType;
use memwall::ir::Cut;
use memwall::ir::schedule::OpEntry;
use memwall::ir::shard::{Sharding, Zero};
use memwall::ir::strategy::QBLOCK;
use memwall::ir::{
    BlockScales, Op, OptimBufs, OptimState, ParamSlice, Precision, Reduce, TensorPart,
};
use std::ops::Range;
use std::sync::Arc;

fn local(r: &Range<usize>) -> Range<usize> {
    r.start - PARAM_BASE..r.end - PARAM_BASE
}

pub fn grad_norm(be: &dyn Backend, p: Precision) {
    let mut rig = Rig::new(p);
    let a = rig.param(37);
    let b = rig.param(20);
    // The shares go to their slots of one f64 buffer, which the executor reads once; the
    // slot between them is left as it was.
    let out = rig.buf("grad_norm.shares", DType::F64, 3);
    let ops = [(a.clone(), 0), (b.clone(), 2)].map(|(range, slot)| {
        let op = Op::GradNorm {
            range,
            out,
            slot,
            parts: false,
        };
        rig.op(op, Bind::Grads)
    });
    let mut s = rig.start(be);
    s.put_bytes(out, &[7.0f64; 3].map(f64::to_le_bytes).concat());
    let mut rng = Rng::new(20);
    let g = s.fill(s.grads(), &mut rng, -2.0, 2.0);
    for op in ops {
        s.run(op, &ctx());
    }
    let got = s.get_f64(out);
    assert_eq!(got[1], 7.0, "grad_norm wrote outside its slot: {got:?}");
    for (r, slot) in [(a, 0), (b, 2)] {
        let want: f64 = g[local(&r)].iter().map(|&v| (v as f64).powi(2)).sum();
        let what = format!("grad_norm share of {r:?}");
        check(&what, &[got[slot] as f32], &[want], Tol::rel(1e-5, 0.0));
    }
}

/// The step every `AdamW` check applies (step 3: bias correction matters; a clipping factor).
const STEP: AdamWStep = AdamWStep {
    lr: 0.01,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
    step: 3,
    grad_scale: 0.5,
};

/// AdamW on one element, as `torch.optim.AdamW`: (p, m, v) after the step.
fn adamw_ref(p: f64, g: f64, m: f64, v: f64, decay: bool) -> (f64, f64, f64) {
    let s = &STEP;
    let (b1, b2) = (s.beta1 as f64, s.beta2 as f64);
    let g = g * s.grad_scale as f64;
    let wd = if decay { s.weight_decay as f64 } else { 0.0 };
    let p = p * (1.0 - s.lr as f64 * wd);
    let m = b1 * m + (1.0 - b1) * g;
    let v = b2 * v + (1.0 - b2) * g * g;
    let t = s.step as i32;
    let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
    let p = p - (s.lr as f64 / c1) * m / (v.sqrt() / c2.sqrt() + s.eps as f64);
    (p, m, v)
}

/// The 8-bit codes' values (the format, `ir::strategy::OptimState::Int8`): m (i8) ±k ↔
/// ±scale·2^((k−127)/8), v (u8) k ↔ scale·2^((k−255)/8), code 0 ↔ 0.
fn decode_m(code: i8, scale: f32) -> f64 {
    let k = (code as i32).clamp(-127, 127);
    if k == 0 {
        return 0.0;
    }
    k.signum() as f64 * scale as f64 * 2f64.powf((k.abs() - 127) as f64 / 8.0)
}

fn decode_v(code: u8, scale: f32) -> f64 {
    if code == 0 {
        return 0.0;
    }
    scale as f64 * 2f64.powf((code as f64 - 255.0) / 8.0)
}

pub fn adamw_f32_state(be: &dyn Backend, p: Precision) {
    adamw(be, p, OptimState::F32)
}

pub fn adamw_bf16_state(be: &dyn Backend, p: Precision) {
    adamw(be, p, OptimState::Bf16)
}

pub fn adamw_int8_state(be: &dyn Backend, p: Precision) {
    adamw(be, p, OptimState::Int8)
}

/// The first 8-bit block of the rig's moments (not 0: the op's blocks are counted from the
/// moments' `block_base`).
const BLOCK_BASE: usize = 5;

/// `AdamW` over two tensors of one group (one with weight decay, one without; the first
/// longer than an 8-bit block), the moments in `format` covering the group from
/// [`PARAM_BASE`].
fn adamw(be: &dyn Backend, p: Precision, format: OptimState) {
    let mut rig = Rig::new(p);
    let t0 = rig.param(QBLOCK + 52); // two 8-bit blocks
    let t1 = rig.param(50); // one block
    let len = rig.space().len();
    // Each tensor with its first 8-bit block.
    let blocks = [(t0.clone(), BLOCK_BASE), (t1.clone(), BLOCK_BASE + 2)];
    let n_blocks = 3;
    // Moments of the whole group (gaps included, which no op touches): [len], or 8-bit codes
    // [len] with f32 scales [blocks].
    let (m, v, m_scale, v_scale) = match format {
        OptimState::F32 => (rig.f32("m", len), rig.f32("v", len), None, None),
        OptimState::Bf16 => {
            let m = rig.buf("m", DType::Bf16, len);
            (m, rig.buf("v", DType::Bf16, len), None, None)
        }
        OptimState::Int8 => (
            rig.buf("m.q", DType::I8, len),
            rig.buf("v.q", DType::U8, len),
            Some(rig.f32("m.absmax", n_blocks)),
            Some(rig.f32("v.absmax", n_blocks)),
        ),
    };
    let state = OptimBufs {
        format,
        m,
        v,
        m_scale,
        v_scale,
        base: PARAM_BASE,
        block_base: BLOCK_BASE,
    };
    let tensors = vec![
        ParamSlice {
            range: t0.clone(),
            decay: true,
            state_block: BLOCK_BASE,
            part: None,
        },
        ParamSlice {
            range: t1.clone(),
            decay: false,
            state_block: BLOCK_BASE + 2,
            part: None,
        },
    ];
    let op = rig.op(
        Op::AdamW {
            tensors,
            state,
            scales: None,
        },
        Bind::Both,
    );
    let mut s = rig.start(be);
    let mut rng = Rng::new(21 + format as u64);
    let p0 = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let g = s.fill(s.grads(), &mut rng, -1.0, 1.0);
    // The moments before the step, as the op reads them (decoded).
    let (m0, v0): (Vec<f64>, Vec<f64>) = match format {
        OptimState::F32 | OptimState::Bf16 => {
            let m0 = s.fill(m, &mut rng, -0.1, 0.1);
            let v0 = s.fill(v, &mut rng, 1e-4, 1e-2);
            (wide(&m0), wide(&v0))
        }
        OptimState::Int8 => {
            let mc: Vec<i8> = (0..len)
                .map(|_| (rng.below(255) as i32 - 127) as i8)
                .collect();
            let vc: Vec<u8> = (0..len).map(|_| 200 + rng.below(56) as u8).collect();
            let ms = s.fill(m_scale.unwrap(), &mut rng, 0.05, 0.1);
            let vs = s.fill(v_scale.unwrap(), &mut rng, 0.005, 0.01);
            s.put_bytes(m, &mc.iter().map(|&c| c as u8).collect::<Vec<_>>());
            s.put_bytes(v, &vc);
            let mut m0 = vec![0.0; len];
            let mut v0 = vec![0.0; len];
            for (r, first) in &blocks {
                for (k, e) in local(r).enumerate() {
                    let b = first + k / QBLOCK - BLOCK_BASE;
                    m0[e] = decode_m(mc[e], ms[b]);
                    v0[e] = decode_v(vc[e], vs[b]);
                }
            }
            (m0, v0)
        }
    };
    let (m_bytes, v_bytes) = (s.get_bytes(m), s.get_bytes(v));
    s.run(
        op,
        &StepCtx {
            update: Some(STEP),
            ..ctx()
        },
    );
    let mut want_p = wide(&p0);
    let (mut want_m, mut want_v) = (m0.clone(), v0.clone());
    for (r, decay) in [(&t0, true), (&t1, false)] {
        for e in local(r) {
            (want_p[e], want_m[e], want_v[e]) =
                adamw_ref(p0[e] as f64, g[e] as f64, m0[e], v0[e], decay);
        }
    }
    let what = format!("adamw ({format} state)");
    // The update is a few f32 operations on values of about 1.
    check(
        &format!("{what} params"),
        &s.get(s.params()),
        &want_p,
        Tol::rel(1e-6, 1e-7),
    );
    same(&format!("{what} grads (read only)"), &s.get(s.grads()), &g);
    let gaps: Vec<usize> = (0..len)
        .filter(|e| !local(&t0).contains(e) && !local(&t1).contains(e))
        .collect();
    match format {
        OptimState::F32 | OptimState::Bf16 => {
            // f32: a few roundings; bf16: the new moments rounded once when stored.
            // (β1·m + (1−β1)·g may cancel: a share of the largest moment too).
            let rel = match format {
                OptimState::F32 => 1e-6,
                _ => unit_roundoff(Precision::Bf16) * (1.0 + 1.0 / 64.0),
            };
            let tol = Tol {
                rel,
                of_max: 1e-7,
                abs: 0.0,
            };
            check(&format!("{what} m"), &s.get(m), &want_m, tol);
            check(&format!("{what} v"), &s.get(v), &want_v, tol);
            let (m1, v1) = (s.get_bytes(m), s.get_bytes(v));
            let size = if format == OptimState::F32 { 4 } else { 2 };
            for &e in &gaps {
                let b = e * size..(e + 1) * size;
                assert_eq!(m1[b.clone()], m_bytes[b.clone()], "{what}: m of a gap");
                assert_eq!(v1[b.clone()], v_bytes[b], "{what}: v of a gap");
            }
        }
        OptimState::Int8 => {
            let (mc, vc) = (s.get_bytes(m), s.get_bytes(v));
            let (ms, vs) = (s.get(m_scale.unwrap()), s.get(v_scale.unwrap()));
            // Each block's scale is its largest |value|.
            let (mut want_ms, mut want_vs) = (vec![0.0; n_blocks], vec![0.0f64; n_blocks]);
            for (r, first) in &blocks {
                for (k, e) in local(r).enumerate() {
                    let b = first + k / QBLOCK - BLOCK_BASE;
                    want_ms[b] = f64::max(want_ms[b], want_m[e].abs());
                    want_vs[b] = want_vs[b].max(want_v[e]);
                }
            }
            check(
                &format!("{what} m absmax"),
                &ms,
                &want_ms,
                Tol::rel(1e-6, 0.0),
            );
            check(
                &format!("{what} v absmax"),
                &vs,
                &want_vs,
                Tol::rel(1e-6, 0.0),
            );
            // Decoded codes: the nearest of 8 levels per octave (within 2^(1/16) − 1), or 0 /
            // the smallest level below the code's range.
            let level = 2f64.powf(1.0 / 16.0) - 1.0 + 1e-4;
            let (mut got_m, mut got_v) = (vec![0.0f32; len], vec![0.0f32; len]);
            let (mut tm, mut tv) = (want_m.clone(), want_v.clone());
            for (r, first) in &blocks {
                for (k, e) in local(r).enumerate() {
                    let b = first + k / QBLOCK - BLOCK_BASE;
                    got_m[e] = decode_m(mc[e] as i8, ms[b]) as f32;
                    got_v[e] = decode_v(vc[e], vs[b]) as f32;
                    // Outside the code's range: within the smallest level of the block.
                    let (sm, sv) = (
                        ms[b] as f64 * 2f64.powf(-126.0 / 8.0),
                        vs[b] as f64 * 2f64.powf(-254.0 / 8.0),
                    );
                    if tm[e].abs() < sm {
                        tm[e] = got_m[e] as f64;
                        assert!(
                            got_m[e].abs() as f64 <= sm * 1.0001,
                            "{what}: m below range"
                        );
                    }
                    if tv[e] < sv {
                        tv[e] = got_v[e] as f64;
                        assert!(got_v[e] as f64 <= sv * 1.0001, "{what}: v below range");
                    }
                }
            }
            for &e in &gaps {
                (got_m[e], got_v[e]) = (tm[e] as f32, tv[e] as f32);
                assert_eq!(mc[e], m_bytes[e], "{what}: m code of a gap");
                assert_eq!(vc[e], v_bytes[e], "{what}: v code of a gap");
            }
            check(&format!("{what} m"), &got_m, &tm, Tol::rel(level, 0.0));
            check(&format!("{what} v"), &got_v, &tv, Tol::rel(level, 0.0));
        }
    }
}

/// 8-bit `AdamW` of a tensor-parallel part (columns 0..1000 of a [2, 5000] tensor: its
/// elements in the whole tensor's blocks 0 and 2 of 5, none in 1, 3 or 4) beside a tensor
/// held whole: `AdamWBlockMax` gives each block's maxima of |m| and v after the step over
/// the rank's elements (0 where it has none); `AdamW` at scales agreed with other ranks
/// (those maxima or more) updates the parameters as the reference, encodes the moments at
/// the agreed scales and keeps those for every block of the range.
pub fn adamw_int8_part(be: &dyn Backend, p: Precision) {
    let mut rig = Rig::new(p);
    let kept = 0..1000;
    let whole = TensorPart {
        whole: vec![2, 5000],
        dim: 1,
        ranges: vec![kept],
    };
    let t0 = rig.param(2000); // the part
    let t1 = rig.param(50); // a tensor held whole
    let len = rig.space().len();
    let n_blocks = 6; // the part's tensor's 5 blocks, then the whole tensor's
    let m = rig.buf("m.q", DType::I8, len);
    let v = rig.buf("v.q", DType::U8, len);
    let (m_scale, v_scale) = (rig.f32("m.absmax", n_blocks), rig.f32("v.absmax", n_blocks));
    let state = OptimBufs {
        format: OptimState::Int8,
        m,
        v,
        m_scale: Some(m_scale),
        v_scale: Some(v_scale),
        base: PARAM_BASE,
        block_base: BLOCK_BASE,
    };
    let tensors = vec![
        ParamSlice {
            range: t0.clone(),
            decay: true,
            state_block: BLOCK_BASE,
            part: Some((whole.clone(), 0)),
        },
        ParamSlice {
            range: t1.clone(),
            decay: false,
            state_block: BLOCK_BASE + 5,
            part: None,
        },
    ];
    // Each element (index into the rig's space) with its block (index into the scales):
    // the part's row r column c is the whole tensor's element 5000 r + c.
    let elems: Vec<(usize, usize)> = (local(&t0).enumerate())
        .map(|(k, e)| (e, ((k / 1000) * 5000 + k % 1000) / QBLOCK))
        .chain(local(&t1).map(|e| (e, 5)))
        .collect();
    let decays = |e: usize| local(&t0).contains(&e);
    let out = BlockScales {
        buf: rig.f32("adamw.scales", 2 * n_blocks),
        blocks: BLOCK_BASE..BLOCK_BASE + n_blocks,
    };
    let max = rig.op(
        Op::AdamWBlockMax {
            tensors: tensors.clone(),
            state,
            out: out.clone(),
        },
        Bind::Both,
    );
    let update = rig.op(
        Op::AdamW {
            tensors,
            state,
            scales: Some(out.clone()),
        },
        Bind::Both,
    );
    let mut s = rig.start(be);
    let mut rng = Rng::new(23);
    let p0 = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let g = s.fill(s.grads(), &mut rng, -1.0, 1.0);
    let mc: Vec<i8> = (0..len)
        .map(|_| (rng.below(255) as i32 - 127) as i8)
        .collect();
    let vc: Vec<u8> = (0..len).map(|_| 200 + rng.below(56) as u8).collect();
    let ms = s.fill(m_scale, &mut rng, 0.05, 0.1);
    let vs = s.fill(v_scale, &mut rng, 0.005, 0.01);
    s.put_bytes(m, &mc.iter().map(|&c| c as u8).collect::<Vec<_>>());
    s.put_bytes(v, &vc);
    let step = StepCtx {
        update: Some(STEP),
        ..ctx()
    };
    s.fill(out.buf, &mut rng, 5.0, 6.0); // overwritten whole
    s.run(max, &step);
    let (mut want_p, mut want_m, mut want_v) = (wide(&p0), vec![0.0; len], vec![0.0; len]);
    let (mut want_ms, mut want_vs) = (vec![0.0f64; n_blocks], vec![0.0f64; n_blocks]);
    for &(e, b) in &elems {
        let (m0, v0) = (decode_m(mc[e], ms[b]), decode_v(vc[e], vs[b]));
        (want_p[e], want_m[e], want_v[e]) = adamw_ref(p0[e] as f64, g[e] as f64, m0, v0, decays(e));
        want_ms[b] = want_ms[b].max(want_m[e].abs());
        want_vs[b] = want_vs[b].max(want_v[e]);
    }
    let got = s.get(out.buf);
    let what = "adamw_block_max of a tensor-parallel part";
    check(
        &format!("{what}: m"),
        &got[..n_blocks],
        &want_ms,
        Tol::rel(1e-6, 0.0),
    );
    check(
        &format!("{what}: v"),
        &got[n_blocks..],
        &want_vs,
        Tol::rel(1e-6, 0.0),
    );
    for b in [1, 3, 4] {
        assert_eq!(
            (got[b], got[n_blocks + b]),
            (0.0, 0.0),
            "{what}: block {b} has none"
        );
    }
    same(
        &format!("{what}: params (read only)"),
        &s.get(s.params()),
        &p0,
    );
    // Other ranks' maxima: some larger, and the blocks this rank holds none of.
    let agreed: Vec<f32> = (0..2 * n_blocks)
        .map(|k| match (k % n_blocks, got[k]) {
            (_, 0.0) => 0.01 + rng.f32(0.0, 0.05),
            (b, x) if b % 2 == 0 => x * 1.5,
            (_, x) => x,
        })
        .collect();
    s.put(out.buf, &agreed);
    s.run(update, &step);
    let what = "adamw of a tensor-parallel part at agreed scales";
    check(
        &format!("{what}: params"),
        &s.get(s.params()),
        &want_p,
        Tol::rel(1e-6, 1e-7),
    );
    same(
        &format!("{what}: m scales"),
        &s.get(m_scale),
        &agreed[..n_blocks],
    );
    same(
        &format!("{what}: v scales"),
        &s.get(v_scale),
        &agreed[n_blocks..],
    );
    let (mc, vc) = (s.get_bytes(m), s.get_bytes(v));
    let level = 2f64.powf(1.0 / 16.0) - 1.0 + 1e-4;
    let (mut got_m, mut got_v) = (vec![0.0f32; len], vec![0.0f32; len]);
    let (mut tm, mut tv) = (want_m.clone(), want_v.clone());
    for &(e, b) in &elems {
        let (sm, sv) = (agreed[b] as f64, agreed[n_blocks + b] as f64);
        got_m[e] = decode_m(mc[e] as i8, sm as f32) as f32;
        got_v[e] = decode_v(vc[e], sv as f32) as f32;
        // Below the codes' range of the agreed scale: within its smallest level.
        if tm[e].abs() < sm * 2f64.powf(-126.0 / 8.0) {
            tm[e] = got_m[e] as f64;
        }
        if tv[e] < sv * 2f64.powf(-254.0 / 8.0) {
            tv[e] = got_v[e] as f64;
        }
    }
    check(&format!("{what}: m"), &got_m, &tm, Tol::rel(level, 0.0));
    check(&format!("{what}: v"), &got_v, &tv, Tol::rel(level, 0.0));
}

/// Transfers between the compute tier and the tier beneath it (the CPU's disk, a GPU's
/// pinned RAM): a buffer written beneath, then read back into another, each awaited; a
/// write-back queued after the op that fills its copy carries what that op wrote; a read
/// queued after a write of the same bytes, with no wait between, sees them. The CPU's disk
/// tier also reports its transfers (a GPU's copies are not timed yet).
pub fn transfers(be: &dyn Backend) {
    const ELEMS: usize = 3000; // not a multiple of the I/O alignment
    let mut rig = Rig::new(Precision::F32);
    let h1 = rig.io_buf("host.a", DType::F32, ELEMS, false); // [ELEMS]
    let d = rig.io_buf("beneath", DType::F32, ELEMS, true); // [ELEMS], beneath
    let h2 = rig.io_buf("host.b", DType::F32, ELEMS, false); // [ELEMS]
    let out = rig.op(Op::Transfer { from: h1, to: d }, Bind::None);
    let out_done = rig.op(Op::AwaitTransfers { bufs: vec![h1] }, Bind::None);
    let back = rig.op(Op::Transfer { from: d, to: h2 }, Bind::None);
    let back_done = rig.op(Op::AwaitTransfers { bufs: vec![h2] }, Bind::None);
    let zero = rig.op(Op::Zero { buf: h1 }, Bind::None);
    let both_done = rig.op(Op::AwaitTransfers { bufs: vec![h1, h2] }, Bind::None);
    let mut s = rig.start(be);
    let mut rng = Rng::new(30);
    let x = s.fill(h1, &mut rng, -1.0, 1.0);
    s.fill(d, &mut rng, -1.0, 1.0);
    let h2_0 = s.fill(h2, &mut rng, -1.0, 1.0);
    s.run(out, &ctx());
    s.run(out_done, &ctx());
    same("transfer beneath", &s.get(d), &x);
    same("transfer beneath: the other buffer", &s.get(h2), &h2_0);
    s.run(back, &ctx());
    s.run(back_done, &ctx());
    same("transfer from beneath", &s.get(h2), &x);
    let mut spans = Vec::with_capacity(4);
    let lost = s.dev.take_io_spans(&mut spans);
    if be.tiers().get(1) == Some(&memwall::ir::Tier::Nvme) {
        let seen: Vec<_> = spans.iter().map(|t| (t.buf, t.read)).collect();
        assert_eq!(
            (seen, lost),
            (vec![(h1, false), (h2, true)], 0),
            "transfers: the device's record of them"
        );
        assert!(
            spans
                .iter()
                .all(|t| t.bytes >= (ELEMS * 4) as u64 && t.end >= t.start)
        );
    }
    // Zeroed by an op, written beneath and read back with no wait between: zeros.
    s.fill(h2, &mut rng, -1.0, 1.0);
    for i in [zero, out, back, both_done] {
        s.run(i, &ctx());
    }
    same(
        "write-back after an op, read back unawaited",
        &s.get(h2),
        &vec![0.0; ELEMS],
    );
    same("write-back after an op", &s.get(d), &vec![0.0; ELEMS]);
}

/// Ranks of the collective checks, and their buffer's length.
const RANKS: usize = 3;
const LEN: usize = 10;
/// Scratch elements: fewer than a chunk, so messages go in pieces.
const SCRATCH: usize = 2;

/// An uneven cut of [`LEN`] elements among [`RANKS`]: chunks of 5, 4 and 1.
fn cut() -> Cut {
    let sh = Sharding {
        ranks: RANKS,
        rank: 0,
        zero: Zero(1),
    };
    let cut = sh.at_edges(LEN, &[2, 5, 7, 9, 10]);
    let lens: Vec<usize> = (0..RANKS).map(|r| cut.shard(r).len()).collect();
    assert_eq!(lens, [5, 4, 1], "the checks' cut");
    cut
}

/// One plan per rank from `declare(rig, rank)`, started on `be`.
fn ranks<X>(
    be: &dyn Backend,
    p: Precision,
    declare: impl Fn(&mut Rig, usize) -> X,
) -> Vec<(Started, X)> {
    Local::group(RANKS)
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let mut rig = Rig::new(p);
            rig.among(RANKS, r, cut());
            let x = declare(&mut rig, r);
            (rig.start_among(be, Arc::new(comm)), x)
        })
        .collect()
}

/// Runs op 0 of every rank's plan at once, each rank on a thread of its own: the device
/// starts the collective, and its `AwaitCollective` (naming the collective's buffer) waits
/// for it; the checks then read the buffer without any other wait.
fn run_collective<X: Sync>(ranks: &[(Started, X)]) {
    std::thread::scope(|scope| {
        for (s, _) in ranks {
            scope.spawn(move || {
                let e = &s.plan.schedule.ops[0];
                let buf = e.op.collective_buf().expect("op 0 is a collective");
                let wait = OpEntry {
                    name: format!("{}.await", e.name),
                    op: Op::AwaitCollective { bufs: vec![buf] },
                    ..e.clone()
                };
                s.dev
                    .run(e, &ctx())
                    .and_then(|_| s.dev.run(&wait, &ctx()))
                    .unwrap_or_else(|err| panic!("{}: {err:#}", e.name))
            });
        }
    });
}

/// Sums over 3 ranks: in f32 two roundings; in bf16/f16 each hop rounds its partial sum
/// (at most about the largest result) and the result is rounded once.
fn summed(p: Precision) -> Tol {
    match p {
        Precision::F32 => Tol::rel(1e-6, 1e-7),
        _ => Tol {
            rel: unit_roundoff(p) * (1.0 + 1.0 / 64.0),
            of_max: unit_roundoff(p),
            abs: 0.0,
        },
    }
}

/// The sum over the ranks, and the maximum (8-bit block scales; exact in any order).
pub fn all_reduce(be: &dyn Backend, p: Precision) {
    for reduce in [Reduce::Sum, Reduce::Max] {
        let mut ranks = ranks(be, p, |rig, _| {
            let buf = rig.act("buf", LEN); // [LEN], cut among the ranks
            let scratch = rig.act("scratch", SCRATCH); // [SCRATCH]
            rig.op(
                Op::AllReduce {
                    axis: memwall::ir::Axis::Data,
                    buf,
                    scratch,
                    cut: memwall::ir::CutOf::Group(0),
                    elems: None,
                    reduce,
                },
                Bind::None,
            );
            buf
        });
        let mut rng = Rng::new(40);
        let (mut sum, mut max) = (vec![0.0f64; LEN], vec![f64::MIN; LEN]);
        for (s, buf) in &mut ranks {
            let x = s.fill(*buf, &mut rng, -1.0, 1.0);
            sum.iter_mut().zip(&x).for_each(|(w, &v)| *w += v as f64);
            max.iter_mut()
                .zip(&x)
                .for_each(|(w, &v)| *w = w.max(v as f64));
        }
        run_collective(&ranks);
        for (r, (s, buf)) in ranks.iter().enumerate() {
            let what = format!("all_reduce ({reduce:?}) on rank {r}");
            match reduce {
                Reduce::Sum => check(&what, &s.get(*buf), &sum, summed(p)),
                Reduce::Max => {
                    let max: Vec<f32> = max.iter().map(|&x| x as f32).collect();
                    same(&what, &s.get(*buf), &max);
                }
            }
        }
    }
}

pub fn reduce_scatter(be: &dyn Backend, p: Precision) {
    // Into the shard, adding to it, or onto a residual (sequence parallelism's stream).
    for (accumulate, with_residual) in [(false, false), (true, false), (false, true)] {
        let cut = cut();
        let mut ranks = ranks(be, p, |rig, r| {
            let buf = rig.act("buf", LEN); // [LEN], consumed
            let shard = rig.act("shard", cut.shard(r).len()); // [the rank's chunk]
            let scratch = rig.act("scratch", SCRATCH); // [SCRATCH]
            let residual = with_residual.then(|| rig.act("residual", cut.shard(r).len())); // [chunk]
            let op = Op::ReduceScatter {
                axis: memwall::ir::Axis::Data,
                buf,
                shard,
                scratch,
                accumulate,
                cut: memwall::ir::CutOf::Group(0),
                residual,
            };
            rig.op(op, Bind::None);
            (buf, shard, residual)
        });
        let mut rng = Rng::new(41);
        let mut sum = [0.0f64; LEN];
        let mut added = Vec::new();
        for (s, (buf, shard, residual)) in &mut ranks {
            let x = s.fill(*buf, &mut rng, -1.0, 1.0);
            sum.iter_mut().zip(&x).for_each(|(w, &v)| *w += v as f64);
            let before = s.fill(*shard, &mut rng, -1.0, 1.0);
            added.push(match residual {
                Some(res) => s.fill(*res, &mut rng, -1.0, 1.0),
                None if accumulate => before,
                None => vec![0.0; before.len()],
            });
        }
        run_collective(&ranks);
        for (r, (s, (_, shard, _))) in ranks.iter().enumerate() {
            let want: Vec<f64> = cut
                .shard(r)
                .enumerate()
                .map(|(k, e)| sum[e] + added[r][k] as f64)
                .collect();
            let what = format!(
                "reduce_scatter (accumulate {accumulate}, residual {with_residual}) on rank {r}"
            );
            check(&what, &s.get(*shard), &want, summed(p));
        }
    }
}

pub fn all_gather(be: &dyn Backend, p: Precision) {
    for from_shard in [true, false] {
        let cut = cut();
        let mut ranks = ranks(be, p, |rig, r| {
            let buf = rig.act("buf", LEN); // [LEN]
            let shard = from_shard.then(|| rig.act("shard", cut.shard(r).len())); // [chunk]
            rig.op(
                Op::AllGather {
                    axis: memwall::ir::Axis::Data,
                    buf,
                    shard,
                    cut: memwall::ir::CutOf::Group(0),
                },
                Bind::None,
            );
            (buf, shard)
        });
        let mut rng = Rng::new(42);
        let mut want = vec![0.0f32; LEN];
        for (r, (s, (buf, shard))) in ranks.iter_mut().enumerate() {
            let x = s.fill(*buf, &mut rng, -1.0, 1.0);
            let mine = match shard {
                Some(id) => s.fill(*id, &mut rng, -1.0, 1.0),
                None => x[cut.shard(r)].to_vec(),
            };
            want[cut.shard(r)].copy_from_slice(&mine);
        }
        run_collective(&ranks);
        for (r, (s, (buf, _))) in ranks.iter().enumerate() {
            let what = format!("all_gather (from a shard: {from_shard}) on rank {r}");
            same(&what, &s.get(*buf), &want);
        }
    }
}

/// Pipeline stages in a row: each receives `buf` from the stage before (the first fills
/// its own) and sends it on to the next: every stage ends with the first's values, bitwise
/// (the bytes move, whatever the element type).
pub fn stage_send_recv(be: &dyn Backend, p: Precision) {
    use memwall::ir::Peer;
    let mut ranks: Vec<(Started, memwall::ir::BufId)> = Local::group(RANKS)
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let mut rig = Rig::new(p);
            rig.among_stages(RANKS, r, cut());
            let buf = rig.act("buf", LEN); // [LEN]
            if r > 0 {
                rig.op(
                    Op::StageRecv {
                        buf,
                        from: Peer::Prev,
                    },
                    Bind::None,
                );
            }
            if r + 1 < RANKS {
                rig.op(
                    Op::StageSend {
                        buf,
                        to: Peer::Next,
                    },
                    Bind::None,
                );
            }
            (rig.start_among(be, Arc::new(comm)), buf)
        })
        .collect();
    let mut rng = Rng::new(7);
    let first = ranks[0].1;
    let want = ranks[0].0.fill(first, &mut rng, -1.0, 1.0);
    std::thread::scope(|scope| {
        for (s, buf) in &ranks {
            scope.spawn(move || {
                for e in &s.plan.schedule.ops {
                    let wait = OpEntry {
                        name: format!("{}.await", e.name),
                        op: Op::AwaitCollective { bufs: vec![*buf] },
                        ..e.clone()
                    };
                    s.dev
                        .run(e, &ctx())
                        .and_then(|_| s.dev.run(&wait, &ctx()))
                        .unwrap_or_else(|err| panic!("{}: {err:#}", e.name));
                }
            });
        }
    });
    for (r, (s, buf)) in ranks.iter().enumerate() {
        same(&format!("stage {r} of {RANKS}"), &s.get(*buf), &want);
    }
}
