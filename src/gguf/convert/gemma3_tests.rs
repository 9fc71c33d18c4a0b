//! Gemma 3 files in: a `gemma3` GGUF as llama.cpp's converter writes one (`tiny_gemma3`)
//! converts to transformers' names with every norm minus the 1 the file adds, its layer
//! pattern and the sliding layers' θ as llama.cpp reads them; a LoRA base kept as the file's
//! blocks takes the same norms.

use super::super::hf::{Arch, map_model};
use super::super::testutil::{GgufWriter, tiny_gemma3, tiny_model, write_temp};
use super::*;
use crate::dtype::GgmlType;
use crate::gguf::file::Value;
use crate::model::ModelSpec;
use safetensors::SafeTensors;
use serde_json::json;

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn gguf_values(f: &GgufFile, name: &str) -> Vec<f32> {
    let t = f.tensor(name).unwrap();
    let mut v = vec![0f32; t.n_elements as usize];
    dequantize(t.ty, f.tensor_data(t), &mut v).unwrap();
    v
}

/// `w` converted to f32 (the file, the temporary directory, the output).
fn convert_it(w: &GgufWriter) -> (GgufFile, tempfile::TempDir, PathBuf) {
    let (dir, path) = write_temp(&w.to_bytes());
    let out = dir.path().join("hf");
    convert(&ConvertOptions {
        input: path.clone(),
        out: out.clone(),
        dtype: OutDtype::F32,
        force: false,
        progress: false,
    })
    .unwrap();
    (GgufFile::open(&path).unwrap(), dir, out)
}

/// The config `map_model` makes of `w`'s file.
fn config_of(w: &GgufWriter) -> Result<serde_json::Value> {
    let (_dir, path) = write_temp(&w.to_bytes());
    let f = GgufFile::open(&path)?;
    Ok(map_model(&f)?.config_json("float32"))
}

const SLIDING: &str = "sliding_attention";
const FULL: &str = "full_attention";

