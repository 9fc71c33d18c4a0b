//! Checks of a LoRA plan's ops (`plan::lora`): an adapter's forward and backward against
//! f64 references of their documented formulas, an adapter writing the middle columns of a
//! wider output (as Llama's q, k and v share one); the frozen layers' backward (an op entry
//! marked `frozen`): the input gradient exactly as the trained op computes it, the gradients
//! untouched; and a frozen layer's bias added on its own (stored apart from its weight).

use super::rig::*;
use memwall::backend::Backend;
use memwall::backend::StepCtx;
use memwall::dtype::DType;
use memwall::ir::schedule::WeightLayout;
use memwall::ir::{LoraDropout, Op, Precision, Rows};
use std::ops::Range;

const ROWS: Rows = Rows { b: B, t: T };
const N: usize = B * T;
const IC: usize = 7;
const OC: usize = 5;
const R: usize = 3;
/// The adapter's columns of an output 9 wide.
const COL: usize = 2;
const LDO: usize = 9;
const SCALE: f32 = 1.5;

fn local(r: &Range<usize>) -> Range<usize> {
    r.start - PARAM_BASE..r.end - PARAM_BASE
}

/// `h[N, r] = scale · x Aᵀ` in f64 from the stored values.
fn h_ref(x: &[f32], a: &[f32]) -> Vec<f64> {
    (0..N * R)
        .map(|e| {
            let (i, k) = (e / R, e % R);
            SCALE as f64
                * (0..IC)
                    .map(|j| x[i * IC + j] as f64 * a[k * IC + j] as f64)
                    .sum::<f64>()
        })
        .collect()
}

/// The forward, and the forward of an adapter with dropout evaluating (no mask is drawn
/// outside training: the same result).
pub fn lora_forward(be: &dyn Backend, p: Precision) {
    lora_forward_case(be, p, false);
    lora_forward_case(be, p, true);
}

fn lora_forward_case(be: &dyn Backend, p: Precision, evaluating_with_dropout: bool) {
    let mut rig = Rig::new(p);
    let a = rig.param(R * IC); // [r, IC]
    let b = rig.param(OC * R); // [OC, r]
    let inp = rig.act("inp", N * IC); // [N, IC]
    let out = rig.act("out", N * LDO); // [N, LDO] +=, columns COL..COL + OC
    let h = rig.act("h", N * R); // [N, r] overwritten
    let dropout = evaluating_with_dropout.then(|| LoraDropout {
        p: 0.5,
        adapter: 0,
        micro: 0,
        ws: rig.f32("xd", N * IC), // [N, IC]
        cols: (IC, 0),
    });
    let op = Op::LoraForward {
        inp,
        out,
        h,
        a: a.clone(),
        b: b.clone(),
        rows: ROWS,
        ic: IC,
        oc: OC,
        r: R,
        col: COL,
        ldo: LDO,
        scale: SCALE,
        dropout,
    };
    let op = rig.op(op, Bind::Params);
    let mut s = rig.start(be);
    let mut rng = Rng::new(12);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let x = s.fill(inp, &mut rng, -1.0, 1.0);
    let y0 = s.fill(out, &mut rng, -1.0, 1.0);
    s.fill(h, &mut rng, -1.0, 1.0);
    let ctx = StepCtx {
        training: !evaluating_with_dropout,
        ..ctx()
    };
    s.run(op, &ctx);
    let (av, bv) = (&pw[local(&a)], &pw[local(&b)]);
    let hw = h_ref(&x, av);
    let mut y = wide(&y0);
    for i in 0..N {
        for o in 0..OC {
            y[i * LDO + COL + o] += (0..R)
                .map(|k| hw[i * R + k] * bv[o * R + k] as f64)
                .sum::<f64>();
        }
    }
    check("lora_forward h", &s.get(h), &hw, reduced(p));
    // h is rounded to the storage type before its product with B: one more rounding.
    check("lora_forward out", &s.get(out), &y, reduced(p).twice());
}

pub fn lora_backward(be: &dyn Backend, p: Precision) {
    let mut rig = Rig::new(p);
    let a = rig.param(R * IC); // [r, IC]
    let b = rig.param(OC * R); // [OC, r]
    let dinp = rig.act("dinp", N * IC); // [N, IC] +=
    let dout = rig.act("dout", N * LDO); // [N, LDO], columns COL..COL + OC read
    let inp = rig.act("inp", N * IC); // [N, IC]
    let h = rig.act("h", N * R); // [N, r]
    let dh = rig.f32("dh", N * R); // [N, r] scratch
    let op = Op::LoraBackward {
        dinp,
        dout,
        inp,
        h,
        dh,
        a: a.clone(),
        b: b.clone(),
        rows: ROWS,
        ic: IC,
        oc: OC,
        r: R,
        col: COL,
        ldo: LDO,
        scale: SCALE,
        dropout: None,
    };
    let op = rig.op(op, Bind::Both);
    let mut s = rig.start(be);
    let mut rng = Rng::new(13);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let g0 = s.fill(s.grads(), &mut rng, -1.0, 1.0);
    let x = s.fill(inp, &mut rng, -1.0, 1.0);
    let hv = s.fill(h, &mut rng, -1.0, 1.0);
    let dy = s.fill(dout, &mut rng, -1.0, 1.0);
    let dx0 = s.fill(dinp, &mut rng, -1.0, 1.0);
    s.run(op, &ctx());
    let (av, bv) = (&pw[local(&a)], &pw[local(&b)]);
    let dyv = |i: usize, o: usize| dy[i * LDO + COL + o] as f64;
    let dhv: Vec<f64> = (0..N * R)
        .map(|e| {
            let (i, k) = (e / R, e % R);
            SCALE as f64
                * (0..OC)
                    .map(|o| dyv(i, o) * bv[o * R + k] as f64)
                    .sum::<f64>()
        })
        .collect();
    let mut g = wide(&g0);
    let (ar, br) = (local(&a), local(&b));
    for o in 0..OC {
        for k in 0..R {
            g[br.start + o * R + k] += (0..N)
                .map(|i| dyv(i, o) * hv[i * R + k] as f64)
                .sum::<f64>();
        }
    }
    for k in 0..R {
        for j in 0..IC {
            g[ar.start + k * IC + j] += (0..N)
                .map(|i| dhv[i * R + k] * x[i * IC + j] as f64)
                .sum::<f64>();
        }
    }
    let mut dx = wide(&dx0);
    for i in 0..N {
        for j in 0..IC {
            dx[i * IC + j] += (0..R)
                .map(|k| dhv[i * R + k] * av[k * IC + j] as f64)
                .sum::<f64>();
        }
    }
    check("lora_backward dinp", &s.get(dinp), &dx, reduced(p));
    check("lora_backward grads", &s.get(s.grads()), &g, reduced(p));
}

