//! Test-only GGUF writer: builds files byte by byte so the reader, the dequantizers and the
//! converter are tested on files the tests write (no model download needed). Values are
//! encoded by the real writer's functions ([`super::write`]); this one builds files in
//! memory and can write what [`super::write::write_gguf`] refuses (bad type ids, version 2).

use super::file::Value;
use super::write::{put_str, put_value, value_type_id as type_id};
use crate::dtype::GgmlType;
use std::path::PathBuf;

/// A GGUF file under construction: metadata and tensors in the order they are added.
pub struct GgufWriter {
    pub version: u32,
    /// Data-section alignment used for padding (set `general.alignment` to match).
    pub alignment: usize,
    kvs: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new(version: u32) -> GgufWriter {
        GgufWriter {
            version,
            alignment: 32,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    pub fn kv(&mut self, key: &str, v: Value) -> &mut Self {
        self.kvs.push((key.to_string(), v));
        self
    }

    /// Replaces the value of `key` (added at the end if absent).
    pub fn set_kv(&mut self, key: &str, v: Value) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self.kv(key, v)
    }

    /// Drops the key `key`.
    pub fn remove_kv(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }

    /// Drops the tensor `name`.
    pub fn remove_tensor(&mut self, name: &str) -> &mut Self {
        self.tensors.retain(|t| t.0 != name);
        self
    }

    /// A tensor with `dims` innermost first and its raw bytes.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: &[u8]) -> &mut Self {
        self.tensor_raw(name, dims, ty.id, data)
    }

    /// Like [`GgufWriter::tensor`] with any type id (also invalid ones).
    pub fn tensor_raw(&mut self, name: &str, dims: &[u64], ty: u32, data: &[u8]) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data.to_vec()));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut b, k);
            b.extend_from_slice(&type_id(v).to_le_bytes());
            put_value(&mut b, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).next_multiple_of(self.alignment);
        }
        b.resize(b.len().next_multiple_of(self.alignment), 0);
        let start = b.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            b.resize(start + off, 0);
            b.extend_from_slice(data);
        }
        b
    }
}

/// Writes `bytes` to `model.gguf` in a fresh temporary directory (kept alive by the guard).
pub fn write_temp(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    (dir, path)
}

/// Shorthand for a string value.
pub fn s(x: &str) -> Value {
    Value::String(x.to_string())
}

/// Shorthand for an array of strings.
pub fn strs<'a>(xs: impl IntoIterator<Item = &'a str>) -> Value {
    Value::Array(xs.into_iter().map(s).collect())
}

/// Tokens of the test vocabulary [`GgufWriter::tokenizer`] writes.
pub const TEST_VOCAB: usize = 3 + 256 + 6 + 1;

impl GgufWriter {
    /// A small byte-level BPE tokenizer: 3 control tokens (`<|endoftext|>`, `<|im_start|>`
    /// = bos, `<|im_end|>` = eos), the 256 byte characters, 6 merged tokens (merges
    /// `Ġ t`, `h e`, `Ġt he`, `1 2`, `l l`, `he ll`) and one user-defined token `<my_tok>`.
    pub fn tokenizer(&mut self, pre: Option<&str>, add_bos: bool) -> &mut Self {
        let alphabet = super::tokenizer::byte_level_alphabet();
        let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
            .map(String::from)
            .to_vec();
        let mut types = vec![3, 3, 3];
        for c in alphabet {
            tokens.push(c.to_string());
            types.push(1);
        }
        let merges = ["Ġ t", "h e", "Ġt he", "1 2", "l l", "he ll"];
        for m in merges {
            tokens.push(m.replace(' ', ""));
            types.push(1);
        }
        tokens.push("<my_tok>".into());
        types.push(4);
        assert_eq!(tokens.len(), TEST_VOCAB);
        self.kv("tokenizer.ggml.model", s("gpt2"));
        if let Some(p) = pre {
            self.kv("tokenizer.ggml.pre", s(p));
        }
        self.kv(
            "tokenizer.ggml.tokens",
            strs(tokens.iter().map(String::as_str)),
        );
        self.kv(
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        );
        self.kv("tokenizer.ggml.merges", strs(merges));
        self.kv("tokenizer.ggml.bos_token_id", Value::U32(1));
        self.kv("tokenizer.ggml.eos_token_id", Value::U32(2));
        self.kv("tokenizer.ggml.add_bos_token", Value::Bool(add_bos));
        self
    }

