//! Reference outputs for the xent / optimizer / lora / dequant kernel tests (k2_check.cpp):
//! the CPU backend's arithmetic, copied verbatim from src/backend/cpu/{reduce,xent,adamw,
//! quant,lora}.rs and src/dtype/dequant.rs (minus rayon, multiversion and asserts), run on
//! deterministic inputs. Writes every input and expected output as raw little-endian arrays
//! `NAME.bin` into the directory given as the first argument.
//!
//! Built standalone by run-k2.sh (rustc with the `half` crate's rlib; no cargo).

use half::{bf16, f16};
use std::io::Write;

// ---------------------------------------------------------------- output

struct Out(String);
impl Out {
    fn bytes(&self, name: &str, b: &[u8]) {
        let mut f = std::fs::File::create(format!("{}/{name}.bin", self.0)).unwrap();
        f.write_all(b).unwrap();
    }
    fn f32s(&self, name: &str, x: &[f32]) {
        let b: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.bytes(name, &b);
    }
    fn u32s(&self, name: &str, x: &[u32]) {
        let b: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.bytes(name, &b);
    }
    fn u64s(&self, name: &str, x: &[u64]) {
        let b: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.bytes(name, &b);
    }
    fn u16s(&self, name: &str, x: &[u16]) {
        let b: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.bytes(name, &b);
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn normal(&mut self) -> f32 {
        let u1 = (self.uniform() as f64).max(1e-12);
        let u2 = self.uniform() as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ---------------------------------------------------------------- reduce.rs / xent.rs

pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to the nearest integer
    let underflow = x < -87.3;
    let x = if underflow { -87.3 } else { x };
    let x = if x > 88.0 { 88.0 } else { x };
    let t = x * LOG2E + MAGIC;
    let k = t - MAGIC; // round(x / ln 2)
    let ki = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = x - k * LN2_HI - k * LN2_LO; // |r| <= ~ln2/2
    let z = r * r;
    let p = (((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * z
        + r
        + 1.0;
    let scale = f32::from_bits((ki.wrapping_add(127) as u32) << 23); // 2^k, k in [-126, 127]
    let e = p * scale; // >= 2^-126 for x >= -87.3: normal
    if underflow { 0.0 } else { e }
}

pub fn sum_f32(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut it = x.chunks_exact(16);
    for ch in &mut it {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a += v;
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        *a += v;
    }
    combine16(acc)
}

pub fn max_f32(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut it = x.chunks_exact(16);
    for ch in &mut it {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a = a.max(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(it.remainder()) {
        *a = a.max(v);
    }
    acc.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

fn combine16(a: [f32; 16]) -> f32 {
    let mut h = [0.0f32; 8];
    for (i, v) in h.iter_mut().enumerate() {
        *v = a[i] + a[i + 8];
    }
    let q = [h[0] + h[4], h[1] + h[5], h[2] + h[6], h[3] + h[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

const SUM_BLOCK: usize = 1024;
const IGNORE_TARGET: u32 = u32::MAX;

fn exp_sum(x: &mut [f32], max: f32) -> f64 {
    let mut total = 0.0f64;
    for block in x.chunks_mut(SUM_BLOCK) {
        let mut acc = [0.0f32; 16];
        let mut it = block.chunks_exact_mut(16);
        for ch in &mut it {
            for (a, x) in acc.iter_mut().zip(ch) {
                let e = exp_f32(*x - max);
                *x = e;
                *a += e;
            }
        }
        for (a, x) in acc.iter_mut().zip(it.into_remainder()) {
            let e = exp_f32(*x - max);
            *x = e;
            *a += e;
        }
        total += sum_f32(&acc) as f64;
    }
    total
}

fn exp_sum_ro(x: &[f32], max: f32) -> f64 {
    let mut total = 0.0f64;
    for block in x.chunks(SUM_BLOCK) {
        let mut acc = [0.0f32; 16];
        let mut it = block.chunks_exact(16);
        for ch in &mut it {
            for (a, &x) in acc.iter_mut().zip(ch) {
                *a += exp_f32(x - max);
            }
        }
        for (a, &x) in acc.iter_mut().zip(it.remainder()) {
            *a += exp_f32(x - max);
        }
        total += sum_f32(&acc) as f64;
    }
    total
}

fn backward_rows(lg: &mut [f32], tg: &[u32], ls: &mut [f32], dloss_scale: f32, v: usize) {
    for ((row, &tgt), loss) in lg.chunks_exact_mut(v).zip(tg).zip(ls) {
        if tgt == IGNORE_TARGET {
            *loss = 0.0;
            row.fill(0.0);
            continue;
        }
        let tgt = tgt as usize;
        let max = max_f32(row);
        let x_t = row[tgt];
        let sum = exp_sum(row, max);
        *loss = (sum.ln() - (x_t - max) as f64) as f32;
        let s = (dloss_scale as f64 / sum) as f32;
        for x in row.iter_mut() {
            let g = *x * s;
            *x = if g < 1e-30 { 0.0 } else { g };
        }
        row[tgt] -= dloss_scale;
    }
}

fn forward_rows(lg: &[f32], tg: &[u32], ls: &mut [f32], v: usize) {
    for ((row, &tgt), loss) in lg.chunks_exact(v).zip(tg).zip(ls) {
        if tgt == IGNORE_TARGET {
            *loss = 0.0;
            continue;
        }
        let tgt = tgt as usize;
        let max = max_f32(row);
        let sum = exp_sum_ro(row, max);
        *loss = (sum.ln() - (row[tgt] - max) as f64) as f32;
    }
}

fn xent_cases(o: &Out) {
    let shapes: [(usize, usize); 10] = [
        (1, 1),
        (1, 2),
        (3, 7),
        (5, 17),
        (4, 100),
        (9, 1003),
        (2, 50257),
        (3, 2049),
        (2, 70000),
        (4, 4),
    ];
    let mut r = Rng(11);
    for (ci, &(n, v)) in shapes.iter().enumerate() {
        let mut logits: Vec<f32> = (0..n * v).map(|_| r.normal() * 4.0 + 100.0).collect();
        let mut tg: Vec<u32> = (0..n).map(|_| r.below(v as u64) as u32).collect();
        if n >= 3 {
            tg[1] = IGNORE_TARGET;
        }
        if ci == 9 {
            // Extremes: a huge gap (exp underflow to 0) and the denormal flush.
            logits[..4].copy_from_slice(&[-1e4, -1e4, -1e4, 1e4]);
            logits[4..8].copy_from_slice(&[0.0, -84.0, -86.0, -90.0]);
            logits[8..12].copy_from_slice(&[1e4, -1e4, -1e4, -1e4]);
            tg[0] = 0;
            tg[1] = 0;
            tg[2] = 0;
        }
        let scale = if ci == 9 { 1e-4 } else { 1.0 / (n as f32 * 3.0) };
        let mut g = logits.clone();
        let mut l = vec![0.0f32; n];
        backward_rows(&mut g, &tg, &mut l, scale, v);
        let mut lf = vec![0.0f32; n];
        forward_rows(&logits, &tg, &mut lf, v);
        let p = format!("xent{ci}");
        o.u32s(&format!("{p}_shape"), &[n as u32, v as u32]);
        o.f32s(&format!("{p}_scale"), &[scale]);
        o.f32s(&format!("{p}_logits"), &logits);
        o.u32s(&format!("{p}_targets"), &tg);
        o.f32s(&format!("{p}_grad"), &g);
        o.f32s(&format!("{p}_loss"), &l);
        o.f32s(&format!("{p}_loss_fwd"), &lf);
    }
    o.u32s("xent_cases", &[shapes.len() as u32]);
}

// ---------------------------------------------------------------- adamw.rs / quant.rs

pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub step: u64,
    pub grad_scale: f32,
}

pub struct Consts {
    b1: f32,
    b2: f32,
    c1: f32,
    c2: f32,
    eps: f32,
    gs: f32,
    step_size: f32,
    inv_sqrt_bc2: f32,
    decay: f32,
}

pub fn consts(hp: &AdamWStep) -> Consts {
    let t = hp.step as f64;
    let bc1 = 1.0 - (hp.beta1 as f64).powf(t);
    let bc2 = 1.0 - (hp.beta2 as f64).powf(t);
    Consts {
        b1: hp.beta1,
        b2: hp.beta2,
        c1: 1.0 - hp.beta1,
        c2: 1.0 - hp.beta2,
        eps: hp.eps,
        gs: hp.grad_scale,
        step_size: (hp.lr as f64 / bc1) as f32,
        inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
        decay: 1.0 - hp.lr * hp.weight_decay,
    }
}

impl Consts {
    fn list(&self) -> [f32; 9] {
        [
            self.b1,
            self.b2,
            self.c1,
            self.c2,
            self.eps,
            self.gs,
            self.step_size,
            self.inv_sqrt_bc2,
            self.decay,
        ]
    }
}

pub fn update_chunk(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &Consts) {
    let it = p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut());
    for (((p, &g), m), v) in it {
        let g = g * k.gs;
        let mi = k.b1 * *m + k.c1 * g;
        let vi = k.b2 * *v + k.c2 * g * g;
        *m = mi;
        *v = vi;
        *p = *p * k.decay - k.step_size * mi / (vi.sqrt() * k.inv_sqrt_bc2 + k.eps);
    }
}

const QBLOCK: usize = 2048;
const MAX_I8: i32 = 127;
const MAX_U8: i32 = 255;
const THRESH: [f32; 8] = [
    1.044_273_7,
    1.138_788_6,
    1.241_857_8,
    1.354_255_6,
    1.476_826_2,
    1.610_490_3,
    1.756_252_2,
    1.915_206_6,
];
const OCTAVE: [f32; 8] = [
    1.0,
    1.090_507_7,
    1.189_207_1,
    1.296_839_6,
    std::f32::consts::SQRT_2,
    1.542_210_8,
    1.681_792_9,
    1.834_008_1,
];

fn level_from_bits(k: i32, top: i32) -> f32 {
    let d = k - top;
    let (e, r) = (d >> 3, d & 7);
    let mut f = OCTAVE[0];
    for (j, &o) in OCTAVE.iter().enumerate().skip(1) {
        if r == j as i32 {
            f = o;
        }
    }
    f32::from_bits((f.to_bits() as i32 + (e << 23)) as u32)
}

fn log_code(y: f32) -> i32 {
    let b = y.to_bits();
    let e = ((b >> 23) & 0xff) as i32 - 127;
    let f = f32::from_bits((b & 0x007f_ffff) | 0x3f80_0000);
    let mut c = 8 * e;
    for t in THRESH {
        c += (f >= t) as i32;
    }
    c
}

fn absmax(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut nan = [false; 16];
    let mut it = x.chunks_exact(16);
    for ch in &mut it {
        for ((a, n), &v) in acc.iter_mut().zip(nan.iter_mut()).zip(ch) {
            *a = a.max(v.abs());
            *n |= v.is_nan();
        }
    }
    for ((a, n), &v) in acc.iter_mut().zip(nan.iter_mut()).zip(it.remainder()) {
        *a = a.max(v.abs());
        *n |= v.is_nan();
    }
    if nan.iter().any(|&n| n) {
        return f32::NAN;
    }
    acc.iter().fold(0.0f32, |m, &a| m.max(a))
}

pub fn quantize_signed(x: &[f32], q: &mut [i8]) -> f32 {
    let scale = absmax(x);
    if scale == 0.0 {
        q.fill(0);
        return 0.0;
    }
    for (q, &x) in q.iter_mut().zip(x) {
        let y = x.abs() / scale;
        let k = (MAX_I8 + log_code(y)).clamp(0, MAX_I8);
        *q = (if x < 0.0 { -k } else { k }) as i8;
    }
    scale
}

pub fn dequantize_signed(q: &[i8], scale: f32, out: &mut [f32]) {
    for (o, &q) in out.iter_mut().zip(q) {
        let k = (q as i32).abs().min(MAX_I8);
        let mag = if k == 0 { 0.0 } else { level_from_bits(k, MAX_I8) };
        *o = (if q < 0 { -mag } else { mag }) * scale;
    }
}

pub fn quantize_unsigned(x: &[f32], q: &mut [u8]) -> f32 {
    let scale = absmax(x);
    if scale == 0.0 {
        q.fill(0);
        return 0.0;
    }
    for (q, &x) in q.iter_mut().zip(x) {
        let y = x.abs() / scale;
        let k = (MAX_U8 + log_code(y)).clamp(1, MAX_U8);
        *q = if x == 0.0 { 0 } else { k as u8 };
    }
    scale
}

pub fn dequantize_unsigned(q: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &q) in out.iter_mut().zip(q) {
        let k = q as i32;
        let l = if k == 0 { 0.0 } else { level_from_bits(k, MAX_U8) };
        *o = l * scale;
    }
}

pub fn adamw_update_int8(
    params: &mut [f32],
    grads: &[f32],
    m_q: &mut [i8],
    m_scale: &mut [f32],
    v_q: &mut [u8],
    v_scale: &mut [f32],
    k: &Consts,
) {
    for (((((p, g), mq), ms), vq), vs) in params
        .chunks_mut(QBLOCK)
        .zip(grads.chunks(QBLOCK))
        .zip(m_q.chunks_mut(QBLOCK))
        .zip(m_scale.iter_mut())
        .zip(v_q.chunks_mut(QBLOCK))
        .zip(v_scale.iter_mut())
    {
        let n = p.len();
        let mut m = [0.0f32; QBLOCK];
        let mut v = [0.0f32; QBLOCK];
        let (m, v) = (&mut m[..n], &mut v[..n]);
        dequantize_signed(mq, *ms, m);
        dequantize_unsigned(vq, *vs, v);
        update_chunk(p, g, m, v, k);
        *ms = quantize_signed(m, mq);
        *vs = quantize_unsigned(v, vq);
    }
}

/// Gradients stored as type `t` (0 f32, 1 bf16, 2 f16): the stored bits and the widened values.
fn stored(t: u32, x: &[f32]) -> (Vec<u8>, Vec<f32>) {
    match t {
        0 => (x.iter().flat_map(|v| v.to_le_bytes()).collect(), x.to_vec()),
        1 => {
            let b: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            (
                b.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
                b.iter().map(|v| v.to_f32()).collect(),
            )
        }
        _ => {
            let b: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
            (
                b.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
                b.iter().map(|v| v.to_f32()).collect(),
            )
        }
    }
}

fn adamw_cases(o: &Out) {
    let mut r = Rng(21);
    let len = 2 * QBLOCK + 77;
    for t in 0..3u32 {
        let hp = |step: u64, wd: f32| AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: wd,
            step,
            grad_scale: 0.5,
        };
        // f32 and bf16 moments: one step from random state.
        let p0: Vec<f32> = (0..len).map(|_| r.normal()).collect();
        let mut gf: Vec<f32> = (0..len).map(|_| r.normal() * 0.1).collect();
        gf[5] = 0.0;
        let (gbits, gw) = stored(t, &gf);
        let m0: Vec<f32> = (0..len).map(|_| r.normal() * 0.01).collect();
        let v0: Vec<f32> = (0..len).map(|_| r.uniform() * 1e-3).collect();
        let k = consts(&hp(3, 0.1));
        let pre = format!("adam{t}");
        o.bytes(&format!("{pre}_g"), &gbits);
        o.f32s(&format!("{pre}_p0"), &p0);
        o.f32s(&format!("{pre}_m0"), &m0);
        o.f32s(&format!("{pre}_v0"), &v0);
        o.f32s(&format!("{pre}_k"), &k.list());
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        update_chunk(&mut p, &gw, &mut m, &mut v, &k);
        o.f32s(&format!("{pre}_p32"), &p);
        o.f32s(&format!("{pre}_m32"), &m);
        o.f32s(&format!("{pre}_v32"), &v);
        // bf16 moments: the stored bits of m0, v0 as bf16.
        let mb: Vec<bf16> = m0.iter().map(|&x| bf16::from_f32(x)).collect();
        let vb: Vec<bf16> = v0.iter().map(|&x| bf16::from_f32(x)).collect();
        o.u16s(&format!("{pre}_mb0"), &mb.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        o.u16s(&format!("{pre}_vb0"), &vb.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        let mut p = p0.clone();
        let mut mf: Vec<f32> = mb.iter().map(|x| x.to_f32()).collect();
        let mut vf: Vec<f32> = vb.iter().map(|x| x.to_f32()).collect();
        update_chunk(&mut p, &gw, &mut mf, &mut vf, &k);
        let mb1: Vec<u16> = mf.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        let vb1: Vec<u16> = vf.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
        o.f32s(&format!("{pre}_pb"), &p);
        o.u16s(&format!("{pre}_mb"), &mb1);
        o.u16s(&format!("{pre}_vb"), &vb1);
        // int8 moments: 4 steps from a fresh (zero) state, new gradients each step (step 3
        // without decay; in step 4, block 1 holds a NaN and block 2 an infinity).
        let mut p = p0.clone();
        let blocks = len.div_ceil(QBLOCK);
        let (mut mq, mut ms, mut vq, mut vs) =
            (vec![0i8; len], vec![0f32; blocks], vec![0u8; len], vec![0f32; blocks]);
        for step in 1..=4u64 {
            let mut gf: Vec<f32> = (0..len).map(|_| r.normal() * 0.1).collect();
            gf[7] = 0.0;
            if step == 2 {
                gf[QBLOCK + 3] = 1e-20; // tiny against its block: m code 0, v code 1
            }
            if step == 4 {
                gf[QBLOCK + 9] = f32::NAN;
                gf[2 * QBLOCK + 1] = f32::INFINITY;
            }
            let (gbits, gw) = stored(t, &gf);
            let k = consts(&hp(step, if step == 3 { 0.0 } else { 0.1 }));
            let sp = format!("{pre}_q{step}");
            o.bytes(&format!("{sp}_g"), &gbits);
            o.f32s(&format!("{sp}_k"), &k.list());
            adamw_update_int8(&mut p, &gw, &mut mq, &mut ms, &mut vq, &mut vs, &k);
            o.f32s(&format!("{sp}_p"), &p);
            o.bytes(&format!("{sp}_mq"), &mq.iter().map(|&x| x as u8).collect::<Vec<_>>());
            o.bytes(&format!("{sp}_vq"), &vq);
            o.f32s(&format!("{sp}_ms"), &ms);
            o.f32s(&format!("{sp}_vs"), &vs);
        }
    }
    o.u32s("adam_len", &[len as u32]);
}

// ---------------------------------------------------------------- lora.rs

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Dropout {
    key: u64,
    below: u64,
    scale: f32,
    first: u64,
}

impl Dropout {
    fn new(p: f32, seed: u64, salt: u64, first: u64) -> Dropout {
        Dropout {
            key: mix(seed ^ mix(salt.wrapping_add(GOLDEN))),
            below: (p as f64 * 4294967296.0) as u64,
            scale: 1.0 / (1.0 - p),
            first,
        }
    }
    fn keeps(&self, e: usize) -> bool {
        let z = self
            .key
            .wrapping_add((self.first + e as u64).wrapping_mul(GOLDEN));
        mix(z) >> 32 >= self.below
    }
}

fn lora_cases(o: &Out) {
    let mut r = Rng(31);
    let (n, ic) = (37usize, 24usize);
    let ne = n * ic;
    // The 4th micro-batch of a step with a huge seed: first + e wraps nothing, key does.
    let d = Dropout::new(0.3, 0xDEAD_BEEF_1234_5678, 2, 3 * (n * ic) as u64);
    o.u64s("lora_dparams", &[d.key, d.below, d.first]);
    o.f32s("lora_dscale", &[d.scale]);
    let mask: Vec<u32> = (0..ne).map(|e| d.keeps(e) as u32).collect();
    o.u32s("lora_mask", &mask);
    for t in 0..3u32 {
        let x: Vec<f32> = (0..ne).map(|_| r.normal()).collect();
        let (xbits, xw) = stored(t, &x);
        let xd: Vec<f32> = (0..ne)
            .map(|e| if d.keeps(e) { xw[e] * d.scale } else { 0.0 })
            .collect();
        let tt: Vec<f32> = (0..ne).map(|_| r.normal()).collect();
        let dx0: Vec<f32> = (0..ne).map(|_| r.normal()).collect();
        let (dx0bits, dx0w) = stored(t, &dx0);
        // add_masked: o = T::from_f32(o.to_f32() + v * d.scale) where kept.
        let dx1: Vec<f32> = (0..ne)
            .map(|e| if d.keeps(e) { dx0w[e] + tt[e] * d.scale } else { dx0[e] })
            .collect();
        let (dx1bits, _) = stored(t, &dx1);
        // Where dropped, dx keeps its stored bits: overwrite those positions.
        let sz = [4usize, 2, 2][t as usize];
        let mut dx1bits = dx1bits;
        for e in 0..ne {
            if !d.keeps(e) {
                dx1bits[e * sz..(e + 1) * sz].copy_from_slice(&dx0bits[e * sz..(e + 1) * sz]);
            }
        }
        // scale (h = T(h·s)) and narrow_scale (T(T(acc)·s)).
        let s = 0.625f32 * 3.3;
        let hsc: Vec<f32> = xw.iter().map(|&v| v * s).collect();
        let (hscbits, _) = stored(t, &hsc);
        let (_, accw) = stored(t, &tt);
        let nsc: Vec<f32> = accw.iter().map(|&v| v * s).collect();
        let (nscbits, _) = stored(t, &nsc);
        let p = format!("lora{t}");
        o.bytes(&format!("{p}_x"), &xbits);
        o.f32s(&format!("{p}_xd"), &xd);
        o.f32s(&format!("{p}_t"), &tt);
        o.bytes(&format!("{p}_dx0"), &dx0bits);
        o.bytes(&format!("{p}_dx1"), &dx1bits);
        o.bytes(&format!("{p}_hsc"), &hscbits);
        o.bytes(&format!("{p}_nsc"), &nscbits);
        o.f32s(&format!("{p}_s"), &[s]);
    }
    o.u32s("lora_shape", &[n as u32, ic as u32]);
}

// ---------------------------------------------------------------- dequant.rs

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}
pub fn f32_row(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}
pub fn f16_row(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16::from_le_bytes([s[0], s[1]]).to_f32();
    }
}
pub fn bf16_row(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16::from_le_bytes([s[0], s[1]]).to_f32();
    }
}
pub fn q8_0_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(34).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        for (y, &q) in y.iter_mut().zip(&b[2..34]) {
            *y = (q as i8) as f32 * d;
        }
    }
}
pub fn q4_0_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(18).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        let qs = &b[2..18];
        for j in 0..16 {
            let x0 = (qs[j] & 0x0F) as i32 - 8;
            let x1 = (qs[j] >> 4) as i32 - 8;
            y[j] = x0 as f32 * d;
            y[j + 16] = x1 as f32 * d;
        }
    }
}
pub fn q4_1_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(20).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        let qs = &b[4..20];
        for j in 0..16 {
            let x0 = (qs[j] & 0x0F) as i32;
            let x1 = (qs[j] >> 4) as i32;
            y[j] = x0 as f32 * d + m;
            y[j + 16] = x1 as f32 * d + m;
        }
    }
}
pub fn q5_0_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(22).zip(dst.chunks_exact_mut(32)) {
        let d = f16_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        for j in 0..16 {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            let x0 = ((qs[j] & 0x0F) | h0) as i32 - 16;
            let x1 = ((qs[j] >> 4) | h1) as i32 - 16;
            y[j] = x0 as f32 * d;
            y[j + 16] = x1 as f32 * d;
        }
    }
}
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}
pub fn q4_k_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(144).zip(dst.chunks_exact_mut(256)) {
        let d = f16_at(b, 0);
        let min = f16_at(b, 2);
        let scales = &b[4..16];
        let qs = &b[16..144];
        for k in 0..4 {
            let q = &qs[32 * k..32 * k + 32];
            let (sc, m) = scale_min_k4(2 * k, scales);
            let (d1, m1) = (d * sc as f32, min * m as f32);
            let (sc, m) = scale_min_k4(2 * k + 1, scales);
            let (d2, m2) = (d * sc as f32, min * m as f32);
            let y = &mut y[64 * k..64 * k + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}
pub fn q6_k_row(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(210).zip(dst.chunks_exact_mut(256)) {
        let d = f16_at(b, 208);
        for h in 0..2 {
            let ql = &b[64 * h..64 * h + 64];
            let qh = &b[128 + 32 * h..128 + 32 * h + 32];
            let sc = &b[192 + 8 * h..192 + 8 * h + 8];
            let y = &mut y[128 * h..128 * h + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
    }
}

fn dequant_cases(o: &Out) {
    let mut r = Rng(41);
    // (name, block values, block bytes, offsets of f16 fields, row fn)
    type RowFn = fn(&[u8], &mut [f32]);
    let types: [(&str, usize, usize, &[usize], RowFn); 9] = [
        ("q8_0", 32, 34, &[0], q8_0_row),
        ("q4_0", 32, 18, &[0], q4_0_row),
        ("q4_1", 32, 20, &[0, 2], q4_1_row),
        ("q5_0", 32, 22, &[0], q5_0_row),
        ("q4_k", 256, 144, &[0, 2], q4_k_row),
        ("q6_k", 256, 210, &[208], q6_k_row),
        ("f32", 1, 4, &[], f32_row),
        ("f16", 1, 2, &[], f16_row),
        ("bf16", 1, 2, &[], bf16_row),
    ];
    let (oc, ic) = (7usize, 512usize);
    for (name, bs, ts, f16s, row) in types {
        let row_bytes = ic / bs * ts;
        let mut w: Vec<u8> = (0..oc * row_bytes).map(|_| r.next() as u8).collect();
        for blk in 0..oc * ic / bs {
            for &off in f16s {
                let x = f16::from_f32(r.normal() * 0.05).to_le_bytes();
                w[blk * ts + off..blk * ts + off + 2].copy_from_slice(&x);
            }
        }
        if name == "f32" {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&(r.normal()).to_le_bytes());
            }
        }
        if name == "f16" {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(r.normal()).to_le_bytes());
            }
        }
        let mut y = vec![0f32; oc * ic];
        for i in 0..oc {
            row(&w[i * row_bytes..(i + 1) * row_bytes], &mut y[i * ic..(i + 1) * ic]);
        }
        o.bytes(&format!("dq_{name}_w"), &w);
        o.f32s(&format!("dq_{name}_y"), &y);
    }
    o.u32s("dq_shape", &[oc as u32, ic as u32]);
}

