//! Straightforward reference twins of the attention kernels (allocating, f64 accumulation,
//! materialised probabilities, K and V literally repeat-interleaved to NH heads; packed rows
//! and sliding windows masked query by query, over the whole `[T, T]` square).

/// Key (`v = false`) or value (`v = true`) heads of `qkv` `[B,T,(NH+2·NKV)·hd]`
/// repeat-interleaved to NH heads, `[B, T, NH·hd]`: head h is KV head h / (NH/NKV), as
/// transformers' `repeat_kv` (each KV head repeated g times in a row, not the heads tiled).
pub fn repeat_kv(
    qkv: &[f64],
    (b, t): (usize, usize),
    (nh, nkv, hd): (usize, usize, usize),
    v: bool,
) -> Vec<f64> {
    let (ld, g) = ((nh + 2 * nkv) * hd, nh / nkv);
    let off = if v { (nh + nkv) * hd } else { nh * hd };
    let mut rep = vec![0.0; b * t * nh * hd];
    for r in 0..b * t {
        for h in 0..nh {
            for e in 0..hd {
                rep[(r * nh + h) * hd + e] = qkv[r * ld + off + (h / g) * hd + e];
            }
        }
    }
    rep
}

/// Whether query i of row b sees key j (the mask, literally): causally (`j ≤ i`), within its
/// example for positions `pos` `[B,T]` (packed examples: `j ≥ i - pos[b, i]`), and within a
/// sliding `window` (`i - j < window`, transformers' `sliding_window_overlay`).
pub fn visible(
    pos: Option<&[u32]>,
    window: Option<usize>,
    t: usize,
    (bi, i, j): (usize, usize, usize),
) -> bool {
    j <= i
        && pos.is_none_or(|p| j + p[bi * t + i] as usize >= i)
        && window.is_none_or(|w| i - j < w)
}

/// f64 forward: returns (out `[B,T,NH·hd]`, lse `[B,NH,T]`, att `[B,NH,T,T]` probabilities,
/// zero outside the mask) for `qkv` `[B,T,(NH+2·NKV)·hd]`. Query i of row b attends to the
/// keys j that are `visible(pos, window, t, (b, i, j))`.
pub fn forward_f64(
    qkv: &[f64],
    b: usize,
    t: usize,
    (nh, nkv, hd): (usize, usize, usize),
    scale_dim: f64,
    pos: Option<&[u32]>, // [B, T]
    window: Option<usize>,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    assert!(nkv > 0 && nh.is_multiple_of(nkv));
    let (ld, co) = ((nh + 2 * nkv) * hd, nh * hd);
    assert_eq!(qkv.len(), b * t * ld);
    assert!(pos.is_none_or(|p| p.len() == b * t));
    let k = repeat_kv(qkv, (b, t), (nh, nkv, hd), false); // [B, T, NH·hd]
    let v = repeat_kv(qkv, (b, t), (nh, nkv, hd), true); // [B, T, NH·hd]
    let scale = 1.0 / scale_dim.sqrt();
    let mut out = vec![0.0; b * t * co];
    let mut lse = vec![0.0; b * nh * t];
    let mut att = vec![0.0; b * nh * t * t];
    for bi in 0..b {
        for h in 0..nh {
            for i in 0..t {
                let see = |j: usize| visible(pos, window, t, (bi, i, j));
                let qi = &qkv[(bi * t + i) * ld + h * hd..][..hd];
                let row = &mut att[((bi * nh + h) * t + i) * t..][..t];
                let mut mx = f64::NEG_INFINITY;
                for (j, r) in row.iter_mut().enumerate().filter(|&(j, _)| see(j)) {
                    let kj = &k[(bi * t + j) * co + h * hd..][..hd];
                    let s: f64 = qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale;
                    *r = s;
                    mx = mx.max(s);
                }
                let mut sum = 0.0;
                for (_, r) in row.iter_mut().enumerate().filter(|&(j, _)| see(j)) {
                    *r = (*r - mx).exp();
                    sum += *r;
                }
                for (_, r) in row.iter_mut().enumerate().filter(|&(j, _)| see(j)) {
                    *r /= sum;
                }
                lse[(bi * nh + h) * t + i] = mx + sum.ln();
                let o = &mut out[(bi * t + i) * co + h * hd..][..hd];
                for (j, &pr) in row.iter().enumerate().filter(|&(j, _)| see(j)) {
                    let vj = &v[(bi * t + j) * co + h * hd..][..hd];
                    for (oo, vv) in o.iter_mut().zip(vj) {
                        *oo += pr * vv;
                    }
                }
            }
        }
    }
    (out, lse, att)
}