    /// A tensor of `dims` (innermost first) of type `ty` filled with pseudo-random blocks
    /// whose f16 scales are finite (0.01 to 0.02), so every value decodes to a number.
    pub fn random_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        seed: u64,
    ) -> &mut Self {
        let n: u64 = dims.iter().product();
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let bytes = ty.bytes_for(n).expect("whole blocks") as usize;
        let mut data: Vec<u8> = (0..bytes).map(|_| next() as u8).collect();
        let scale = |at: usize, data: &mut [u8], r: u64| {
            let v = half::f16::from_f32(0.01 + (r % 100) as f32 * 1e-4);
            data[at..at + 2].copy_from_slice(&v.to_le_bytes());
        };
        let ts = ty.type_size as usize;
        let scale_at: &[usize] = match ty.name {
            "F32" => {
                for (i, c) in data.chunks_exact_mut(4).enumerate() {
                    let v = ((i as f32) * 0.37).sin() * 0.1 + (next() % 7) as f32 * 1e-3;
                    c.copy_from_slice(&v.to_le_bytes());
                }
                &[]
            }
            "F16" | "BF16" => {
                for c in data.chunks_exact_mut(2) {
                    let v = (next() % 1000) as f32 * 1e-3 - 0.5;
                    let b = if ty.name == "F16" {
                        half::f16::from_f32(v).to_le_bytes()
                    } else {
                        half::bf16::from_f32(v).to_le_bytes()
                    };
                    c.copy_from_slice(&b);
                }
                &[]
            }
            "Q8_0" | "Q4_0" => &[0],
            "Q4_1" | "Q4_K" => &[0, 2],
            "Q6_K" => &[208],
            _ => &[],
        };
        for b in 0..bytes / ts {
            for &at in scale_at {
                let r = next();
                scale(b * ts + at, &mut data, r);
            }
        }
        self.tensor(name, dims, ty, &data)
    }
}