fn main() {
    let dir = std::env::args().nth(1).expect("usage: k2_ref OUTDIR");
    std::fs::create_dir_all(&dir).unwrap();
    let o = Out(dir);
    // The constants the kernels hold as bits, from the CPU's literals.
    o.u32s(
        "consts",
        &[
            std::f32::consts::LOG2_E.to_bits(),
            0.693_359_4f32.to_bits(),
            (-2.121_944_4e-4f32).to_bits(),
            12_582_912.0f32.to_bits(),
            (-87.3f32).to_bits(),
            88.0f32.to_bits(),
            1.987_569_2e-4f32.to_bits(),
            1.398_199_9e-3f32.to_bits(),
            8.333_452e-3f32.to_bits(),
            4.166_579_6e-2f32.to_bits(),
            1.666_666_5e-1f32.to_bits(),
            1e-30f32.to_bits(),
        ],
    );
    o.u32s("thresh", &THRESH.map(f32::to_bits));
    o.u32s("octave", &OCTAVE.map(f32::to_bits));
    // exp_f32 over a sweep of inputs (specials included).
    let mut xs: Vec<f32> = (0..200_000).map(|i| -100.0 + i as f32 * 0.001).collect();
    xs.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, -87.3, 88.0, 1e-40]);
    o.f32s("exp_x", &xs);
    o.f32s("exp_y", &xs.iter().map(|&x| exp_f32(x)).collect::<Vec<_>>());
    // The 8-bit codes' levels and log codes.
    let lv: Vec<f32> = (1..=255).map(|k| level_from_bits(k, MAX_U8)).chain((1..=127).map(|k| level_from_bits(k, MAX_I8))).collect();
    o.f32s("levels", &lv);
    let mut r = Rng(5);
    let mut ys: Vec<f32> = (0..100_000).map(|_| f32::from_bits((r.next() as u32) & 0x3fff_ffff)).collect();
    ys.extend(THRESH);
    ys.extend(OCTAVE);
    ys.extend([1.0, 0.0, f32::MIN_POSITIVE, 1e-40, f32::NAN]);
    o.f32s("logc_y", &ys);
    o.u32s("logc_c", &ys.iter().map(|&y| log_code(y) as u32).collect::<Vec<_>>());
    xent_cases(&o);
    adamw_cases(&o);
    lora_cases(&o);
    dequant_cases(&o);
}
