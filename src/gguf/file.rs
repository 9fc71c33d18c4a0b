//! The GGUF container (llama.cpp's model file), read through a memory map.
//!
//! Layout (little-endian, versions 2 and 3; version 1 used 32-bit counts and is refused):
//!
//! ```text
//! "GGUF"  u32 version  u64 tensor_count  u64 kv_count
//! kv_count × { string key, u32 value_type, value }        // metadata
//! tensor_count × { string name, u32 n_dims, u64 dims[n_dims] (innermost first),
//!                  u32 ggml_type, u64 offset (from the data section) }
//! padding to general.alignment (default 32)
//! data section: each tensor's bytes at its offset
//! ```
//!
//! A string is `u64 len` + UTF-8 bytes; an array is `u32 element_type, u64 count` + elements
//! (arrays may nest). Every error names the file and what is wrong: the field and byte offset
//! where the file ends early, a wrong magic, an unknown tensor type, tensor data past the end.

use crate::dtype::GgmlType;
use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The four bytes every GGUF file starts with.
pub const MAGIC: &[u8; 4] = crate::util::sniff::GGUF_MAGIC;
/// Data-section alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most this many dimensions (`GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Arrays nested deeper than this are refused (a damaged file, not a model).
const MAX_NESTING: usize = 8;

/// One metadata value, of any GGUF value type.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    /// Elements all of one type (which may itself be an array).
    Array(Vec<Value>),
}

impl Value {
    /// GGUF's name of the value's type, for messages (`uint32`, `array`, ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    /// The value as an integer, if it is one (of any width and sign).
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a float, if it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }
}

