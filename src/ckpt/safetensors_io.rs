//! The safetensors format, both ways, without whole-file copies.
//!
//! A safetensors file is: `u64` little-endian header length `N`; `N` bytes of JSON
//! (`{"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//! "__metadata__": {"format": "pt"}}`, padded with spaces to a multiple of 8); then the raw
//! little-endian tensor data, offsets counted from the end of the header.
//!
//! Writing streams each tensor from its flat array through one small staging buffer
//! ([`STAGE_BYTES`]), so saving a 500 MB model allocates about a megabyte. An array is
//! borrowed whole ([`Whole`]) or lent piece by piece ([`Lend`]): offloaded parameters and
//! moments are read one parameter group at a time while they are written.
//!
//! Reading memory-maps the file, validates the header with the `safetensors` crate (offsets
//! contiguous, sizes consistent with dtype and shape, file length exact: a truncated or
//! padded file is rejected), then copies tensor by tensor into the destination slices,
//! converting F16/BF16 to f32, and drops each tensor's pages from the mapping after the copy,
//! so the mapped file never stays resident next to its destination buffer. Each block copied
//! is checked for NaN and infinite values, refused naming the tensor and file. The tensors of a
//! sharded checkpoint are read the same way from the shard that holds each ([`Sources`]), and
//! a tensor-parallel rank's part of a tensor as its runs of the whole one ([`Target::part`]).

use crate::util::finite::{self, first_non_finite};
use anyhow::{Context, Result, anyhow, bail};
use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Size of the staging buffer used to convert f32 to little-endian bytes while writing.
pub(crate) const STAGE_BYTES: usize = 1 << 20;

/// Most names listed in one error message.
const LIST_MAX: usize = 12;

/// One tensor to write: name, shape, and elements `range` of the flat array `from`.
pub(crate) struct OutTensor<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub from: &'a dyn Lend,
    pub range: Range<usize>,
}

impl OutTensor<'_> {
    /// Bytes of the data (what `total_size` of a sharded index counts).
    pub(crate) fn nbytes(&self) -> u64 {
        (self.from.width() * self.range.len()) as u64
    }
}

/// A flat array of one element type that the writer reads piece by piece, in order: a slice
/// borrowed whole ([`Whole`]), or state that lives elsewhere (the executor's parameters and
/// moments, kept per parameter group on the disk tier and read one group at a time), so
/// that writing it never needs a host copy of the whole array.
pub(crate) trait Lend {
    /// The element type, as the (empty) piece of that type: [`OutData::F32`] of `&[]`, ...
    fn elem(&self) -> OutData<'static>;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Calls `put` with elements `range`, in order, as consecutive pieces of the type of
    /// [`Lend::elem`]; stops at the first error, `put`'s or its own (naming what could not
    /// be read).
    fn lend(
        &self,
        range: Range<usize>,
        put: &mut dyn FnMut(OutData<'_>) -> Result<()>,
    ) -> Result<()>;

    /// Bytes per element.
    fn width(&self) -> usize {
        self.elem().dtype().0
    }
}

/// A slice lent whole (in place, no copy).
#[derive(Clone, Copy)]
pub(crate) struct Whole<'a>(pub OutData<'a>);

impl Lend for Whole<'_> {
    fn elem(&self) -> OutData<'static> {
        self.0.kind()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn lend(
        &self,
        range: Range<usize>,
        put: &mut dyn FnMut(OutData<'_>) -> Result<()>,
    ) -> Result<()> {
        if range.end > self.0.len() {
            bail!(
                "internal error: elements {range:?} of an array of {}",
                self.0.len()
            );
        }
        put(self.0.slice(range))
    }
}