/// Naive forward (f32 in/out, f64 inside): writes `out` `[B,T,NH·hd]` and `lse` `[B,NH,T]`
/// from `qkv` `[B,T,(NH+2·NKV)·hd]`, with positions `pos` `[B,T]` and `window` as
/// `forward_f64`.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    scale_dim: f32,
    pos: Option<&[u32]>,
    window: Option<usize>,
) {
    let q64: Vec<f64> = qkv.iter().map(|&x| x as f64).collect();
    let (o, l, _) = forward_f64(&q64, b, t, (nh, nkv, hd), scale_dim as f64, pos, window);
    assert_eq!((out.len(), lse.len()), (o.len(), l.len()));
    for (d, s) in out.iter_mut().zip(&o) {
        *d = *s as f32;
    }
    for (d, s) in lse.iter_mut().zip(&l) {
        *d = *s as f32;
    }
}

/// f64 backward from scratch (recomputes the probabilities from `qkv`): returns dqkv
/// `[B,T,(NH+2·NKV)·hd]` for upstream gradient `dout` `[B,T,NH·hd]`. The gradients of the
/// repeated K and V (`[B,T,NH·hd]`) are computed per query head, then summed over each
/// KV head's g copies. Positions `pos` `[B,T]` and `window` as `forward_f64`.
#[allow(clippy::too_many_arguments)]
pub fn backward_f64(
    dout: &[f64],
    qkv: &[f64],
    b: usize,
    t: usize,
    (nh, nkv, hd): (usize, usize, usize),
    scale_dim: f64,
    pos: Option<&[u32]>,
    window: Option<usize>,
) -> Vec<f64> {
    let (ld, co, g) = ((nh + 2 * nkv) * hd, nh * hd, nh / nkv);
    let scale = 1.0 / scale_dim.sqrt();
    let (_, _, att) = forward_f64(qkv, b, t, (nh, nkv, hd), scale_dim, pos, window);
    let k = repeat_kv(qkv, (b, t), (nh, nkv, hd), false); // [B, T, NH·hd]
    let v = repeat_kv(qkv, (b, t), (nh, nkv, hd), true); // [B, T, NH·hd]
    let mut dqkv = vec![0.0; b * t * ld];
    let mut dk = vec![0.0; b * t * co]; // gradient of the repeated K [B, T, NH·hd]
    let mut dv = vec![0.0; b * t * co]; // gradient of the repeated V [B, T, NH·hd]
    let mut dp = vec![0.0; t];
    for bi in 0..b {
        for h in 0..nh {
            for i in 0..t {
                let see = |j: &usize| visible(pos, window, t, (bi, i, *j));
                let p = &att[((bi * nh + h) * t + i) * t..][..t];
                let doi = &dout[(bi * t + i) * co + h * hd..][..hd];
                // dP[j] = dO_i · V_j ; dV_j += P[j] dO_i
                for j in (0..t).filter(see) {
                    let vrow = (bi * t + j) * co + h * hd;
                    dp[j] = (0..hd).map(|e| doi[e] * v[vrow + e]).sum();
                    for e in 0..hd {
                        dv[vrow + e] += p[j] * doi[e];
                    }
                }
                // softmax backward: dS[j] = P[j] (dP[j] - Σ_k P[k] dP[k])
                let dot: f64 = (0..t).filter(see).map(|j| p[j] * dp[j]).sum();
                let qrow = (bi * t + i) * ld + h * hd;
                for j in (0..t).filter(see) {
                    let ds = p[j] * (dp[j] - dot) * scale;
                    let krow = (bi * t + j) * co + h * hd;
                    for e in 0..hd {
                        dqkv[qrow + e] += ds * k[krow + e];
                        dk[krow + e] += ds * qkv[qrow + e];
                    }
                }
            }
        }
    }
    // Undo the repeat: KV head j's gradient is the sum over its query heads j·g … j·g+g−1.
    let (k0, v0) = (nh * hd, (nh + nkv) * hd);
    for r in 0..b * t {
        for h in 0..nh {
            for e in 0..hd {
                let (src, dst) = ((r * nh + h) * hd + e, r * ld + (h / g) * hd + e);
                dqkv[dst + k0] += dk[src];
                dqkv[dst + v0] += dv[src];
            }
        }
    }
    dqkv
}

/// Naive backward (f32 in/out, f64 inside): overwrites `dqkv` `[B,T,(NH+2·NKV)·hd]`, with
/// positions `pos` `[B,T]` and `window` as `forward_f64`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    scale_dim: f32,
    pos: Option<&[u32]>,
    window: Option<usize>,
) {
    let d64: Vec<f64> = dout.iter().map(|&x| x as f64).collect();
    let q64: Vec<f64> = qkv.iter().map(|&x| x as f64).collect();
    let g = backward_f64(
        &d64,
        &q64,
        b,
        t,
        (nh, nkv, hd),
        scale_dim as f64,
        pos,
        window,
    );
    assert_eq!(dqkv.len(), g.len());
    for (d, s) in dqkv.iter_mut().zip(&g) {
        *d = *s as f32;
    }
}
