//! `memwall convert FILE.gguf --out DIR`: a GGUF file as a Hugging Face model directory.
//!
//! Everything that can be checked is checked before a byte is written: the architecture and
//! its dimensions, every tensor's name, shape and type (all must be decodable), the
//! tokenizer (loaded in the `tokenizers` crate). The files are then written into a temporary
//! sibling `<DIR>.tmp-<pid>-<n>`, fsynced, and the directory is renamed to DIR, so an error or
//! a crash never leaves a half-written model under DIR. An existing non-empty DIR is refused
//! unless `force` is set, and even then replaced only when it is an earlier conversion
//! (`util::owned_dir`: its marker, and only the files a conversion writes), never when it
//! holds the input or anything else.
//!
//! Beside `tokenizer.json`, the source's own `tokenizer.*` keys are kept in
//! `tokenizer.gguf` ([`super::sidecar`]), so that `export` can write them back unchanged.
//!
//! `model.safetensors` is written by the `safetensors` crate from views that dequantize one
//! tensor at a time when the writer asks for its bytes, so memory holds one tensor at a time
//! (plus the map of the GGUF file), whatever the model's size. Each tensor is checked as it
//! is dequantized: a NaN or infinite value (a corrupt block scale) fails the conversion,
//! naming the tensor and the file, and nothing is published.

use super::file::GgufFile;
use super::hf::{Dims, HfModel, HfTensor, map_model, unpermute_rows};
use super::tokenizer;
use crate::dtype::dequant::{check_supported, dequantize};
use crate::util::atomic::write_synced;
use crate::util::atomic_dir::TempDir;
use crate::util::finite::{self, first_non_finite};
use anyhow::{Context, Result, bail};
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;

/// The files a converted directory holds.
pub const CONFIG_FILE: &str = "config.json";
pub const MODEL_FILE: &str = "model.safetensors";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Whether `name` is a file a conversion writes (what `--force` may replace).
pub(crate) fn written_by_convert(name: &str) -> bool {
    [
        CONFIG_FILE,
        MODEL_FILE,
        TOKENIZER_FILE,
        TOKENIZER_CONFIG_FILE,
        crate::ckpt::TOKENIZER_GGUF_FILE,
    ]
    .contains(&name)
}

/// GGUF files at least this large get a progress bar (when asked for one).
const PROGRESS_MIN_BYTES: u64 = 64 << 20;

/// The dtype of the written weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDtype {
    /// The dequantized values exactly.
    F32,
    /// Rounded to nearest even bfloat16 (half the size).
    Bf16,
}

impl OutDtype {
    /// transformers' name (`config.json` `torch_dtype`).
    pub fn torch_dtype(self) -> &'static str {
        match self {
            OutDtype::F32 => "float32",
            OutDtype::Bf16 => "bfloat16",
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            OutDtype::F32 => Dtype::F32,
            OutDtype::Bf16 => Dtype::BF16,
        }
    }

    fn size(self) -> usize {
        match self {
            OutDtype::F32 => 4,
            OutDtype::Bf16 => 2,
        }
    }
}

impl FromStr for OutDtype {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<OutDtype> {
        match s {
            "f32" | "fp32" | "float32" => Ok(OutDtype::F32),
            "bf16" | "bfloat16" => Ok(OutDtype::Bf16),
            _ => bail!("--dtype {s:?} is not supported: use f32 (exact) or bf16"),
        }
    }
}

/// What to convert and where.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub input: PathBuf,
    pub out: PathBuf,
    pub dtype: OutDtype,
    /// Replace an existing non-empty output directory, when it is an earlier conversion.
    pub force: bool,
    /// Show a progress bar on stderr for large files.
    pub progress: bool,
}

/// What a conversion wrote.
#[derive(Clone, Debug)]
pub struct ConvertSummary {
    pub out: PathBuf,
    pub architecture: String,
    pub hf_class: String,
    pub dims: Dims,
    pub tied: bool,
    pub parameters: u64,
    pub tensors: usize,
    /// GGUF tensor types seen, with how many tensors had each.
    pub tensor_types: BTreeMap<String, usize>,
    pub dtype: OutDtype,
    pub tokenizer: String,
    /// Files written with their sizes in bytes.
    pub files: Vec<(String, u64)>,
}