/// A tiny Gemma 3 as llama.cpp's `convert_hf_to_gguf.py` writes one (`Gemma3Model`):
/// `layers` layers, width 32, 4 heads of 16 (key/value lengths 16, no rope dimension count),
/// 2 KV heads, MLP 64, the SentencePiece test vocabulary (`add_space_prefix` false), a tied
/// head; `gemma3.*` keys with the full layers' linear scaling by 2 (θ 10⁶), the sliding
/// layers' θ 10⁴ (`rope.freq_base_swa`) and a window of 4; per layer the four norms, the q/k
/// norms (F32, holding the `1 + w` the converter stores) and the projections in several
/// types.
pub fn tiny_gemma3(layers: u64) -> GgufWriter {
    let (h, q, kv, hd, ffn, vocab) = (32u64, 64u64, 32u64, 16u64, 64u64, TEST_VOCAB as u64);
    let mut w = GgufWriter::new(3);
    let k = |n: &str| format!("gemma3.{n}");
    w.kv("general.architecture", s("gemma3"));
    w.kv(&k("block_count"), Value::U32(layers as u32));
    w.kv(&k("context_length"), Value::U32(128));
    w.kv(&k("embedding_length"), Value::U32(h as u32));
    w.kv(&k("feed_forward_length"), Value::U32(ffn as u32));
    w.kv(&k("attention.head_count"), Value::U32(4));
    w.kv(&k("attention.head_count_kv"), Value::U32(2));
    w.kv(&k("rope.scaling.type"), s("linear"));
    w.kv(&k("rope.scaling.factor"), Value::F32(2.0));
    w.kv(&k("rope.freq_base"), Value::F32(1e6));
    w.kv(&k("rope.freq_base_swa"), Value::F32(1e4));
    w.kv(&k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6));
    w.kv(&k("attention.key_length"), Value::U32(hd as u32));
    w.kv(&k("attention.value_length"), Value::U32(hd as u32));
    w.kv("general.file_type", Value::U32(0));
    w.kv(&k("attention.sliding_window"), Value::U32(4));
    w.spm_tokenizer();
    w.kv("tokenizer.ggml.add_space_prefix", Value::Bool(false));
    w.random_tensor("token_embd.weight", &[h, vocab], GgmlType::Q8_0, 1);
    for l in 0..layers {
        let t = |n: &str| format!("blk.{l}.{n}");
        w.random_tensor(&t("attn_norm.weight"), &[h], GgmlType::F32, 10 + l);
        w.random_tensor(&t("attn_q.weight"), &[h, q], GgmlType::Q8_0, 20 + l);
        w.random_tensor(&t("attn_k.weight"), &[h, kv], GgmlType::F16, 30 + l);
        w.random_tensor(&t("attn_v.weight"), &[h, kv], GgmlType::Q4_0, 40 + l);
        w.random_tensor(&t("attn_q_norm.weight"), &[hd], GgmlType::F32, 50 + l);
        w.random_tensor(&t("attn_k_norm.weight"), &[hd], GgmlType::F32, 60 + l);
        w.random_tensor(&t("attn_output.weight"), &[q, h], GgmlType::BF16, 70 + l);
        w.random_tensor(
            &t("post_attention_norm.weight"),
            &[h],
            GgmlType::F32,
            80 + l,
        );
        w.random_tensor(&t("ffn_norm.weight"), &[h], GgmlType::F32, 90 + l);
        w.random_tensor(&t("ffn_gate.weight"), &[h, ffn], GgmlType::Q8_0, 100 + l);
        w.random_tensor(&t("ffn_up.weight"), &[h, ffn], GgmlType::Q4_1, 110 + l);
        w.random_tensor(&t("ffn_down.weight"), &[ffn, h], GgmlType::F16, 120 + l);
        w.random_tensor(&t("post_ffw_norm.weight"), &[h], GgmlType::F32, 130 + l);
    }
    w.random_tensor("output_norm.weight", &[h], GgmlType::F32, 200);
    w
}