/// A frozen layer's backward (matmul, RMSNorm, layer norm): the input gradient bitwise that
/// of the same op trained, on the same inputs; the gradient buffer bitwise untouched.
pub fn frozen_backward(be: &dyn Backend, p: Precision) {
    const C: usize = 12;
    type Declare = fn(&mut Rig) -> (Op, memwall::ir::BufId);
    let cases: [(&str, Declare); 4] = [
        ("matmul_backward", |rig| {
            let w = rig.param(IC * OC);
            let bias = rig.param(OC);
            let dinp = rig.act("dinp", N * IC);
            let op = Op::MatmulBackward {
                dinp,
                dout: rig.act("dout", N * OC),
                inp: rig.act("inp", N * IC),
                w,
                b: Some(bias),
                layout: WeightLayout::OutIn,
                rows: ROWS,
                ic: IC,
                oc: OC,
            };
            (op, dinp)
        }),
        ("rmsnorm_backward", |rig| {
            let w = rig.param(C);
            let dinp = rig.act("dinp", N * C);
            let op = Op::RmsNormBackward {
                dinp,
                dout: rig.act("dout", N * C),
                inp: rig.act("inp", N * C),
                rstd: rig.f32("rstd", N),
                w,
                offset: 0.0,
                rows: ROWS,
                c: C,
            };
            (op, dinp)
        }),
        ("qk_norm_backward", |rig| {
            // 2 query heads, 1 key/value head of 4 channels: QKV = 16.
            let w = rig.param(8);
            let d = rig.act("d", N * 16);
            let op = Op::QkNormBackward {
                d,
                inp: rig.act("inp", N * 16),
                rstd: rig.f32("rstd", N * 3),
                w,
                offset: 0.0,
                rows: ROWS,
                nh: 2,
                nkv: 1,
                hd: 4,
            };
            (op, d)
        }),
        ("layernorm_backward", |rig| {
            let (w, b) = (rig.param(C), rig.param(C));
            let dinp = rig.act("dinp", N * C);
            let op = Op::LayerNormBackward {
                dinp,
                dout: rig.act("dout", N * C),
                inp: rig.act("inp", N * C),
                mean: rig.f32("mean", N),
                rstd: rig.f32("rstd", N),
                w,
                b,
                rows: ROWS,
                c: C,
            };
            (op, dinp)
        }),
    ];
    for (name, declare) in cases {
        let run = |bind: Bind| {
            let mut rig = Rig::new(p);
            let (op, dinp) = declare(&mut rig);
            let i = rig.op(op, bind);
            let mut s = rig.start(be);
            let mut rng = Rng::new(14);
            // Every value buffer random (the statistics positive, as a norm's are); the
            // backend's own scratch (bytes: the GPU's GEMM workspace) is its own.
            let ids: Vec<_> = (0..s.plan.buffers.len()).map(memwall::ir::BufId).collect();
            for id in ids {
                let b = s.plan.buffer(id);
                let values = matches!(b.dtype, DType::F32 | DType::Bf16 | DType::F16);
                if values && b.elems > 0 {
                    s.fill(id, &mut rng, 0.5, 1.5);
                }
            }
            let g0 = s.get_bytes(s.grads());
            s.run(i, &ctx());
            (s.get_bytes(dinp), g0, s.get_bytes(s.grads()))
        };
        let (trained, _, _) = run(Bind::Both);
        let (frozen, g0, g1) = run(Bind::Frozen);
        assert!(
            frozen == trained,
            "{name} ({p}): a frozen op's dinp differs"
        );
        assert!(g1 == g0, "{name} ({p}): a frozen op changed the gradients");
    }
}

/// `out[n, :] += b` for every row: a bias stored apart from its (quantized) weight, added
/// after the product, one rounding per element.
pub fn add_bias(be: &dyn Backend, p: Precision) {
    let mut rig = Rig::new(p);
    let b = rig.param(OC); // [OC]
    let out = rig.act("out", N * OC); // [N, OC] +=
    let op = rig.op(
        Op::AddBias {
            out,
            b: b.clone(),
            rows: ROWS,
            oc: OC,
        },
        Bind::Frozen,
    );
    let mut s = rig.start(be);
    let mut rng = Rng::new(15);
    let pw = s.fill(s.params(), &mut rng, -1.0, 1.0);
    let y0 = s.fill(out, &mut rng, -1.0, 1.0);
    s.run(op, &ctx());
    let bv = &pw[local(&b)];
    let want: Vec<f64> = (0..N * OC)
        .map(|e| y0[e] as f64 + bv[e % OC] as f64)
        .collect();
    check("add_bias out", &s.get(out), &want, reduced(p));
}