/// Tensor data in one of the element types memwall writes.
#[derive(Clone, Copy)]
pub(crate) enum OutData<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    I8(&'a [i8]),
    U8(&'a [u8]),
}

impl<'a> OutData<'a> {
    pub(crate) fn len(&self) -> usize {
        match self {
            OutData::F32(x) => x.len(),
            OutData::Bf16(x) => x.len(),
            OutData::I8(x) => x.len(),
            OutData::U8(x) => x.len(),
        }
    }

    /// Bytes per element and the safetensors dtype name.
    pub(crate) fn dtype(&self) -> (usize, &'static str) {
        match self {
            OutData::F32(_) => (4, "F32"),
            OutData::Bf16(_) => (2, "BF16"),
            OutData::I8(_) => (1, "I8"),
            OutData::U8(_) => (1, "U8"),
        }
    }

    /// The empty piece of this element type (what [`Lend::elem`] returns).
    pub(crate) fn kind(&self) -> OutData<'static> {
        match self {
            OutData::F32(_) => OutData::F32(&[]),
            OutData::Bf16(_) => OutData::Bf16(&[]),
            OutData::I8(_) => OutData::I8(&[]),
            OutData::U8(_) => OutData::U8(&[]),
        }
    }

    /// Elements `range`.
    pub(crate) fn slice(&self, range: Range<usize>) -> OutData<'a> {
        match *self {
            OutData::F32(x) => OutData::F32(&x[range]),
            OutData::Bf16(x) => OutData::Bf16(&x[range]),
            OutData::I8(x) => OutData::I8(&x[range]),
            OutData::U8(x) => OutData::U8(&x[range]),
        }
    }

    /// Appends elements `range` as little-endian bytes to `out`.
    fn put(&self, range: Range<usize>, out: &mut Vec<u8>) {
        match self {
            OutData::F32(x) => x[range].iter().for_each(|v| out.extend(v.to_le_bytes())),
            OutData::Bf16(x) => x[range].iter().for_each(|v| out.extend(v.to_le_bytes())),
            OutData::I8(x) => x[range].iter().for_each(|v| out.extend(v.to_le_bytes())),
            OutData::U8(x) => out.extend_from_slice(&x[range]),
        }
    }
}

/// The JSON header (without its length prefix), padded with spaces to a multiple of 8 bytes
/// so that the data section starts 8-byte aligned. Tensors are laid out in the given order.
pub(crate) fn header_bytes(tensors: &[OutTensor]) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0usize;
    for t in tensors {
        let n: usize = t.shape.iter().product();
        if n != t.range.len() || t.range.end > t.from.len() {
            bail!(
                "tensor {}: shape {:?} has {n} elements but it is given elements {:?} of an \
                 array of {}",
                t.name,
                t.shape,
                t.range,
                t.from.len()
            );
        }
        let (width, dtype) = t.from.elem().dtype();
        let end = offset + width * n;
        let info = json!({ "dtype": dtype, "shape": t.shape, "data_offsets": [offset, end] });
        if map.insert(t.name.clone(), info).is_some() {
            bail!("tensor name {} appears twice", t.name);
        }
        offset = end;
    }
    let mut h = serde_json::to_vec(&Value::Object(map))?;
    h.resize(h.len().next_multiple_of(8), b' ');
    Ok(h)
}