/// A tiny `arch` model (llama, qwen2 or qwen3): 2 layers, width 32, 4 heads of 8, 2 KV heads,
/// MLP 256, the test vocabulary; quantized tensors of every decodable type; `tied` leaves out
/// `output.weight`. qwen3 has `attn_q_norm` / `attn_k_norm` `[8]` and its key/value lengths.
pub fn tiny_model(arch: &str, tied: bool) -> GgufWriter {
    let (h, q, kv, ffn, vocab) = (32u64, 32u64, 16u64, 256u64, TEST_VOCAB as u64);
    let mut w = GgufWriter::new(3);
    w.kv("general.architecture", s(arch));
    w.kv(&format!("{arch}.block_count"), Value::U32(2));
    w.kv(&format!("{arch}.context_length"), Value::U32(128));
    w.kv(&format!("{arch}.embedding_length"), Value::U32(h as u32));
    w.kv(
        &format!("{arch}.feed_forward_length"),
        Value::U32(ffn as u32),
    );
    w.kv(&format!("{arch}.attention.head_count"), Value::U32(4));
    w.kv(&format!("{arch}.attention.head_count_kv"), Value::U32(2));
    w.kv(
        &format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(1e-5),
    );
    w.kv(&format!("{arch}.rope.freq_base"), Value::F32(100000.0));
    w.kv(&format!("{arch}.rope.dimension_count"), Value::U32(8));
    if arch == "qwen3" {
        w.kv(&format!("{arch}.attention.key_length"), Value::U32(8));
        w.kv(&format!("{arch}.attention.value_length"), Value::U32(8));
    }
    w.tokenizer(Some("smollm"), false);
    w.random_tensor("token_embd.weight", &[h, vocab], GgmlType::Q8_0, 1);
    for l in 0..2u64 {
        let t = |n: &str| format!("blk.{l}.{n}");
        w.random_tensor(&t("attn_norm.weight"), &[h], GgmlType::F32, 10 + l);
        w.random_tensor(&t("attn_q.weight"), &[h, q], GgmlType::Q4_1, 20 + l);
        w.random_tensor(&t("attn_k.weight"), &[h, kv], GgmlType::Q4_0, 30 + l);
        w.random_tensor(&t("attn_v.weight"), &[h, kv], GgmlType::F16, 40 + l);
        if arch == "qwen2" {
            w.random_tensor(&t("attn_q.bias"), &[q], GgmlType::F32, 50 + l);
            w.random_tensor(&t("attn_k.bias"), &[kv], GgmlType::F32, 60 + l);
            w.random_tensor(&t("attn_v.bias"), &[kv], GgmlType::F32, 70 + l);
        }
        if arch == "qwen3" {
            w.random_tensor(&t("attn_q_norm.weight"), &[8], GgmlType::F32, 130 + l);
            w.random_tensor(&t("attn_k_norm.weight"), &[8], GgmlType::F32, 140 + l);
        }
        w.random_tensor(&t("attn_output.weight"), &[q, h], GgmlType::BF16, 80 + l);
        w.random_tensor(&t("ffn_norm.weight"), &[h], GgmlType::F32, 90 + l);
        w.random_tensor(&t("ffn_gate.weight"), &[h, ffn], GgmlType::Q8_0, 100 + l);
        w.random_tensor(&t("ffn_up.weight"), &[h, ffn], GgmlType::Q4_1, 110 + l);
        let down = if l == 0 {
            GgmlType::Q4_K
        } else {
            GgmlType::Q6_K
        };
        w.random_tensor(&t("ffn_down.weight"), &[ffn, h], down, 120 + l);
    }
    w.random_tensor("output_norm.weight", &[h], GgmlType::F32, 200);
    if !tied {
        w.random_tensor("output.weight", &[h, vocab], GgmlType::Q4_0, 201);
    }
    w
}

impl GgufWriter {
    /// A small SentencePiece vocabulary of [`TEST_VOCAB`] tokens (`tokenizer.ggml.model`
    /// `llama`): `<unk>` (unknown), `<s>` / `</s>` (control, bos / eos), the 256 byte tokens
    /// `<0xNN>`, and pieces whose scores rank the merges `l l` > `▁ h` > `▁h e`.
    pub fn spm_tokenizer(&mut self) -> &mut Self {
        let pieces = [
            ("\u{2581}", -10.0),
            ("h", -11.0),
            ("e", -12.0),
            ("l", -13.0),
            ("ll", -1.0),
            ("\u{2581}h", -2.0),
            ("\u{2581}he", -3.0),
        ];
        assert_eq!(3 + 256 + pieces.len(), TEST_VOCAB);
        self.spm_vocabulary(&pieces)
    }

    /// A SentencePiece vocabulary (`tokenizer.ggml.model` `llama`): `<unk>` (unknown),
    /// `<s>` / `</s>` (control, bos / eos), the 256 byte tokens `<0xNN>`, then `pieces`
    /// (normal, with their scores).
    pub fn spm_vocabulary(&mut self, pieces: &[(&str, f32)]) -> &mut Self {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        let mut types = vec![2, 3, 3];
        let mut scores = vec![0f32; 3];
        for b in 0..256 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for &(p, sc) in pieces {
            tokens.push(p.into());
            types.push(1);
            scores.push(sc);
        }
        self.kv("tokenizer.ggml.model", s("llama"));
        self.kv(
            "tokenizer.ggml.tokens",
            strs(tokens.iter().map(String::as_str)),
        );
        self.kv(
            "tokenizer.ggml.scores",
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        );
        self.kv(
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        );
        self.kv("tokenizer.ggml.bos_token_id", Value::U32(1));
        self.kv("tokenizer.ggml.eos_token_id", Value::U32(2));
        self.kv("tokenizer.ggml.unknown_token_id", Value::U32(0));
        self
    }
}