impl ConvertSummary {
    /// Bytes written in all.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.1).sum()
    }

    /// A few lines for the terminal.
    pub fn describe(&self) -> String {
        let d = &self.dims;
        let types: Vec<String> = self
            .tensor_types
            .iter()
            .map(|(t, n)| format!("{t} ×{n}"))
            .collect();
        let theta = if d.rope_theta > 0.0 {
            format!(", θ {}", d.rope_theta)
        } else {
            String::new()
        };
        let mut s = format!(
            "{} ({}): {} layers, width {}, {} heads ({} KV, head size {}), MLP {}, vocabulary {}, context {}{}, eps {}, {}\n",
            self.architecture,
            self.hf_class,
            d.layers,
            d.hidden,
            d.heads,
            d.kv_heads,
            d.head_dim,
            d.ffn,
            d.vocab,
            d.context,
            theta,
            d.rms_eps,
            if self.tied {
                "tied head"
            } else {
                "separate head"
            }
        );
        s += &format!(
            "{} parameters in {} tensors; GGUF types {} -> {}\n",
            self.parameters,
            self.tensors,
            types.join(", "),
            self.dtype.torch_dtype()
        );
        s += &format!("tokenizer: {}\n", self.tokenizer);
        for (f, n) in &self.files {
            s += &format!("  {f} ({})\n", crate::util::bytes::fmt_bytes(*n));
        }
        s += &format!(
            "wrote {} to {}",
            crate::util::bytes::fmt_bytes(self.total_bytes()),
            self.out.display()
        );
        s
    }
}

/// Converts `o.input` into a HF directory at `o.out` (see the module doc).
pub fn convert(o: &ConvertOptions) -> Result<ConvertSummary> {
    check_input(&o.input)?;
    check_out_dir(&o.input, &o.out, o.force)?;
    let f = GgufFile::open(&o.input)?;
    let path = f.path().display().to_string();
    let model = map_model(&f)?;
    let tok = tokenizer::from_gguf(&f, model.dims.context)?;
    let tok_text = serde_json::to_string(&tok.tokenizer_json)?;
    let loaded = tokenizer::load(&tok_text).with_context(|| format!("{path}: tokenizer"))?;
    if loaded.get_vocab_size(true) != model.dims.vocab {
        bail!(
            "{path}: the tokenizer has {} distinct tokens but the embedding has {} rows (duplicate tokens in tokenizer.ggml.tokens?)",
            loaded.get_vocab_size(true),
            model.dims.vocab
        );
    }
    let mut tensor_types = BTreeMap::new();
    for t in &f.tensors {
        check_supported(t.ty).with_context(|| format!("{path}: tensor {}", t.name))?;
        *tensor_types.entry(t.ty.name.to_string()).or_insert(0) += 1;
    }

    let tmp = TempDir::create_for(&o.out)?;
    let json = |v: &serde_json::Value| -> Result<Vec<u8>> {
        let mut b = serde_json::to_vec_pretty(v)?;
        b.push(b'\n');
        Ok(b)
    };
    let mut files = Vec::new();
    let mut put = |name: &str, bytes: &[u8]| -> Result<()> {
        write_synced(&tmp.path.join(name), |w| Ok(w.write_all(bytes)?))?;
        files.push((name.to_string(), bytes.len() as u64));
        Ok(())
    };
    put(
        CONFIG_FILE,
        &json(&model.config_json(o.dtype.torch_dtype()))?,
    )?;
    put(TOKENIZER_FILE, tok_text.as_bytes())?;
    put(TOKENIZER_CONFIG_FILE, &json(&tok.tokenizer_config)?)?;
    let n = super::sidecar::write(&super::sidecar::tokenizer_keys(&f), &tmp.path)?;
    files.push((crate::ckpt::TOKENIZER_GGUF_FILE.to_string(), n));
    let st = tmp.path.join(MODEL_FILE);
    write_model(&f, &model, o.dtype, &st, o.progress)?;
    // The safetensors crate creates its file 0600 (a tempfile); give it the permissions the
    // other files got from the umask.
    let perms = fs::metadata(tmp.path.join(CONFIG_FILE))
        .with_context(|| format!("cannot stat {}", tmp.path.display()))?
        .permissions();
    fs::set_permissions(&st, perms)
        .with_context(|| format!("cannot set the permissions of {}", st.display()))?;
    let st_len = fs::metadata(&st)
        .with_context(|| format!("cannot stat {}", st.display()))?
        .len();
    fs::File::open(&st)
        .and_then(|h| h.sync_all())
        .with_context(|| format!("cannot fsync {}", st.display()))?;
    files.push((MODEL_FILE.to_string(), st_len));
    crate::util::owned_dir::mark(&tmp.path, "memwall convert")?;
    // Checked again: the directory may have changed while the model was written.
    check_out_dir(&o.input, &o.out, o.force)?;
    tmp.publish(&o.out)?;

    Ok(ConvertSummary {
        out: o.out.clone(),
        architecture: model.arch.name().to_string(),
        hf_class: model.arch.hf_class().to_string(),
        dims: model.dims.clone(),
        tied: model.tied,
        parameters: model.parameter_count(),
        tensors: model.tensors.len(),
        tensor_types,
        dtype: o.dtype,
        tokenizer: format!(
            "{} BPE, pre-tokenizer {}, {} tokens",
            tok.model, tok.pre, tok.vocab_size
        ),
        files,
    })
}

