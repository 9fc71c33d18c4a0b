//! One attention layer, forward + backward, with a sliding window against the same layer with
//! full causal attention, alternated in one process (a shared machine's slow spells fall on
//! both). The default is one layer of Mistral 7B's attention (32 query heads, 8 KV heads, head
//! size 128) at batch 1, seq 4096, window 512, fp32, on 2 threads: the case of [families] #47's
//! "at least 3× faster". Writes one JSON object (the configuration, every run's seconds, each
//! side's median and best, and the full/window ratios) to stdout, or to `OUT` when given.
//!
//! ```text
//! cargo run --release --example attention_window
//! T=2 SEQ=4096 WINDOW=512 NH=32 NKV=8 HD=128 B=1 ROUNDS=3 OUT=window.json \
//!     cargo run --release --example attention_window
//! ```
//!
//! `T`: threads (default 2); `ROUNDS`: alternated rounds, each one run of each side after one
//! untimed warm-up run of each (default 3). A run is one forward and one backward
//! (`memwall::backend::cpu::attention`, the kernels `Op::Attention` and
//! `Op::AttentionBackward` run on the CPU), each side with the workspace its window needs.
use memwall::backend::cpu::attention::{
    attention_backward, attention_forward, attention_workspace_len,
};
use std::time::Instant;

/// `NAME` from the environment as a number, else `default`.
fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
        })
        .unwrap_or(default)
}

/// Deterministic values in [-amp, amp] (xorshift64*).
fn rand_vec(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            ((s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * amp
        })
        .collect()
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    let n = x.len();
    if n % 2 == 1 {
        x[n / 2]
    } else {
        0.5 * (x[n / 2 - 1] + x[n / 2])
    }
}

fn main() {
    let threads = env("T", 2);
    let (b, t, window) = (env("B", 1), env("SEQ", 4096), env("WINDOW", 512));
    let (nh, nkv, hd) = (env("NH", 32), env("NKV", 8), env("HD", 128));
    let rounds = env("ROUNDS", 3).max(1);
    let (ld, co) = ((nh + 2 * nkv) * hd, nh * hd);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let qkv = rand_vec(b * t * ld, 1, 2.0); // [B, T, (NH + 2·NKV)·hd]
    let dout = rand_vec(b * t * co, 2, 1.0); // [B, T, NH·hd]
    let mut out = vec![0.0f32; b * t * co]; // [B, T, NH·hd]
    let mut lse = vec![0.0f32; b * nh * t]; // [B, NH, T]
    let mut dqkv = vec![0.0f32; b * t * ld]; // [B, T, (NH + 2·NKV)·hd]
    let sides = [("window", Some(window)), ("full", None)];
    let ws_len = |w: Option<usize>| attention_workspace_len::<f32>(t, hd, w, threads);
    let mut ws: Vec<Vec<f32>> = sides.iter().map(|s| vec![0.0; ws_len(s.1)]).collect();
    // One forward + backward; returns (forward seconds, forward + backward seconds).
    let mut run = |k: usize| {
        let w = sides[k].1;
        pool.install(|| {
            let start = Instant::now();
            attention_forward(
                &mut out, &mut lse, &qkv, b, t, nh, nkv, hd, hd as f32, None, w, &mut ws[k],
            );
            let fwd = start.elapsed().as_secs_f64();
            attention_backward(
                &mut dqkv, &dout, &qkv, &out, &lse, b, t, nh, nkv, hd, hd as f32, None, w,
                &mut ws[k],
            );
            (fwd, start.elapsed().as_secs_f64())
        })
    };
    for k in 0..sides.len() {
        run(k); // warm-up: pages touched, caches and the gemm crate's scratch in place
    }
    let mut times: Vec<Vec<(f64, f64)>> = vec![vec![]; sides.len()];
    for r in 0..rounds {
        for k in 0..sides.len() {
            let s = run(k);
            eprintln!(
                "round {r} {:>6}: forward {:.3} s, forward+backward {:.3} s",
                sides[k].0, s.0, s.1
            );
            times[k].push(s);
        }
    }
    assert!(dqkv.iter().all(|v| v.is_finite()), "a non-finite gradient");
    let stats = |k: usize| {
        let all: Vec<f64> = times[k].iter().map(|x| x.1).collect();
        let fwd: Vec<f64> = times[k].iter().map(|x| x.0).collect();
        let best = all.iter().cloned().fold(f64::INFINITY, f64::min);
        (median(fwd), median(all.clone()), best, all)
    };
    let (win, full) = (stats(0), stats(1));
    let side = |s: &(f64, f64, f64, Vec<f64>), w: Option<usize>| {
        serde_json::json!({
            "window": w,
            "ws_elems": ws_len(w),
            "forward_median_s": s.0,
            "median_s": s.1,
            "best_s": s.2,
            "runs_s": s.3,
        })
    };
    let report = serde_json::json!({
        "what": "one attention layer, forward + backward (memwall::backend::cpu::attention)",
        "config": {
            "batch": b, "seq": t, "window": window, "nh": nh, "nkv": nkv, "hd": hd,
            "dtype": "f32", "threads": threads, "rounds": rounds,
            "cpu": memwall::util::machine::cpu_name(),
        },
        "window": side(&win, Some(window)),
        "full": side(&full, None),
        "ratio_median": full.1 / win.1,
        "ratio_best": full.2 / win.2,
        "ratio_forward_median": full.0 / win.0,
    });
    let text = serde_json::to_string_pretty(&report).unwrap();
    match std::env::var("OUT") {
        Ok(path) => std::fs::write(&path, text + "\n").unwrap(),
        Err(_) => println!("{text}"),
    }
    eprintln!(
        "full / window: {:.2}× (medians), {:.2}× (best runs)",
        full.1 / win.1,
        full.2 / win.2
    );
}