/// The tensors cut into runs that are one lend each: consecutive tensors reading
/// consecutive elements of the same array (so an array lent group by group is read once
/// per file, not once per tensor).
fn runs(tensors: &[OutTensor]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        match runs.last_mut() {
            Some(r)
                if std::ptr::addr_eq(tensors[r.end - 1].from, t.from)
                    && tensors[r.end - 1].range.end == t.range.start =>
            {
                r.end = i + 1
            }
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

/// Writes a complete safetensors file to `w`, reading each run of tensors from its array
/// ([`Lend`]) and streaming it through one staging buffer of at most [`STAGE_BYTES`].
pub(crate) fn write_safetensors(w: &mut impl Write, tensors: &[OutTensor]) -> Result<()> {
    let header = header_bytes(tensors)?;
    w.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|_| w.write_all(&header))
        .context("writing the safetensors header")?;
    let largest = tensors.iter().map(OutTensor::nbytes).max().unwrap_or(0);
    let mut stage: Vec<u8> = Vec::with_capacity((largest as usize).min(STAGE_BYTES));
    for run in runs(tensors) {
        let run = &tensors[run];
        let (first, last) = (&run[0], &run[run.len() - 1]);
        let elems = first.range.start..last.range.end;
        let names = match run.len() {
            1 => format!("tensor {}", first.name),
            n => format!("tensors {} to {} ({n})", first.name, last.name),
        };
        let (width, dtype) = first.from.elem().dtype();
        let per = STAGE_BYTES / width;
        let mut written = 0;
        first
            .from
            .lend(elems.clone(), &mut |piece| {
                if piece.dtype().1 != dtype || written + piece.len() > elems.len() {
                    bail!(
                        "internal error: lent {} {} elements after {written} of {} {dtype}",
                        piece.len(),
                        piece.dtype().1,
                        elems.len()
                    );
                }
                let mut at = 0;
                while at < piece.len() {
                    let end = (at + per).min(piece.len());
                    stage.clear();
                    piece.put(at..end, &mut stage);
                    w.write_all(&stage)?;
                    at = end;
                }
                written += piece.len();
                Ok(())
            })
            .with_context(|| format!("writing {names}"))?;
        if written != elems.len() {
            bail!(
                "writing {names}: internal error: lent {written} of {} elements",
                elems.len()
            );
        }
    }
    w.flush().context("flushing")?;
    Ok(())
}

/// A memory-mapped, header-validated safetensors file.
pub(crate) struct StFile {
    pub path: PathBuf,
    map: Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
    infos: HashMap<String, TensorInfo>,
}

impl StFile {
    /// Opens and validates `path`. Errors name the file: missing, unreadable, truncated or
    /// corrupt header.
    pub fn open(path: &Path) -> Result<StFile> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("{}: no such file", path.display());
            }
            Err(e) => return Err(anyhow!(e)).context(format!("cannot open {}", path.display())),
        };
        let len = file
            .metadata()
            .with_context(|| format!("cannot stat {}", path.display()))?
            .len();
        if len < 8 {
            bail!(
                "{}: truncated or not a safetensors file ({len} bytes; a safetensors file starts \
                 with an 8-byte header length); re-save or re-download it",
                path.display()
            );
        }
        // SAFETY: a read-only mapping. It is sound as long as nobody truncates or rewrites the
        // file in place while we read it; memwall never does (it writes a temporary file and
        // renames it, which leaves this inode intact).
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot memory-map {}", path.display()))?;
        let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
            anyhow!(
                "{}: not a valid safetensors file ({e}; {len} bytes): the file is truncated or \
                 corrupt; re-save or re-download it",
                path.display()
            )
        })?;
        let infos = meta
            .tensors()
            .into_iter()
            .map(|(k, v)| (k, v.clone()))
            .collect();
        Ok(StFile {
            path: path.to_path_buf(),
            map,
            data_start: 8 + n,
            infos,
        })
    }

    /// Names of all tensors in the file (any order).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.infos.keys().map(String::as_str)
    }

    /// Header entry of a tensor.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.infos.get(name)
    }

    /// Byte range of a tensor's data within the mapping.
    fn byte_range(&self, info: &TensorInfo) -> Range<usize> {
        self.data_start + info.data_offsets.0..self.data_start + info.data_offsets.1
    }

    /// Raw bytes of a tensor (validated against the file length when opened).
    pub fn bytes(&self, name: &str, info: &TensorInfo) -> Result<&[u8]> {
        self.map.get(self.byte_range(info)).with_context(|| {
            format!(
                "{}: tensor {name}: data lies outside the file",
                self.path.display()
            )
        })
    }

    /// Drops a tensor's pages from this process's mapping (they are re-read from the file if
    /// touched again). Keeps a loaded file from staying resident next to its destination.
    pub fn release(&self, info: &TensorInfo) {
        let r = self.byte_range(info);
        self.release_bytes(r);
    }

    /// Drops the pages of bytes `within` of a tensor's data ([`StFile::release`] for a
    /// piece read alone: a rank's part of a flat array).
    pub fn release_within(&self, info: &TensorInfo, within: Range<usize>) {
        let start = self.byte_range(info).start;
        self.release_bytes(start + within.start..start + within.end);
    }

    /// Drops every page of the mapping (also those the kernel mapped around the tensors
    /// read: a streamed load calls this after each range, so its resident pages stay few).
    pub fn release_all(&self) {
        self.release_bytes(0..self.map.len());
    }

    /// Drops the pages of a byte range of the mapping (see [`StFile::release`]).
    fn release_bytes(&self, r: Range<usize>) {
        #[cfg(unix)]
        if !r.is_empty() {
            // SAFETY: the mapping is read-only and file-backed, so dropping its pages loses
            // nothing; later reads fault them back in from the file.
            let _ = unsafe {
                self.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    r.start,
                    r.len(),
                )
            };
        }
        #[cfg(not(unix))]
        let _ = r;
    }

    /// Converts elements `from..from + dst.len()` of tensor `name` (all of it, or a rank's
    /// part; its shape was checked against its target's) into `dst`, in blocks of
    /// [`READ_BLOCK`] elements whose pages are released right after their copy, so at most
    /// one block of the file is resident beyond the destination.
    pub fn read_into_from(
        &self,
        name: &str,
        info: &TensorInfo,
        from: usize,
        dst: &mut [f32],
    ) -> Result<()> {
        let whole = self.bytes(name, info)?;
        let fail = |e: String| anyhow!("{}: tensor {name}: {e}", self.path.display());
        let width = match info.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            _ => return decode_into(info.dtype, whole, dst).map_err(fail), // reports the dtype
        };
        let end = (from + dst.len()) * width;
        let src = if end <= whole.len() {
            &whole[from * width..end]
        } else {
            whole
        };
        if src.len() != width * dst.len() {
            return decode_into(info.dtype, src, dst).map_err(fail); // reports the sizes
        }
        let start = self.byte_range(info).start + from * width;
        for (i, (d, s)) in dst
            .chunks_mut(READ_BLOCK)
            .zip(src.chunks(READ_BLOCK * width))
            .enumerate()
        {
            decode_into(info.dtype, s, d).map_err(fail)?;
            let at = start + i * READ_BLOCK * width;
            self.release_bytes(at..at + s.len());
            if let Some((j, v)) = first_non_finite(d) {
                let len = info.shape.iter().product();
                bail!(
                    "{}: tensor {name}: {}: NaN or infinite weights cannot be trained or \
                     sampled (the file is corrupt, or a diverged run saved it); re-download or \
                     re-export it, or resume from an earlier checkpoint",
                    self.path.display(),
                    finite::describe(from + i * READ_BLOCK + j, v, len, d)
                );
            }
        }
        Ok(())
    }
}