/// Refuses an input that is a directory (mapping one fails with a bare "No such device"),
/// saying so when it already is a Hugging Face model directory.
fn check_input(input: &Path) -> Result<()> {
    if !input.is_dir() {
        return Ok(());
    }
    let p = input.display();
    if input.join(CONFIG_FILE).is_file() {
        bail!(
            "{p} is a directory holding a Hugging Face model (config.json) already: there is \
             nothing to convert, use it as it is (`memwall sample --model {p}`, `memwall train \
             --init {p}`); `memwall convert` takes a GGUF file (FILE.gguf)"
        );
    }
    bail!("{p} is a directory: `memwall convert` takes a GGUF file (FILE.gguf)");
}

/// Refuses an output path that is a file, that holds the input, or a non-empty directory
/// unless `force` is set and it is an earlier conversion (nothing else in it).
fn check_out_dir(input: &Path, out: &Path, force: bool) -> Result<()> {
    if out.file_name().is_none() {
        bail!("--out {} does not name a directory", out.display());
    }
    let what = format!("--out {}", out.display());
    match fs::metadata(out) {
        Err(_) => Ok(()),
        Ok(m) if !m.is_dir() => bail!("{what} exists and is not a directory; choose another path"),
        Ok(_) => {
            // The input inside the output directory would be replaced with it.
            if let (Ok(i), Ok(o)) = (fs::canonicalize(input), fs::canonicalize(out))
                && i.starts_with(&o)
            {
                bail!(
                    "{what} holds the input {}; write the conversion to another directory",
                    input.display()
                );
            }
            let non_empty = fs::read_dir(out)
                .with_context(|| format!("cannot list {what}"))?
                .next()
                .is_some();
            if non_empty && !force {
                bail!(
                    "{what} exists and is not empty; pass --force to replace an earlier conversion, or choose another directory"
                );
            }
            crate::util::owned_dir::check_replaceable(out, &what, &written_by_convert, vec![])
        }
    }
}

/// Writes `model.safetensors` at `path`: every tensor under its HF name and shape.
fn write_model(
    f: &GgufFile,
    model: &HfModel,
    dtype: OutDtype,
    path: &Path,
    progress: bool,
) -> Result<()> {
    let bar = if progress && f.len() >= PROGRESS_MIN_BYTES {
        let b = indicatif::ProgressBar::with_draw_target(
            Some(model.tensors.len() as u64),
            indicatif::ProgressDrawTarget::stderr(),
        );
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} tensors {msg} eta {eta}")
                .expect("valid template"),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let error = Mutex::new(None);
    let views: Vec<(&str, LazyTensor)> = model
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                LazyTensor {
                    file: f,
                    t,
                    dtype,
                    bar: &bar,
                    error: &error,
                },
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let written = safetensors::serialize_to_file(views, Some(meta), path);
    bar.finish_and_clear();
    if let Some(e) = error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    written.map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))
}