/// One tensor's entry in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions innermost first, as stored (a Hugging Face `[out, in]` weight is `[in, out]`).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the first byte from the start of the data section.
    pub offset: u64,
    /// Product of `dims`.
    pub n_elements: u64,
    /// Bytes of the tensor's data.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The shape outermost first (PyTorch / safetensors order).
    pub fn shape_outer_first(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// An open GGUF file: parsed header, metadata and tensor infos over a memory map of the file.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    /// 2 or 3.
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// `general.alignment` or 32.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl GgufFile {
    /// Maps and parses `path`; errors name the file and the field or offset that is wrong.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let f = File::open(path)
            .with_context(|| format!("cannot open GGUF file {}", path.display()))?;
        let meta = f
            .metadata()
            .with_context(|| format!("cannot read the size of {}", path.display()))?;
        if meta.is_dir() {
            bail!("{} is a directory, not a GGUF file", path.display());
        }
        let len = meta.len();
        if len == 0 {
            bail!(
                "{}: not a valid GGUF file: truncated at magic (the file is empty)",
                path.display()
            );
        }
        // SAFETY: the map is read-only; as with every memory-mapped reader, the file must not
        // be truncated by another process while it is open.
        let map = unsafe { Mmap::map(&f) }
            .with_context(|| format!("cannot memory-map GGUF file {}", path.display()))?;
        Self::parse(path, map)
    }

    fn parse(path: &Path, map: Mmap) -> Result<GgufFile> {
        let h = parse_header(&map[..])
            .with_context(|| format!("{}: not a valid GGUF file", path.display()))?;
        let index = h
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let tensor_index = h
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            version: h.version,
            metadata: h.metadata,
            tensors: h.tensors,
            alignment: h.alignment,
            data_offset: h.data_offset,
            index,
            tensor_index,
        })
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size of the file in bytes.
    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Whether the file is empty (never true for a parsed file).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The metadata value under `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor of this file (bounds were checked when the file was opened).
    /// Drops the pages of bytes `range` of tensor `t`'s data from this process's mapping
    /// (re-read from the file if touched again), so a streamed copy keeps little of the
    /// file resident.
    pub fn release(&self, t: &TensorInfo, range: std::ops::Range<usize>) {
        let data = self.tensor_data(t);
        let start = data.as_ptr() as usize - self.map.as_ptr() as usize + range.start;
        #[cfg(unix)]
        if !range.is_empty() {
            // SAFETY: the mapping is read-only and file-backed, so dropping its pages loses
            // nothing; later reads fault them back in from the file.
            let _ = unsafe {
                self.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    range.len(),
                )
            };
        }
        #[cfg(not(unix))]
        let _ = start;
    }

    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        &self.map[start..start + t.n_bytes as usize]
    }

    /// A non-negative integer under `key` (any integer type); `None` if absent.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_i128().map(u64::try_from) {
            Some(Ok(n)) => Ok(Some(n)),
            _ => bail!(
                "{}: metadata {key} should be a non-negative integer, found {} {v:?}",
                self.path.display(),
                v.type_name()
            ),
        }
    }

    /// A number under `key` (float or integer); `None` if absent.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_f64() {
            Some(x) => Ok(Some(x)),
            None => bail!(
                "{}: metadata {key} should be a number, found {}",
                self.path.display(),
                v.type_name()
            ),
        }
    }

    /// A string under `key`; `None` if absent.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => bail!(
                "{}: metadata {key} should be a string, found {}",
                self.path.display(),
                v.type_name()
            ),
        }
    }

    /// A bool under `key`; `None` if absent.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => bail!(
                "{}: metadata {key} should be a bool, found {}",
                self.path.display(),
                v.type_name()
            ),
        }
    }

    /// An array of strings under `key`; `None` if absent.
    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let bad = || {
            anyhow::anyhow!(
                "{}: metadata {key} should be an array of strings, found {}",
                self.path.display(),
                v.type_name()
            )
        };
        let Value::Array(items) = v else {
            return Err(bad());
        };
        items
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(s.as_str()),
                _ => Err(bad()),
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    /// An array of integers under `key`; `None` if absent.
    pub fn get_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let bad = || {
            anyhow::anyhow!(
                "{}: metadata {key} should be an array of integers, found {}",
                self.path.display(),
                v.type_name()
            )
        };
        let Value::Array(items) = v else {
            return Err(bad());
        };
        items
            .iter()
            .map(|x| {
                x.as_i128()
                    .and_then(|n| i64::try_from(n).ok())
                    .ok_or_else(bad)
            })
            .collect::<Result<_>>()
            .map(Some)
    }
}

/// What the header, metadata and tensor infos say.
struct Header {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// Parses everything before the data section and checks every tensor against the file.
fn parse_header(buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.take(4, "magic")?;
    if magic != MAGIC {
        bail!(
            "wrong magic {:?} (bytes {:02x?}) at offset 0: a GGUF file starts with \"GGUF\"; is this a safetensors or older GGML file?",
            String::from_utf8_lossy(magic),
            magic
        );
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => bail!(
            "GGUF version 1 is not supported (only versions 2 and 3); re-convert the model with a current llama.cpp"
        ),
        v if matches!(v.swap_bytes(), 1..=3) => bail!(
            "GGUF version {v:#x} reads as {} byte-swapped: big-endian GGUF files are not supported",
            v.swap_bytes()
        ),
        v => bail!("GGUF version {v} is not supported (only versions 2 and 3)"),
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // Each kv needs at least 12 bytes, each tensor info at least 24: a count beyond the file
    // is damage, caught before anything is reserved for it.
    c.check_count(n_kv, 12, "metadata count")?;
    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv as usize);
    let mut seen = HashMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("key of metadata entry {i}"))?;
        let ty = c.u32(&format!("value type of metadata {key}"))?;
        let value = c.value(ty, &key, 0)?;
        if seen.insert(key.clone(), i).is_some() {
            bail!("metadata key {key} appears twice");
        }
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_i128() {
            Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= u32::MAX as i128 => a as u64,
            _ => bail!("general.alignment must be a power of two, found {v:?}"),
        },
    };
    c.check_count(n_tensors, 24, "tensor count")?;
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names = HashMap::new();
    for i in 0..n_tensors {
        let t = c.tensor_info(i)?;
        if names.insert(t.name.clone(), i).is_some() {
            bail!("tensor {} appears twice", t.name);
        }
        tensors.push(t);
    }
    let data_offset = (c.pos as u64).next_multiple_of(alignment);
    let file_len = buf.len() as u64;
    for t in &tensors {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes));
        match end {
            Some(end) if end <= file_len => {}
            _ => bail!(
                "tensor {} data ({} bytes of {} at data offset {}, absolute {}) runs past the end of the file ({file_len} bytes): the file is truncated",
                t.name,
                t.n_bytes,
                t.ty,
                t.offset,
                data_offset.saturating_add(t.offset)
            ),
        }
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// A reading position in the file's bytes; every read names the field it reads.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => bail!(
                "truncated at {what} (offset {}, needs {n} bytes, the file has {})",
                self.pos,
                self.buf.len()
            ),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self
            .take(N, what)?
            .try_into()
            .expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Refuses a count whose elements (at least `min_bytes` each) cannot fit in the rest.
    fn check_count(&self, count: u64, min_bytes: u64, what: &str) -> Result<()> {
        let rest = (self.buf.len() - self.pos) as u64;
        if count.saturating_mul(min_bytes) > rest {
            bail!(
                "{what} {count} at offset {} cannot fit in the {rest} bytes left: the file is truncated or damaged",
                self.pos
            );
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(&format!("length of {what}"))?;
        let Ok(len) = usize::try_from(len) else {
            bail!("{what}: length {len} at offset {at} is impossible");
        };
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| anyhow::anyhow!("{what} at offset {at} is not UTF-8: {e}"))
    }

    /// A value of GGUF type `ty` belonging to metadata `key`.
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = || format!("value of metadata {key}");
        Ok(match ty {
            0 => Value::U8(self.array::<1>(&what())?[0]),
            1 => Value::I8(self.array::<1>(&what())?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what())?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what())?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&what())?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&what())?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what())?)),
            7 => match self.array::<1>(&what())?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => bail!(
                    "metadata {key}: bool byte {b} at offset {} is neither 0 nor 1",
                    self.pos - 1
                ),
            },
            8 => Value::String(self.string(&what())?),
            9 => {
                if depth >= MAX_NESTING {
                    bail!("metadata {key}: arrays nested more than {MAX_NESTING} deep");
                }
                let elem = self.u32(&format!("element type of metadata {key}"))?;
                let n = self.u64(&format!("length of metadata {key}"))?;
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => 1,
                };
                self.check_count(n, min, &format!("length of metadata {key}"))?;
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(&what())?)),
            11 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            t => bail!(
                "metadata {key}: unknown value type {t} at offset {} (GGUF types are 0-12)",
                self.pos - 4
            ),
        })
    }

    fn tensor_info(&mut self, i: u64) -> Result<TensorInfo> {
        let name = self.string(&format!("name of tensor {i}"))?;
        let n_dims = self.u32(&format!("dimension count of tensor {name}"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            bail!("tensor {name} has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})");
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(self.u64(&format!("dimension {d} of tensor {name}"))?);
        }
        let ty_at = self.pos;
        let ty_id = self.u32(&format!("type of tensor {name}"))?;
        let ty = GgmlType::from_id(ty_id)
            .with_context(|| format!("tensor {name} (type at offset {ty_at})"))?;
        let offset = self.u64(&format!("data offset of tensor {name}"))?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| {
                if d > i64::MAX as u64 {
                    None
                } else {
                    acc.checked_mul(d)
                }
            })
            .filter(|&n| n <= i64::MAX as u64);
        let Some(n_elements) = n_elements else {
            bail!("tensor {name}: dimensions {dims:?} overflow (their product exceeds 2^63)");
        };
        if !dims[0].is_multiple_of(ty.block_size) {
            bail!(
                "tensor {name}: rows of {} values are not a whole number of {ty} blocks of {}",
                dims[0],
                ty.block_size
            );
        }
        let Some(n_bytes) = ty.bytes_for(n_elements) else {
            bail!("tensor {name}: byte size of {n_elements} {ty} values overflows");
        };
        Ok(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_elements,
            n_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{GgufWriter, write_temp};
    use super::*;

    fn open_err(bytes: &[u8]) -> String {
        let (_dir, path) = write_temp(bytes);
        let e = format!("{:#}", GgufFile::open(&path).err().expect("should fail"));
        assert!(
            e.contains(&path.display().to_string()),
            "names the file: {e}"
        );
        e
    }

    fn sample() -> GgufWriter {
        let mut w = GgufWriter::new(3);
        w.kv("general.architecture", Value::String("llama".into()));
        w.kv("a.u8", Value::U8(7));
        w.kv("a.i8", Value::I8(-7));
        w.kv("a.u16", Value::U16(65535));
        w.kv("a.i16", Value::I16(-300));
        w.kv("a.u32", Value::U32(4_000_000_000));
        w.kv("a.i32", Value::I32(-5));
        w.kv("a.u64", Value::U64(1 << 40));
        w.kv("a.i64", Value::I64(-(1 << 40)));
        w.kv("a.f32", Value::F32(1.5));
        w.kv("a.f64", Value::F64(-2.25));
        w.kv("a.bool", Value::Bool(true));
        w.kv(
            "a.strs",
            Value::Array(vec![Value::String("x".into()), Value::String("yz".into())]),
        );
        w.kv(
            "a.nested",
            Value::Array(vec![
                Value::Array(vec![Value::I32(1), Value::I32(2)]),
                Value::Array(vec![]),
            ]),
        );
        w.tensor("w", &[4, 2], GgmlType::F32, &[0u8; 32]);
        w.tensor("v", &[3], GgmlType::F16, &[1u8; 6]);
        w
    }

    #[test]
    fn reads_every_value_type_and_tensor_infos() {
        for version in [2, 3] {
            let mut w = sample();
            w.version = version;
            let (_dir, path) = write_temp(&w.to_bytes());
            let f = GgufFile::open(&path).unwrap();
            assert_eq!(f.version, version);
            assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
            assert_eq!(f.get("a.u8"), Some(&Value::U8(7)));
            assert_eq!(f.get("a.i8"), Some(&Value::I8(-7)));
            assert_eq!(f.get("a.u16"), Some(&Value::U16(65535)));
            assert_eq!(f.get("a.i16"), Some(&Value::I16(-300)));
            assert_eq!(f.get_u64("a.u32").unwrap(), Some(4_000_000_000));
            assert_eq!(f.get("a.i32"), Some(&Value::I32(-5)));
            assert_eq!(f.get_u64("a.u64").unwrap(), Some(1 << 40));
            assert_eq!(f.get("a.i64"), Some(&Value::I64(-(1 << 40))));
            assert_eq!(f.get_f64("a.f32").unwrap(), Some(1.5));
            assert_eq!(f.get_f64("a.f64").unwrap(), Some(-2.25));
            assert_eq!(f.get_bool("a.bool").unwrap(), Some(true));
            assert_eq!(f.get_str_array("a.strs").unwrap(), Some(vec!["x", "yz"]));
            assert_eq!(
                f.get("a.nested"),
                Some(&Value::Array(vec![
                    Value::Array(vec![Value::I32(1), Value::I32(2)]),
                    Value::Array(vec![]),
                ]))
            );
            assert!(f.get_u64("a.i32").is_err(), "negative is not a u64");
            assert!(f.get_str("a.u8").unwrap_err().to_string().contains("a.u8"));
            assert_eq!(f.alignment, 32);
            assert_eq!(f.data_offset % 32, 0);
            let w_info = f.tensor("w").unwrap();
            assert_eq!(w_info.dims, vec![4, 2]);
            assert_eq!(w_info.shape_outer_first(), vec![2, 4]);
            assert_eq!((w_info.n_elements, w_info.n_bytes), (8, 32));
            let v_info = f.tensor("v").unwrap();
            assert_eq!(v_info.ty, GgmlType::F16);
            assert_eq!(f.tensor_data(v_info), &[1u8; 6]);
            assert_eq!(v_info.offset, 32, "the second tensor is aligned");
        }
    }

    #[test]
    fn honours_general_alignment() {
        let mut w = sample();
        w.alignment = 64;
        w.kv("general.alignment", Value::U32(64));
        let (_dir, path) = write_temp(&w.to_bytes());
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.alignment, 64);
        assert_eq!(f.data_offset % 64, 0);
        assert_eq!(f.tensor("v").unwrap().offset, 64);
        assert_eq!(f.tensor_data(f.tensor("v").unwrap()), &[1u8; 6]);
    }

    #[test]
    fn wrong_magic_is_a_clean_error() {
        let mut bytes = sample().to_bytes();
        bytes[..4].copy_from_slice(b"GGML");
        let e = open_err(&bytes);
        assert!(e.contains("wrong magic") && e.contains("GGML"), "{e}");
    }

    #[test]
    fn version_1_and_unknown_versions_are_refused_by_name() {
        let mut bytes = sample().to_bytes();
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(open_err(&bytes).contains("GGUF version 1 is not supported"));
        bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
        assert!(open_err(&bytes).contains("big-endian"));
        bytes[4..8].copy_from_slice(&9u32.to_le_bytes());
        assert!(open_err(&bytes).contains("version 9"));
    }

    #[test]
    fn every_truncation_is_a_clean_error_naming_the_field() {
        let bytes = sample().to_bytes();
        let f_end = {
            let (_d, p) = write_temp(&bytes);
            let f = GgufFile::open(&p).unwrap();
            f.data_offset as usize
        };
        // Cut the file at every length up to the end of the tensor infos, then inside the data.
        for cut in (0..f_end).chain([f_end + 1, bytes.len() - 1]) {
            let e = open_err(&bytes[..cut]);
            assert!(
                e.contains("truncated") || e.contains("runs past the end"),
                "cut at {cut}: {e}"
            );
        }
        let e = open_err(&bytes[..20]);
        assert!(
            e.contains("metadata count") && e.contains("offset 16"),
            "{e}"
        );
        let e = open_err(&bytes[..bytes.len() - 1]);
        assert!(
            e.contains("tensor v data") && e.contains("past the end"),
            "{e}"
        );
    }

    #[test]
    fn unknown_tensor_type_is_a_clean_error() {
        let mut w = GgufWriter::new(3);
        w.tensor_raw("bad", &[32], 77, &[0u8; 64]);
        let e = open_err(&w.to_bytes());
        assert!(
            e.contains("unknown tensor type id 77") && e.contains("tensor bad"),
            "{e}"
        );
    }

    #[test]
    fn damaged_tensor_infos_are_clean_errors() {
        let mut w = GgufWriter::new(3);
        w.tensor("big", &[1 << 32, 1 << 32], GgmlType::F32, &[]);
        assert!(open_err(&w.to_bytes()).contains("overflow"));
        let mut w = GgufWriter::new(3);
        w.tensor("ragged", &[33], GgmlType::Q8_0, &[0u8; 34]);
        assert!(open_err(&w.to_bytes()).contains("whole number of Q8_0 blocks"));
        let mut w = GgufWriter::new(3);
        w.tensor("five", &[1, 1, 1, 1, 1], GgmlType::F32, &[0u8; 4]);
        assert!(open_err(&w.to_bytes()).contains("5 dimensions"));
        let mut w = GgufWriter::new(3);
        w.tensor("t", &[2], GgmlType::F32, &[0u8; 8]);
        w.tensor("t", &[2], GgmlType::F32, &[0u8; 8]);
        assert!(open_err(&w.to_bytes()).contains("tensor t appears twice"));
        // A count that cannot fit in the file is refused before anything is reserved.
        let mut bytes = GgufWriter::new(3).to_bytes();
        bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(open_err(&bytes).contains("cannot fit"));
    }
}