/// Elements converted per block while loading (4 MiB of f32 data).
pub(crate) const READ_BLOCK: usize = 1 << 20;

/// Whether a dtype can be loaded (converted to f32).
pub(crate) fn supported(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16)
}

/// Decodes little-endian `src` of `dtype` into `dst`, converting to f32.
pub(crate) fn decode_into(dtype: Dtype, src: &[u8], dst: &mut [f32]) -> Result<(), String> {
    let width = match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => {
            return Err(format!(
                "unsupported dtype {other:?} (memwall loads F32, F16 and BF16)"
            ));
        }
    };
    if src.len() != width * dst.len() {
        return Err(format!(
            "holds {} bytes but {} {dtype:?} elements need {}",
            src.len(),
            dst.len(),
            width * dst.len()
        ));
    }
    match dtype {
        Dtype::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
    }
    Ok(())
}

/// How a tensor name found in a file is to be treated.
pub(crate) enum Resolved {
    /// It provides the tensor with this canonical key.
    Key(String),
    /// A known non-parameter (e.g. the attention mask buffer, the tied LM head): skip silently.
    Ignore,
}

/// A tensor to load: canonical key, expected shape (the file's: the whole tensor's),
/// destination buffer index and range.
#[derive(Clone)]
pub(crate) struct Target {
    pub key: String,
    pub shape: Vec<usize>,
    pub buf: usize,
    pub range: Range<usize>,
    /// The element that `range.start` receives, of the tensor or of its tensor-parallel
    /// `part` (0 unless the destination holds a piece of it: a rank's shard).
    pub from: usize,
    /// A tensor-parallel rank's part of the file's tensor: the destination receives the
    /// part's elements (its runs of the whole tensor, in order), not the whole tensor's.
    pub part: Option<crate::model::TensorPart>,
}