/// A tensor whose bytes are produced (dequantized, un-permuted, converted) only when the
/// safetensors writer asks for them. A failure is kept in `error` (a `View` cannot return
/// one) and turns the remaining tensors into no-ops; [`write_model`] reports it.
struct LazyTensor<'a> {
    file: &'a GgufFile,
    t: &'a HfTensor,
    dtype: OutDtype,
    bar: &'a indicatif::ProgressBar,
    error: &'a Mutex<Option<anyhow::Error>>,
}

/// The f32 values of the GGUF tensor behind `t`, in Hugging Face order and shape
/// (dequantized, Q/K rows un-permuted, GPT-2's Conv1D weights transposed, Gemma 3's norms
/// minus the 1 the file adds: [`HfTensor::shift`]), each checked finite: what `convert`
/// writes and what `export` reads from a GGUF file in place.
pub fn hf_values(file: &GgufFile, t: &HfTensor) -> Result<Vec<f32>> {
    let info = file
        .tensor(&t.gguf)
        .context("tensor listed but not in the file")?;
    let n = info.n_elements as usize;
    let mut vals = vec![0f32; n]; // [HF shape], row-major
    dequantize(info.ty, file.tensor_data(info), &mut vals)?;
    if let Some((i, v)) = first_non_finite(&vals) {
        // GGUF order, so the index is the element's in the file.
        bail!(
            "{}: the file is corrupt (a NaN or infinite block scale?) and NaN or infinite \
             weights cannot be trained or sampled; re-download or re-quantize it",
            finite::describe(i, v, n, &vals)
        );
    }
    if let Some(heads) = t.unpermute_heads {
        let cols = if t.shape.len() == 2 { t.shape[1] } else { 1 };
        let mut hf = vec![0f32; n]; // [rows, cols] in HF row order
        unpermute_rows(&vals, &mut hf, heads, cols)?;
        vals = hf;
    }
    if t.transpose {
        // GGUF [out, in] row-major → HF [in, out] (the HF shape).
        let (ins, outs) = (t.shape[0], t.shape[1]);
        let mut hf = vec![0f32; n];
        for (o, row) in vals.chunks_exact(ins).enumerate() {
            for (i, &v) in row.iter().enumerate() {
                hf[i * outs + o] = v;
            }
        }
        vals = hf;
    }
    if t.shift != 0.0 {
        vals.iter_mut().for_each(|v| *v -= t.shift);
    }
    Ok(vals)
}

impl LazyTensor<'_> {
    fn produce(&self) -> Result<Vec<u8>> {
        let vals = hf_values(self.file, self.t)?;
        Ok(match self.dtype {
            OutDtype::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            OutDtype::Bf16 => {
                let b: Vec<half::bf16> = vals.iter().map(|&v| half::bf16::from_f32(v)).collect();
                // Finite f32 values beyond bf16's largest round to infinity.
                if let Some(i) = b.iter().position(|x| x.is_infinite()) {
                    bail!(
                        "value {} at element {i} does not fit in bf16 (it rounds to infinity); convert with --dtype f32",
                        vals[i]
                    );
                }
                b.iter().flat_map(|x| x.to_le_bytes()).collect()
            }
        })
    }
}

impl View for LazyTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype.safetensors()
    }

    fn shape(&self) -> &[usize] {
        &self.t.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if self
            .error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
        {
            return Cow::Owned(Vec::new());
        }
        self.bar.set_message(self.t.gguf.clone());
        let out = self.produce().with_context(|| {
            format!(
                "{}: tensor {} ({})",
                self.file.path().display(),
                self.t.gguf,
                self.t.name
            )
        });
        self.bar.inc(1);
        match out {
            Ok(b) => Cow::Owned(b),
            Err(e) => {
                *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                Cow::Owned(Vec::new())
            }
        }
    }

    fn data_len(&self) -> usize {
        self.t.shape.iter().product::<usize>() * self.dtype.size()
    }
}

#[cfg(test)]
mod gemma3_tests;
#[cfg(test)]
mod tests;
