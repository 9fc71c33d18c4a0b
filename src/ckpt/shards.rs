//! Sharded weights as Hugging Face writes them: `model-00001-of-00004.safetensors` ... and
//! `model.safetensors.index.json`, `{"metadata": {"total_size": BYTES}, "weight_map":
//! {"<tensor name>": "<shard file name>", ...}}`.
//!
//! Writing follows transformers' `save_pretrained` (default `max_shard_size="5GB"`): one
//! `model.safetensors` and no index while the tensors' bytes total at most the limit; else
//! tensors in layout order, a new shard when the next tensor would take the current one past
//! the limit, a tensor larger than the limit in a shard of its own, shards named
//! `model-{k:05}-of-{n:05}.safetensors` from k = 1, and an index whose `total_size` is the sum
//! of the tensors' data bytes (headers not counted) and whose `weight_map` is sorted by name.
//!
//! Reading opens (memory-maps) every shard the index names and checks them all against the
//! index before anything is copied: a missing shard, a tensor the map names that its shard
//! lacks, and a tensor a shard holds that the map does not name (unless it is a known
//! non-parameter) are errors naming the index and the shard. The tensors then load as from
//! one file ([`Sources`]).

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::safetensors_io::{OutTensor, Resolved, Sources, StFile, list, write_safetensors};
use super::{MODEL_FILE, MODEL_INDEX_FILE};

/// The shard size limit by default: transformers' `max_shard_size="5GB"` (decimal gigabytes).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The name of shard `k` (from 1) of `n`: `model-00001-of-00004.safetensors`.
pub(crate) fn shard_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// Whether `name` has the form of a shard name (`model-NNNNN-of-NNNNN.safetensors`).
pub(crate) fn is_shard_name(name: &str) -> bool {
    let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
    name.strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
        .and_then(|r| r.split_once("-of-"))
        .is_some_and(|(k, n)| digits(k) && digits(n))
}

/// Cuts tensors of byte sizes `sizes` (in order) into consecutive shards of at most `max`
/// bytes each: a new shard starts when the next tensor would take the current one past
/// `max`; a tensor larger than `max` gets a shard of its own.
pub(crate) fn plan_shards(sizes: &[u64], max: u64) -> Vec<Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && bytes + s > max {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += s;
    }
    if start < sizes.len() {
        shards.push(start..sizes.len());
    }
    shards
}

/// One file of a model's weights, to be written by the caller (atomically, its own way).
pub(crate) enum WeightsFile<'t, 'a> {
    /// A safetensors file holding these tensors (all of them, or one shard).
    Tensors(&'t [OutTensor<'a>]),
    /// The index of a sharded checkpoint (JSON bytes).
    Index(Vec<u8>),
}

impl WeightsFile<'_, '_> {
    /// Streams the file's content into `f`.
    pub fn write_to(&self, f: &mut File) -> Result<()> {
        match self {
            WeightsFile::Tensors(t) => write_safetensors(f, t),
            WeightsFile::Index(bytes) => Ok(std::io::Write::write_all(f, bytes)?),
        }
    }
}

/// The index file as transformers writes it (keys sorted, two-space indent).
#[derive(Serialize)]
struct IndexOut<'a> {
    metadata: IndexMeta,
    weight_map: BTreeMap<&'a str, String>,
}

#[derive(Serialize)]
struct IndexMeta {
    total_size: u64,
}

/// The files that hold `tensors` (in this order, the index last): `model.safetensors` when
/// their bytes total at most `max_shard_bytes`, else shards and `model.safetensors.index.json`.
pub(crate) fn weight_files<'t, 'a>(
    tensors: &'t [OutTensor<'a>],
    max_shard_bytes: u64,
) -> Result<Vec<(String, WeightsFile<'t, 'a>)>> {
    let sizes: Vec<u64> = tensors.iter().map(OutTensor::nbytes).collect();
    let total_size: u64 = sizes.iter().sum();
    if total_size <= max_shard_bytes {
        return Ok(vec![(
            MODEL_FILE.to_string(),
            WeightsFile::Tensors(tensors),
        )]);
    }
    let shards = plan_shards(&sizes, max_shard_bytes);
    let n = shards.len();
    let mut files = Vec::with_capacity(n + 1);
    let mut weight_map = BTreeMap::new();
    for (k, range) in shards.into_iter().enumerate() {
        let name = shard_name(k + 1, n);
        for t in &tensors[range.clone()] {
            weight_map.insert(t.name.as_str(), name.clone());
        }
        files.push((name, WeightsFile::Tensors(&tensors[range])));
    }
    let index = IndexOut {
        metadata: IndexMeta { total_size },
        weight_map,
    };
    let mut json = serde_json::to_vec_pretty(&index)?;
    json.push(b'\n');
    files.push((MODEL_INDEX_FILE.to_string(), WeightsFile::Index(json)));
    Ok(files)
}