/// A tiny `gpt2` model as llama.cpp's converter lays it out: 2 layers, width 32, 4 heads,
/// MLP 128, context 64, the test vocabulary; fused `attn_qkv`, Conv1D weights `[out, in]`
/// (dims `[in, out]`) of several types, F32 norms, biases and position embedding; the head
/// tied.
pub fn tiny_gpt2() -> GgufWriter {
    let (c, ffn, ctx, vocab) = (32u64, 128u64, 64u64, TEST_VOCAB as u64);
    let mut w = GgufWriter::new(3);
    w.kv("general.architecture", s("gpt2"));
    w.kv("gpt2.block_count", Value::U32(2));
    w.kv("gpt2.context_length", Value::U32(ctx as u32));
    w.kv("gpt2.embedding_length", Value::U32(c as u32));
    w.kv("gpt2.feed_forward_length", Value::U32(ffn as u32));
    w.kv("gpt2.attention.head_count", Value::U32(4));
    w.kv("gpt2.attention.layer_norm_epsilon", Value::F32(1e-5));
    w.tokenizer(Some("gpt-2"), false);
    w.random_tensor("token_embd.weight", &[c, vocab], GgmlType::F16, 1);
    w.random_tensor("position_embd.weight", &[c, ctx], GgmlType::F32, 2);
    for l in 0..2u64 {
        let t = |n: &str| format!("blk.{l}.{n}");
        w.random_tensor(&t("attn_norm.weight"), &[c], GgmlType::F32, 10 + l);
        w.random_tensor(&t("attn_norm.bias"), &[c], GgmlType::F32, 12 + l);
        w.random_tensor(&t("attn_qkv.weight"), &[c, 3 * c], GgmlType::Q8_0, 20 + l);
        w.random_tensor(&t("attn_qkv.bias"), &[3 * c], GgmlType::F32, 22 + l);
        w.random_tensor(&t("attn_output.weight"), &[c, c], GgmlType::F32, 30 + l);
        w.random_tensor(&t("attn_output.bias"), &[c], GgmlType::F32, 32 + l);
        w.random_tensor(&t("ffn_norm.weight"), &[c], GgmlType::F32, 40 + l);
        w.random_tensor(&t("ffn_norm.bias"), &[c], GgmlType::F32, 42 + l);
        w.random_tensor(&t("ffn_up.weight"), &[c, ffn], GgmlType::Q4_1, 50 + l);
        w.random_tensor(&t("ffn_up.bias"), &[ffn], GgmlType::F32, 52 + l);
        w.random_tensor(&t("ffn_down.weight"), &[ffn, c], GgmlType::BF16, 60 + l);
        w.random_tensor(&t("ffn_down.bias"), &[c], GgmlType::F32, 62 + l);
    }
    w.random_tensor("output_norm.weight", &[c], GgmlType::F32, 70);
    w.random_tensor("output_norm.bias", &[c], GgmlType::F32, 71);
    w
}

/// Runs `scripts/gguf_py.py ARGS` with the python that `MEMWALL_GGUF_PY` names (`.ci/run`
/// sets it to a venv with the `gguf` package). Panics, saying what to do, when the variable
/// is unset, the python cannot be started, or the script fails (gguf or numpy missing
/// included): the tests that call it are ignored unless that python is there.
pub fn gguf_py(args: &[&std::ffi::OsStr]) {
    let py = std::env::var_os("MEMWALL_GGUF_PY").expect(
        "set MEMWALL_GGUF_PY to a python with the gguf and numpy packages (.ci/run makes \
         target/pyenv: python3 -m venv target/pyenv && target/pyenv/bin/pip install gguf numpy)",
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gguf_py.py");
    let out = std::process::Command::new(&py)
        .arg(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("MEMWALL_GGUF_PY={}: cannot run it: {e}", py.display()));
    assert!(
        out.status.success(),
        "{} {script} {args:?} failed ({}): {}",
        py.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