#[test]
fn gemma3_converts_to_transformers_names_with_every_norm_minus_one() {
    let (f, _dir, out) = convert_it(&tiny_gemma3(7));
    let cfg = super::tests::read_json(&out.join(CONFIG_FILE));
    for (k, v) in [
        ("model_type", json!("gemma3_text")),
        ("architectures", json!(["Gemma3ForCausalLM"])),
        ("hidden_size", json!(32)),
        ("intermediate_size", json!(64)),
        ("num_hidden_layers", json!(7)),
        ("num_attention_heads", json!(4)),
        ("num_key_value_heads", json!(2)),
        ("head_dim", json!(16)),
        ("query_pre_attn_scalar", json!(16)),
        ("rope_theta", json!(1e6)),
        ("rope_local_base_freq", json!(1e4)),
        ("sliding_window", json!(4)),
        ("hidden_activation", json!("gelu_pytorch_tanh")),
        ("tie_word_embeddings", json!(true)),
        (
            "layer_types",
            json!([SLIDING, SLIDING, SLIDING, SLIDING, SLIDING, FULL, SLIDING]),
        ),
    ] {
        assert_eq!(cfg[k], v, "config.json {k}");
    }
    assert_eq!(cfg["rope_scaling"]["factor"], json!(2.0));
    assert!(cfg.get("hidden_act").is_none());
    let spec = crate::ckpt::load_spec(&out).unwrap();
    assert_eq!(spec.family, crate::model::Family::Gemma3);
    assert_eq!(spec.layer_rope(0).unwrap().0, 1e4);
    assert_eq!(spec.layer_rope(5).unwrap().0, 1e6);
    assert_eq!(spec.layer_window(5), None);
    assert_eq!(spec.layer_window(6), Some(4));

    let bytes = fs::read(out.join(MODEL_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let hf = |n: &str| f32s(st.tensor(n).unwrap().data());
    for (gguf, name, shift) in [
        ("blk.3.attn_norm.weight", "input_layernorm", 1.0),
        ("blk.3.attn_q_norm.weight", "self_attn.q_norm", 1.0),
        ("blk.3.attn_k_norm.weight", "self_attn.k_norm", 1.0),
        (
            "blk.3.post_attention_norm.weight",
            "post_attention_layernorm",
            1.0,
        ),
        ("blk.3.ffn_norm.weight", "pre_feedforward_layernorm", 1.0),
        (
            "blk.3.post_ffw_norm.weight",
            "post_feedforward_layernorm",
            1.0,
        ),
        // NEOX rotation: q and k as they are, no permutation to undo.
        ("blk.3.attn_q.weight", "self_attn.q_proj", 0.0),
        ("blk.3.attn_k.weight", "self_attn.k_proj", 0.0),
        ("blk.3.ffn_down.weight", "mlp.down_proj", 0.0),
    ] {
        let want: Vec<f32> = gguf_values(&f, gguf).iter().map(|v| v - shift).collect();
        assert_eq!(hf(&format!("model.layers.3.{name}.weight")), want, "{gguf}");
    }
    let want: Vec<f32> = gguf_values(&f, "output_norm.weight")
        .iter()
        .map(|v| v - 1.0)
        .collect();
    assert_eq!(hf("model.norm.weight"), want);
    assert!(st.tensor("lm_head.weight").is_err(), "a tied head");
}

/// The keys llama.cpp decides Gemma 3's layers by: without `freq_base_swa` the sliding
/// layers turn with its 10000, without a window no layer slides, a `sliding_window_pattern`
/// (a period, or a flag a layer) replaces the period 6; 62 layers scale attention by width /
/// heads; a final softcapping is refused by its key.
#[test]
fn gemma3_layers_and_thetas_are_as_llama_cpp_reads_the_keys() {
    let mut w = tiny_gemma3(7);
    w.remove_kv("gemma3.rope.freq_base_swa");
    assert_eq!(
        config_of(&w).unwrap()["rope_local_base_freq"],
        json!(10000.0)
    );
    w.set_kv("gemma3.rope.freq_base_swa", Value::F32(5e4));
    assert_eq!(
        config_of(&w).unwrap()["rope_local_base_freq"],
        json!(50000.0)
    );

    w.set_kv("gemma3.attention.sliding_window_pattern", Value::U32(3));
    let types = &config_of(&w).unwrap()["layer_types"];
    let want: Vec<&str> = (0..7)
        .map(|l| if l % 3 < 2 { SLIDING } else { FULL })
        .collect();
    assert_eq!(types, &json!(want));

    let flags = [true, false, false, true, true, true, false];
    w.set_kv(
        "gemma3.attention.sliding_window_pattern",
        Value::Array(flags.iter().map(|&b| Value::Bool(b)).collect()),
    );
    let want: Vec<&str> = flags
        .iter()
        .map(|&b| if b { SLIDING } else { FULL })
        .collect();
    assert_eq!(config_of(&w).unwrap()["layer_types"], json!(want));

    w.remove_kv("gemma3.attention.sliding_window");
    let cfg = config_of(&w).unwrap();
    assert_eq!(cfg["layer_types"], json!(vec![FULL; 7]));
    assert!(cfg.get("sliding_window").is_none());
    let spec = ModelSpec::from_hf_config_str(&cfg.to_string(), "c.json").unwrap();
    assert!((0..7).all(|l| spec.layer_window(l).is_none()));

    let mut w = tiny_gemma3(7);
    w.kv("gemma3.final_logit_softcapping", Value::F32(30.0));
    let e = format!("{:#}", config_of(&w).unwrap_err());
    assert!(e.contains("gemma3.final_logit_softcapping"), "{e}");

    // llama.cpp's 27B: (32 / 4)^-1/2, not 16^-1/2, as transformers and memwall read the
    // config.
    let cfg = config_of(&tiny_gemma3(62)).unwrap();
    assert_eq!(cfg["query_pre_attn_scalar"], json!(8));
    let spec = ModelSpec::from_hf_config_str(&cfg.to_string(), "c.json").unwrap();
    assert_eq!((spec.head_dim, spec.attention_scale_dim()), (16, 8.0));
}

#[test]
fn gemma3_tensors_are_refused_in_other_architectures_and_missing_ones_named() {
    let mut w = tiny_model("llama", true);
    w.random_tensor("blk.0.post_ffw_norm.weight", &[32], GgmlType::F32, 7);
    let (_dir, path) = write_temp(&w.to_bytes());
    let e = format!(
        "{:#}",
        map_model(&GgufFile::open(&path).unwrap()).unwrap_err()
    );
    assert!(
        e.contains("blk.0.post_ffw_norm.weight") && e.contains("llama"),
        "{e}"
    );

    let mut w = tiny_gemma3(2);
    w.remove_tensor("blk.1.post_attention_norm.weight");
    let (_dir, path) = write_temp(&w.to_bytes());
    let e = format!(
        "{:#}",
        map_model(&GgufFile::open(&path).unwrap()).unwrap_err()
    );
    assert!(e.contains("blk.1.post_attention_norm.weight"), "{e}");
}

/// `--base-quant keep` of a Gemma 3 file: the projections are the file's blocks, byte for
/// byte; the norms, decoded to f32, are the converted directory's (the file's minus 1).
#[test]
fn a_kept_gemma3_base_takes_its_norms_minus_one() {
    let w = tiny_gemma3(7);
    let (_f, dir, out) = convert_it(&w);
    let gguf = dir.path().join("kept.gguf");
    fs::write(&gguf, w.to_bytes()).unwrap();
    let spec = crate::ckpt::load_spec(&out).unwrap();
    let layout = crate::model::ParamLayout::new(&spec);
    let mut converted = vec![0f32; layout.total];
    crate::ckpt::load_params(&out, &layout, &mut converted).unwrap();
    let src = crate::gguf::base::BaseSource::open(&gguf).unwrap();
    let model = map_model(&GgufFile::open(&gguf).unwrap()).unwrap();
    assert_eq!(model.arch, Arch::Gemma3);
    let types = src.types();
    let (mut norms, mut blocks) = (0, 0);
    for t in &layout.tensors {
        let ty = types[&t.name];
        if t.shape.len() == 1 {
            let mut b = vec![0u8; 4 * t.range.len()];
            src.copy(t, None, &mut b).unwrap();
            assert_eq!(f32s(&b), converted[t.range.clone()], "{}", t.name);
            norms += 1;
        } else if ty.block_size > 1 || ty != GgmlType::F32 {
            let h = model.tensors.iter().find(|h| h.name == t.name).unwrap();
            let f = GgufFile::open(&gguf).unwrap();
            let info = f.tensor(&h.gguf).unwrap();
            let mut b = vec![0u8; f.tensor_data(info).len()];
            src.copy(t, Some(ty), &mut b).unwrap();
            assert!(
                b == f.tensor_data(info),
                "{}: the file's own blocks",
                t.name
            );
            blocks += 1;
        }
    }
    assert_eq!(norms, 7 * 6 + 1);
    assert!(blocks >= 7 * 7, "{blocks}");
}