impl Target {
    /// Every tensor of `layout`, whole (a tensor-parallel part: its part of the whole
    /// tensor), as a target named `prefix` + its name, into buffer `buf` at the tensor's
    /// range.
    pub fn whole_tensors<'a>(
        layout: &'a crate::model::ParamLayout,
        prefix: &'a str,
        buf: usize,
    ) -> impl Iterator<Item = Target> + 'a {
        layout.tensors.iter().map(move |t| Target {
            key: format!("{prefix}{}", t.name),
            shape: t.whole_shape().to_vec(),
            buf,
            range: t.range.clone(),
            from: 0,
            part: t.part.clone(),
        })
    }
}

/// Joins up to [`LIST_MAX`] items, noting how many were left out.
pub(crate) fn list(items: &[String]) -> String {
    let mut s = items
        .iter()
        .take(LIST_MAX)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if items.len() > LIST_MAX {
        s.push_str(&format!(", and {} more", items.len() - LIST_MAX));
    }
    s
}

/// The tensors of one source of weights: a single file, or the shards that an index names
/// (see `shards.rs`). Each name is served by exactly one file.
pub(crate) struct Sources<'f> {
    /// What messages name first: the file, or the index.
    pub label: String,
    /// Sharded: per-tensor messages also name the shard holding the tensor.
    sharded: bool,
    at: HashMap<&'f str, &'f StFile>,
}

impl<'f> Sources<'f> {
    /// Every tensor of one file.
    pub fn single(file: &'f StFile) -> Sources<'f> {
        Sources {
            label: file.path.display().to_string(),
            sharded: false,
            at: file.names().map(|n| (n, file)).collect(),
        }
    }

    /// Tensors spread over several files: `at` names the file of each (checked by the caller
    /// to hold it); messages start with `label` (the index).
    pub fn sharded(label: String, at: HashMap<&'f str, &'f StFile>) -> Sources<'f> {
        Sources {
            label,
            sharded: true,
            at,
        }
    }

    /// Names of all tensors (any order).
    pub fn names(&self) -> impl Iterator<Item = &'f str> + '_ {
        self.at.keys().copied()
    }

    /// The file holding tensor `name` and its header entry.
    pub fn get(&self, name: &str) -> Option<(&'f StFile, &'f TensorInfo)> {
        let file = *self.at.get(name)?;
        Some((file, file.info(name)?))
    }

    /// Drops every page of every file's mapping ([`StFile::release_all`]).
    pub fn release_all(&self) {
        let mut done: Vec<*const StFile> = Vec::new();
        for &f in self.at.values() {
            if !done.contains(&(f as *const StFile)) {
                done.push(f);
                f.release_all();
            }
        }
    }

    /// ` (in <shard file name>)` when sharded, else nothing: appended to per-tensor messages.
    fn where_is(&self, name: &str) -> String {
        match self.at.get(name) {
            Some(f) if self.sharded => {
                let file = f.path.file_name().unwrap_or_default().to_string_lossy();
                format!(" in {file}")
            }
            _ => String::new(),
        }
    }
}