/// Reads an index's `weight_map`: (tensor name, shard file name) sorted by tensor name.
/// Errors name the file: unreadable, not JSON, no `weight_map` object, a value that is not
/// a plain file name, an empty map.
pub(crate) fn read_index(path: &Path) -> Result<Vec<(String, String)>> {
    let p = path.display();
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {p}"))?;
    let v: Value = serde_json::from_str(&text).with_context(|| {
        format!("{p}: not valid JSON; the index is corrupt, re-download or re-save the model")
    })?;
    let Some(map) = v.get("weight_map").and_then(Value::as_object) else {
        bail!(
            "{p}: no 'weight_map' object (a sharded model's index is {{\"metadata\": \
             {{\"total_size\": BYTES}}, \"weight_map\": {{\"tensor name\": \"shard file\", ...}}}}); \
             re-download or re-save the model"
        );
    };
    if map.is_empty() {
        bail!("{p}: 'weight_map' is empty; re-download or re-save the model");
    }
    let mut out = Vec::with_capacity(map.len());
    for (name, file) in map {
        let Some(file) = file.as_str() else {
            bail!("{p}: weight_map entry '{name}' is {file}, expected a shard file name");
        };
        if Path::new(file).file_name().and_then(|f| f.to_str()) != Some(file) {
            bail!(
                "{p}: weight_map maps '{name}' to '{file}', which is not a file name in the \
                 index's directory"
            );
        }
        out.push((name.clone(), file.to_string()));
    }
    out.sort_unstable();
    Ok(out)
}

/// The shards of a sharded checkpoint, opened and checked against their index.
pub(crate) struct Sharded {
    pub index_path: PathBuf,
    /// The shards, sorted by file name.
    files: Vec<StFile>,
    /// Tensor name → index into `files`, as the weight map says.
    map: Vec<(String, usize)>,
}

impl Sharded {
    /// Reads `dir/model.safetensors.index.json` and memory-maps every shard it names. Errors
    /// (all naming the index): a shard missing or corrupt (naming the shard too), tensors
    /// the map places in a shard that lacks them, tensors in a shard that the map does not
    /// place there unless `resolve` ignores them (known non-parameters, tied names).
    pub fn open(dir: &Path, resolve: &dyn Fn(&str) -> Resolved) -> Result<Sharded> {
        let index_path = dir.join(MODEL_INDEX_FILE);
        let ip = index_path.display();
        let weight_map = read_index(&index_path)?;
        let mut names: Vec<&str> = weight_map.iter().map(|(_, f)| f.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        let mut files = Vec::with_capacity(names.len());
        for name in &names {
            let path = dir.join(name);
            if !path.exists() {
                bail!(
                    "{ip}: names shard {name}, but {} does not exist; the download is \
                     incomplete: fetch every shard the index lists",
                    path.display()
                );
            }
            files.push(StFile::open(&path).with_context(|| format!("{ip} names shard {name}"))?);
        }
        let slot: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let map: Vec<(String, usize)> = weight_map
            .iter()
            .map(|(t, f)| (t.clone(), slot[f.as_str()]))
            .collect();
        let lacking: Vec<String> = map
            .iter()
            .filter(|(t, i)| files[*i].info(t).is_none())
            .map(|(t, i)| format!("{t} (mapped to {})", names[*i]))
            .collect();
        if !lacking.is_empty() {
            bail!(
                "{ip}: {} tensor(s) the weight_map names are not in their shard: {}; the index \
                 does not match its shards: re-download them",
                lacking.len(),
                list(&lacking)
            );
        }
        let mapped: HashMap<&str, usize> = map.iter().map(|(t, i)| (t.as_str(), *i)).collect();
        let mut unlisted = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let mut held: Vec<&str> = f.names().collect();
            held.sort_unstable();
            for t in held {
                if mapped.get(t) == Some(&i) || matches!(resolve(t), Resolved::Ignore) {
                    continue;
                }
                unlisted.push(match mapped.get(t) {
                    Some(&j) => format!("{t} (in {}; the map names {})", names[i], names[j]),
                    None => format!("{t} (in {})", names[i]),
                });
            }
        }
        if !unlisted.is_empty() {
            bail!(
                "{ip}: {} tensor(s) in the shards are not in the weight_map: {}; the index does \
                 not match its shards: re-download them",
                unlisted.len(),
                list(&unlisted)
            );
        }
        Ok(Sharded {
            index_path,
            files,
            map,
        })
    }

    /// The tensors the weight map names, each in its shard.
    pub fn sources(&self) -> Sources<'_> {
        let at = self
            .map
            .iter()
            .map(|(t, i)| (t.as_str(), &self.files[*i]))
            .collect();
        Sources::sharded(self.index_path.display().to_string(), at)
    }
}

/// What the weights of directory `dir` lack to be complete (empty when complete), by the rule
/// the loader follows: `model.safetensors` when present (it must not be empty), else the index
/// and every shard it names (none empty).
pub(crate) fn weights_missing(dir: &Path) -> Vec<String> {
    let nonempty = |name: &str| std::fs::metadata(dir.join(name)).is_ok_and(|m| m.len() > 0);
    let single = dir.join(MODEL_FILE);
    if single.exists() || !dir.join(MODEL_INDEX_FILE).exists() {
        return if nonempty(MODEL_FILE) && single.is_file() {
            Vec::new()
        } else {
            vec![format!(
                "{MODEL_FILE} (or {MODEL_INDEX_FILE} and its shards)"
            )]
        };
    }
    match read_index(&dir.join(MODEL_INDEX_FILE)) {
        Err(_) => vec![format!("a readable {MODEL_INDEX_FILE}")],
        Ok(map) => {
            let mut shards: Vec<&str> = map.iter().map(|(_, f)| f.as_str()).collect();
            shards.sort_unstable();
            shards.dedup();
            shards
                .into_iter()
                .filter(|f| !nonempty(f))
                .map(|f| format!("{f} (named by {MODEL_INDEX_FILE})"))
                .collect()
        }
    }
}
