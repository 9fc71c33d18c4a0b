//! The GGUF v3 writer: metadata, tensor infos and tensor data, streamed tensor by tensor
//! into a file published atomically.
//!
//! The layout is the one [`super::file`] reads: `"GGUF"`, version 3, the counts, every
//! metadata entry (any [`Value`], arrays of any element type included), every tensor info
//! (dims innermost first, type, offset from the data section), padding to the alignment
//! (`general.alignment` when the metadata has it, else 32), then each tensor's bytes at an
//! offset that is a multiple of the alignment.
//!
//! Offsets are known before any data is written (each tensor's size follows from its type
//! and dims), so [`write_gguf`] asks `produce` for one tensor's bytes at a time and writes
//! them at once: memory holds one tensor (and whatever `produce` keeps while making it),
//! never the model. `produce` must return exactly the size its info announced; a wrong size
//! is an error naming the tensor. The file is written into a temporary sibling, fsynced and
//! renamed ([`crate::util::atomic::write_with`]): on any error the temporary is removed and
//! an earlier file at the path is unchanged.

use super::file::{DEFAULT_ALIGNMENT, Value};
use crate::dtype::GgmlType;
use anyhow::{Result, bail};
use std::io::{BufWriter, Write};
use std::path::Path;

/// The GGUF version written.
pub const VERSION: u32 = 3;

/// One tensor's info as written: name, dims innermost first, type.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    /// Dimensions innermost first (a Hugging Face `[out, in]` weight is `[in, out]`).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    /// Bytes of the tensor's data; an error names the tensor when its rows are not whole
    /// blocks of its type.
    pub fn n_bytes(&self) -> Result<u64> {
        let n: u64 = self.dims.iter().product();
        let row = self.dims.first().copied().unwrap_or(1);
        match self.ty.bytes_for(n) {
            Some(b) if row % self.ty.block_size == 0 => Ok(b),
            _ => bail!(
                "tensor {}: rows of {row} values are not a whole number of {} blocks of {}; \
                 choose a type with smaller blocks (f32, f16, bf16)",
                self.name,
                self.ty,
                self.ty.block_size
            ),
        }
    }
}

/// GGUF's id of a value's type (`gguf_type`).
pub fn value_type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// Appends a GGUF string (`u64` length, UTF-8 bytes).
pub fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// Appends a value (without its type id). An array's element type is its first element's;
/// an empty array says int32 (readers ignore it). Mixed arrays are refused by
/// [`write_gguf`] before anything is written.
pub fn put_value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => b.push(*x),
        Value::I8(x) => b.push(*x as u8),
        Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => b.push(*x as u8),
        Value::String(s) => put_str(b, s),
        Value::Array(items) => {
            let elem = items.first().map_or(5, value_type_id);
            b.extend_from_slice(&elem.to_le_bytes());
            b.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for x in items {
                put_value(b, x);
            }
        }
    }
}

/// Refuses an array whose elements differ in type (GGUF arrays have one element type),
/// naming the key.
fn check_value(key: &str, v: &Value) -> Result<()> {
    if let Value::Array(items) = v {
        if let Some(first) = items.first() {
            let ty = value_type_id(first);
            if let Some(i) = items.iter().position(|x| value_type_id(x) != ty) {
                bail!(
                    "metadata {key}: element {i} is {} but element 0 is {}; a GGUF array holds one type",
                    items[i].type_name(),
                    first.type_name()
                );
            }
        }
        for x in items {
            check_value(key, x)?;
        }
    }
    Ok(())
}

/// The alignment the metadata asks for (`general.alignment`, a power of two), else 32.
fn alignment_of(metadata: &[(String, Value)]) -> Result<u64> {
    match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some((_, v)) => match v.as_i128() {
            Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= u32::MAX as i128 => {
                Ok(a as u64)
            }
            _ => bail!("metadata general.alignment must be a power of two, found {v:?}"),
        },
    }
}

/// Everything before the data section (padding included), and each tensor's `(offset from
/// the data section, bytes)`.
struct Header {
    bytes: Vec<u8>,
    placed: Vec<(u64, u64)>,
}

/// The [`Header`] of a file with this metadata and these tensors.
fn header(metadata: &[(String, Value)], tensors: &[TensorSpec], alignment: u64) -> Result<Header> {
    let mut b = Vec::new();
    b.extend_from_slice(super::file::MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    b.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    let mut seen = std::collections::HashSet::new();
    for (k, v) in metadata {
        if !seen.insert(k.as_str()) {
            bail!("metadata key {k} is given twice");
        }
        check_value(k, v)?;
        put_str(&mut b, k);
        b.extend_from_slice(&value_type_id(v).to_le_bytes());
        put_value(&mut b, v);
    }
    let mut names = std::collections::HashSet::new();
    let mut placed = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            bail!("tensor {} is given twice", t.name);
        }
        if t.dims.is_empty() || t.dims.len() > super::file::MAX_DIMS as usize {
            bail!(
                "tensor {} has {} dimensions; GGUF allows 1 to {}",
                t.name,
                t.dims.len(),
                super::file::MAX_DIMS
            );
        }
        let n = t.n_bytes()?;
        put_str(&mut b, &t.name);
        b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&t.ty.id.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
        placed.push((offset, n));
        offset = (offset + n).next_multiple_of(alignment);
    }
    b.resize((b.len() as u64).next_multiple_of(alignment) as usize, 0);
    Ok(Header { bytes: b, placed })
}