/// Checks, before anything is copied (so on error no destination is touched), that every
/// target is present exactly once, with the expected shape and a supported dtype; tensors
/// that resolve to no target are reported on stderr. Returns each target key's tensor name,
/// for [`copy_targets`].
pub(crate) fn check_targets(
    src: &Sources,
    resolve: &dyn Fn(&str) -> Resolved,
    targets: &[Target],
) -> Result<HashMap<String, String>> {
    let path = &src.label;
    let wanted: HashSet<&str> = targets.iter().map(|t| t.key.as_str()).collect();
    let mut by_key: HashMap<String, &str> = HashMap::new();
    let mut unknown = Vec::new();
    let mut names: Vec<&str> = src.names().collect();
    names.sort_unstable();
    for name in names {
        match resolve(name) {
            Resolved::Ignore => {}
            Resolved::Key(k) if wanted.contains(k.as_str()) => {
                if let Some(prev) = by_key.insert(k.clone(), name) {
                    bail!(
                        "{path}: tensors '{prev}' and '{name}' both provide '{k}'; keep only one of them"
                    );
                }
            }
            Resolved::Key(_) => unknown.push(name.to_string()),
        }
    }
    let (mut missing, mut bad_shape, mut bad_dtype) = (Vec::new(), Vec::new(), Vec::new());
    for t in targets {
        let Some((name, (_, info))) = by_key
            .get(&t.key)
            .and_then(|n| src.get(n).map(|fi| (*n, fi)))
        else {
            missing.push(t.key.clone());
            continue;
        };
        if info.shape != t.shape {
            bad_shape.push(format!(
                "{} (expected shape {:?}, found {:?}){}",
                t.key,
                t.shape,
                info.shape,
                src.where_is(name)
            ));
        } else if !supported(info.dtype) {
            bad_dtype.push(format!(
                "{} ({:?}){}",
                t.key,
                info.dtype,
                src.where_is(name)
            ));
        }
    }
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!(
            "{} missing tensor(s): {}",
            missing.len(),
            list(&missing)
        ));
    }
    if !bad_shape.is_empty() {
        problems.push(format!("wrong shape: {}", list(&bad_shape)));
    }
    if !bad_dtype.is_empty() {
        problems.push(format!(
            "unsupported dtype: {} (memwall loads F32, F16 and BF16; convert the file)",
            list(&bad_dtype)
        ));
    }
    if !problems.is_empty() {
        bail!("{path}: {}", problems.join("; "));
    }
    if !unknown.is_empty() {
        eprintln!(
            "memwall: warning: {path}: ignoring {} unexpected tensor(s): {}",
            unknown.len(),
            list(&unknown)
        );
    }
    Ok(by_key
        .into_iter()
        .map(|(k, n)| (k, n.to_string()))
        .collect())
}

/// Copies targets (checked by [`check_targets`], which returned `located`) from `src` into
/// `bufs[target.buf][target.range]` (a tensor-parallel part: its runs of the file's tensor).
pub(crate) fn copy_targets(
    src: &Sources,
    located: &HashMap<String, String>,
    targets: &[Target],
    bufs: &mut [&mut [f32]],
) -> Result<()> {
    let path = &src.label;
    for t in targets {
        let Some((name, (file, info))) = located
            .get(&t.key)
            .and_then(|n| src.get(n).map(|fi| (n.as_str(), fi)))
        else {
            bail!("internal error: {path}: tensor {} was not checked", t.key);
        };
        let dst = bufs
            .get_mut(t.buf)
            .and_then(|b| b.get_mut(t.range.clone()))
            .with_context(|| {
                format!(
                    "{path}: tensor {name}: destination range {:?} out of bounds",
                    t.range
                )
            })?;
        match &t.part {
            None => file.read_into_from(name, info, t.from, dst)?,
            // A part: its elements in runs of the whole tensor, read straight from the file.
            Some(part) => {
                for (w, r) in part.runs_in(t.from..t.from + dst.len()) {
                    let into = &mut dst[r.start - t.from..r.end - t.from];
                    file.read_into_from(name, info, w, into)?;
                }
            }
        }
    }
    Ok(())
}