/// Writes a GGUF v3 file at `path` atomically (see the module doc): `metadata` in order,
/// then `tensors`, whose bytes `produce(i, buf)` puts into `buf` (cleared before each call)
/// one tensor at a time. Errors name the key or tensor that is wrong, and leave no file
/// behind (an earlier file at `path` is unchanged).
pub fn write_gguf(
    path: &Path,
    metadata: &[(String, Value)],
    tensors: &[TensorSpec],
    mut produce: impl FnMut(usize, &mut Vec<u8>) -> Result<()>,
) -> Result<()> {
    let alignment = alignment_of(metadata)?;
    let Header {
        bytes: head,
        placed,
    } = header(metadata, tensors, alignment)?;
    crate::util::atomic::write_with(path, |f| {
        let mut w = BufWriter::with_capacity(1 << 20, f);
        w.write_all(&head)?;
        let mut at = 0u64; // bytes of the data section written
        let mut buf = Vec::new();
        for (i, (t, &(offset, n))) in tensors.iter().zip(&placed).enumerate() {
            w.write_all(&vec![0u8; (offset - at) as usize])?;
            buf.clear();
            produce(i, &mut buf)?;
            if buf.len() as u64 != n {
                bail!(
                    "tensor {}: {} bytes were produced, but {:?} {} takes {n}",
                    t.name,
                    buf.len(),
                    t.dims,
                    t.ty
                );
            }
            w.write_all(&buf)?;
            at = offset + n;
        }
        w.flush()?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::file::GgufFile;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn written_files_read_back_with_every_value_type() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let md: Vec<(String, Value)> = vec![
            ("a.u8".into(), Value::U8(7)),
            ("a.i8".into(), Value::I8(-7)),
            ("a.u16".into(), Value::U16(700)),
            ("a.i16".into(), Value::I16(-700)),
            ("a.u32".into(), Value::U32(70000)),
            ("a.i32".into(), Value::I32(-70000)),
            ("a.u64".into(), Value::U64(1 << 40)),
            ("a.i64".into(), Value::I64(-(1 << 40))),
            ("a.f32".into(), Value::F32(1.5)),
            ("a.f64".into(), Value::F64(-2.25)),
            ("a.bool".into(), Value::Bool(true)),
            ("a.str".into(), Value::String("héllo".into())),
            (
                "a.strs".into(),
                Value::Array(vec![Value::String("x".into()), Value::String("".into())]),
            ),
            (
                "a.ints".into(),
                Value::Array(vec![Value::I32(1), Value::I32(-2)]),
            ),
            (
                "a.floats".into(),
                Value::Array(vec![Value::F32(0.5), Value::F32(-0.5)]),
            ),
            (
                "a.nested".into(),
                Value::Array(vec![Value::Array(vec![Value::U8(1)])]),
            ),
            ("general.alignment".into(), Value::U32(64)),
        ];
        let a: Vec<f32> = (0..10).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..64).map(|i| (i as f32).sin()).collect();
        let mut q = vec![0u8; 2 * 34];
        crate::gguf::quantize::quantize(GgmlType::Q8_0, &b, &mut q).unwrap();
        let tensors = vec![
            TensorSpec {
                name: "a".into(),
                dims: vec![5, 2],
                ty: GgmlType::F32,
            },
            TensorSpec {
                name: "b".into(),
                dims: vec![64],
                ty: GgmlType::Q8_0,
            },
        ];
        let datas = [f32_bytes(&a), q.clone()];
        write_gguf(&path, &md, &tensors, |i, buf| {
            buf.extend_from_slice(&datas[i]);
            Ok(())
        })
        .unwrap();
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.metadata, md);
        assert_eq!(f.alignment, 64);
        assert_eq!(f.data_offset % 64, 0);
        let ta = f.tensor("a").unwrap();
        assert_eq!((ta.dims.clone(), ta.ty), (vec![5, 2], GgmlType::F32));
        assert_eq!(f.tensor_data(ta), &datas[0][..]);
        let tb = f.tensor("b").unwrap();
        assert_eq!(tb.offset % 64, 0);
        assert_eq!(f.tensor_data(tb), &q[..]);
    }

    #[test]
    fn bad_input_is_named_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, b"earlier").unwrap();
        let t = |name: &str, dims: Vec<u64>, ty| TensorSpec {
            name: name.into(),
            dims,
            ty,
        };
        let one = [t("w", vec![32], GgmlType::F32)];
        let err = |r: Result<()>| format!("{:#}", r.unwrap_err());
        // A tensor of the wrong size.
        let e = err(write_gguf(&path, &[], &one, |_, b| {
            b.push(0);
            Ok(())
        }));
        assert!(e.contains("tensor w: 1 bytes were produced"), "{e}");
        // A failure while producing.
        let e = err(write_gguf(&path, &[], &one, |_, _| bail!("no more disk")));
        assert!(e.contains("no more disk") && e.contains("unchanged"), "{e}");
        // Rows that are not whole blocks, named with a type that fits.
        let e = err(write_gguf(
            &path,
            &[],
            &[t("blk.0.attn_q.weight", vec![48, 2], GgmlType::Q8_0)],
            |_, _| Ok(()),
        ));
        assert!(
            e.contains("blk.0.attn_q.weight") && e.contains("f16"),
            "{e}"
        );
        let mixed = [(
            "k".to_string(),
            Value::Array(vec![Value::I32(1), Value::String("x".into())]),
        )];
        let e = err(write_gguf(&path, &mixed, &[], |_, _| Ok(())));
        assert!(e.contains("metadata k: element 1 is string"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"earlier");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary left: {names:?}");
    }
}
