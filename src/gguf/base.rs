//! A LoRA base kept as a GGUF file's own blocks (`--base-quant keep`): the storage type of
//! each base tensor ([`BaseSource::types`], what the plan lays the base out with) and the
//! copy of each tensor's bytes from the file into the plan's buffers ([`BaseSource::copy`]):
//! the blocks as they are, never re-quantized, the rows of a Llama Q or K weight moved back
//! into Hugging Face's order (whole rows of blocks at a time), vectors decoded to f32 (Gemma
//! 3's norms minus the 1 llama.cpp's converter adds, as `convert` gives them). The
//! file is read row by row with its pages released as it goes, so little of it is resident
//! beside the plan.

use super::file::GgufFile;
use super::hf::{HfTensor, map_model};
use crate::dtype::GgmlType;
use crate::dtype::dequant;
use crate::ir::BaseTypes;
use crate::model::ParamTensor;
use anyhow::{Context, Result, bail};
use std::collections::HashMap;
use std::path::Path;

/// Bytes of the file copied between releases of their pages.
const PIECE_BYTES: usize = 1 << 20;

/// A GGUF model read as a LoRA base.
pub struct BaseSource {
    file: GgufFile,
    /// The file's tensors by their Hugging Face names.
    by_name: HashMap<String, HfTensor>,
}

impl BaseSource {
    pub fn open(path: &Path) -> Result<BaseSource> {
        let file = GgufFile::open(path)?;
        let model = map_model(&file)?;
        if model.arch == super::hf::Arch::Gpt2 {
            bail!(
                "{}: a gpt2 GGUF file's blocks are rows of transposed Conv1D weights, which \
                 memwall cannot keep as a LoRA base (--base-quant keep); use --base-quant q4_0 \
                 or train the converted directory",
                path.display()
            );
        }
        let by_name = model
            .tensors
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        Ok(BaseSource { file, by_name })
    }

    /// Each tensor's storage type, by its Hugging Face name.
    pub fn types(&self) -> BaseTypes {
        self.by_name
            .iter()
            .map(|(name, t)| {
                let info = self
                    .file
                    .tensor(&t.gguf)
                    .expect("map_model lists the file's tensors");
                (name.clone(), info.ty)
            })
            .collect()
    }

    /// Copies tensor `t` into `dst`, its bytes where the plan keeps it as `storage`: blocks
    /// of the file's own type (`Some`, which must be the file's), or f32 values (`None`).
    pub fn copy(&self, t: &ParamTensor, storage: Option<GgmlType>, dst: &mut [u8]) -> Result<()> {
        let path = self.file.path().display().to_string();
        let Some(h) = self.by_name.get(&t.name) else {
            bail!("{path}: no tensor for {} (the base's layout)", t.name);
        };
        let info = self
            .file
            .tensor(&h.gguf)
            .expect("map_model lists the file's tensors");
        if let Some(part) = &t.part {
            return self.copy_part(h, info, (t, part), storage, dst);
        }
        let cols = match t.shape.as_slice() {
            [_, cols] => *cols,
            _ => 1,
        };
        let rows = t.range.len() / cols;
        let src = self.file.tensor_data(info);
        if h.shift != 0.0 && storage.is_some() {
            // Only vectors carry a shift (Gemma 3's norms), and vectors are decoded to f32
            // (`plan::lora`'s base storage): blocks could not take the subtraction.
            bail!(
                "internal error: {} (stored plus {}) is to be kept as blocks",
                t.name,
                h.shift
            );
        }
        match storage {
            Some(ty) if ty != info.ty => self.convert(h, info, (rows, cols), ty, dst),
            Some(ty) => {
                let row = ty.bytes_for(cols as u64).context("rows of whole blocks")? as usize;
                if dst.len() != row * rows || src.len() != dst.len() {
                    bail!(
                        "internal error: {} takes {} bytes, not {}",
                        t.name,
                        src.len(),
                        dst.len()
                    );
                }
                // GGUF row g goes to Hugging Face row `to(g)`; rows read in file order, their
                // pages released every PIECE_BYTES.
                let to = unpermute(h.unpermute_heads, rows);
                let per_piece = (PIECE_BYTES / row.max(1)).max(1);
                for g0 in (0..rows).step_by(per_piece) {
                    let g1 = (g0 + per_piece).min(rows);
                    for g in g0..g1 {
                        let d = to(g);
                        dst[d * row..(d + 1) * row].copy_from_slice(&src[g * row..(g + 1) * row]);
                    }
                    self.file.release(info, g0 * row..g1 * row);
                }
                Ok(())
            }
            None => {
                let mut values = vec![0f32; t.range.len()];
                dequant::dequantize(info.ty, src, &mut values)
                    .with_context(|| format!("{path}: tensor {}", h.gguf))?;
                self.file.release(info, 0..src.len());
                if let Some(i) = values.iter().position(|x| !x.is_finite()) {
                    bail!("{path}: tensor {} has {} at element {i}", h.gguf, values[i]);
                }
                let to = unpermute(h.unpermute_heads, rows);
                for g in 0..rows {
                    let d = to(g);
                    for c in 0..cols {
                        // Gemma 3's norms: the file's `1 + w` back to w, as `convert` does.
                        let x = (values[g * cols + c] - h.shift).to_le_bytes();
                        dst[4 * (d * cols + c)..4 * (d * cols + c + 1)].copy_from_slice(&x);
                    }
                }
                Ok(())
            }
        }
    }
}

impl BaseSource {
    /// [`BaseSource::copy`] of a tensor rank's part of tensor `t` (`--tp`): each of its runs
    /// of a Hugging Face row (whole rows of a column-parallel weight, a slice of columns of
    /// a row-parallel one, of whole blocks: `plan::lora` lays parts out so) copied from its
    /// GGUF row, as blocks of the file's type, converted to another (`convert`'s case), or
    /// decoded to f32 values. The tensor's pages are released once it is copied.
    fn copy_part(
        &self,
        h: &HfTensor,
        info: &super::file::TensorInfo,
        (t, part): (&ParamTensor, &crate::model::TensorPart),
        storage: Option<GgmlType>,
        dst: &mut [u8],
    ) -> Result<()> {
        let path = self.file.path().display().to_string();
        let what = || {
            format!(
                "{path}: tensor {} ({}), a tensor rank's part",
                h.gguf, info.ty
            )
        };
        let cols = match t.whole_shape() {
            [_, cols] => *cols,
            _ => 1,
        };
        let rows = t.whole_len() / cols;
        if h.shift != 0.0 && storage.is_some() {
            bail!(
                "internal error: {} (stored plus {}) is to be kept as blocks",
                t.name,
                h.shift
            );
        }
        // HF row d is GGUF row from[d].
        let to = unpermute(h.unpermute_heads, rows);
        let mut from = vec![0; rows];
        for g in 0..rows {
            from[to(g)] = g;
        }
        let src = self.file.tensor_data(info);
        let src_row = info.ty.bytes_for(cols as u64).with_context(what)? as usize;
        if src.len() != src_row * rows {
            bail!("internal error: {} is not {rows} rows of {cols}", h.gguf);
        }
        let bytes = |ty: GgmlType, n: usize| -> Result<usize> {
            Ok(ty.bytes_for(n as u64).with_context(what)? as usize)
        };
        let mut values = vec![0f32; cols];
        // The part's runs, each cut at the rows it crosses: (HF row, first column, columns).
        let mut at = 0; // elements of the part copied
        for (w, n) in part.runs() {
            let mut e = w;
            while e < w + n {
                let (d, c0) = (e / cols, e % cols);
                let k = (cols - c0).min(w + n - e);
                let g = from[d];
                let row = &src[g * src_row..(g + 1) * src_row];
                match storage {
                    Some(ty) if ty == info.ty => {
                        let (lo, len, out) = (bytes(ty, c0)?, bytes(ty, k)?, bytes(ty, at)?);
                        dst[out..out + len].copy_from_slice(&row[lo..lo + len]);
                    }
                    Some(ty) => {
                        dequant::dequantize(info.ty, row, &mut values).with_context(what)?;
                        let (out, len) = (bytes(ty, at)?, bytes(ty, k)?);
                        let dst = &mut dst[out..out + len];
                        super::quantize::quantize(ty, &values[c0..c0 + k], dst)
                            .with_context(what)?;
                    }
                    None => {
                        dequant::dequantize(info.ty, row, &mut values).with_context(what)?;
                        for (j, &x) in values[c0..c0 + k].iter().enumerate() {
                            if !x.is_finite() {
                                bail!(
                                    "{path}: tensor {} has {x} at element {}",
                                    h.gguf,
                                    g * cols + c0 + j
                                );
                            }
                            let b = (x - h.shift).to_le_bytes();
                            dst[4 * (at + j)..4 * (at + j + 1)].copy_from_slice(&b);
                        }
                    }
                }
                (e, at) = (e + k, at + k);
            }
        }
        let out = match storage {
            Some(ty) => bytes(ty, at)?,
            None => 4 * at,
        };
        if out != dst.len() {
            bail!(
                "internal error: {} of {} bytes into {}",
                t.name,
                out,
                dst.len()
            );
        }
        self.file.release(info, 0..src.len());
        Ok(())
    }

    /// Copies the tensor of `h` (GGUF `info`, `rows` × `cols`) into `dst` as blocks of `ty`,
    /// another type than the file's (the parts of a fused projection the file stores as
    /// different types, `plan::lora::unify_storage`): each row decoded and quantized again,
    /// put at its Hugging Face row, its pages released as it goes.
    fn convert(
        &self,
        h: &HfTensor,
        info: &super::file::TensorInfo,
        (rows, cols): (usize, usize),
        ty: GgmlType,
        dst: &mut [u8],
    ) -> Result<()> {
        let path = self.file.path().display().to_string();
        let what = || format!("{path}: tensor {} ({} to {ty})", h.gguf, info.ty);
        let (src_row, dst_row) = (
            info.ty.bytes_for(cols as u64).with_context(what)? as usize,
            ty.bytes_for(cols as u64).with_context(what)? as usize,
        );
        let src = self.file.tensor_data(info);
        if src.len() != src_row * rows || dst.len() != dst_row * rows {
            bail!("internal error: {} is not {rows} rows of {cols}", h.gguf);
        }
        let to = unpermute(h.unpermute_heads, rows);
        let mut values = vec![0f32; cols];
        let mut released = 0;
        for g in 0..rows {
            let bytes = &src[g * src_row..(g + 1) * src_row];
            dequant::dequantize(info.ty, bytes, &mut values).with_context(what)?;
            let d = to(g);
            super::quantize::quantize(ty, &values, &mut dst[d * dst_row..(d + 1) * dst_row])
                .with_context(what)?;
            let read = (g + 1) * src_row;
            if read - released >= PIECE_BYTES || g + 1 == rows {
                self.file.release(info, released..read);
                released = read;
            }
        }
        Ok(())
    }
}

/// Where GGUF row `g` of a tensor of `rows` rows goes in Hugging Face order: llama.cpp's
/// Q/K permutation undone with `heads` heads (see `super::hf::unpermute_rows`: HF row
/// `h·d + s·d/2 + i` is GGUF row `h·d + 2i + s`), or the same row.
fn unpermute(heads: Option<usize>, rows: usize) -> impl Fn(usize) -> usize {
    let d = heads.map_or(0, |h| rows / h.max(1));
    move |g| {
        if d < 2 {
            return g;
        }
        let (h, r) = (g / d, g % d);
        h * d + (r % 2) * (d / 2) + r / 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row map is `hf::unpermute_rows`'s, row for row.
    #[test]
    fn rows_go_where_unpermute_rows_puts_them() {
        for (heads, rows) in [(2usize, 8usize), (3, 12), (1, 4)] {
            let src: Vec<usize> = (0..rows).collect();
            let mut want = vec![0; rows];
            super::super::hf::unpermute_rows(&src, &mut want, heads, 1).unwrap();
            let to = unpermute(Some(heads), rows);
            let mut got = vec![0; rows];
            for g in 0..rows {
                got[to(g)] = src[g];
            }
            assert_eq!(got, want, "{heads} heads, {rows} rows");
        }
    }
}

#[cfg(test)]
mod convert_tests {
    use super::*;
    use crate::gguf::testutil::{tiny_model, write_temp};

    /// A tensor copied as another type than the file's is its f32 conversion quantized to
    /// that type, row for row (Q and K rows un-permuted as the f32 copy puts them).
    #[test]
    fn a_tensor_copied_as_another_type_is_its_f32_copy_quantized() {
        let (_tmp, gguf) = write_temp(&tiny_model("llama", true).to_bytes());
        let cache = tempfile::tempdir().unwrap();
        let dir =
            crate::gguf::cache::model_dir_in(cache.path(), &gguf, "--init", &mut |_| {}).unwrap();
        let spec = crate::ckpt::load_spec(&dir).unwrap();
        let layout = crate::model::ParamLayout::new(&spec);
        let src = BaseSource::open(&gguf).unwrap();
        let ty = GgmlType::Q8_0;
        let mut checked = 0;
        for t in layout.tensors.iter().filter(|t| t.shape.len() == 2) {
            if src.types()[&t.name] == ty {
                continue;
            }
            let mut f = vec![0u8; 4 * t.range.len()];
            src.copy(t, None, &mut f).unwrap();
            let f: Vec<f32> = f
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let n = ty.bytes_for(t.range.len() as u64).unwrap() as usize;
            let (mut want, mut got) = (vec![0u8; n], vec![0u8; n]);
            crate::gguf::quantize::quantize(ty, &f, &mut want).unwrap();
            src.copy(t, Some(ty), &mut got).unwrap();
            assert!(got == want, "{}", t.name);
            checked += 1;
        }
        assert!(checked >= 8, "{checked} tensors checked");
    }
}

#[cfg(test)]
mod part_tests {
    use super::*;
    use crate::gguf::testutil::{tiny_model, write_temp};
    use crate::ir::{ModelPart, TensorSplit};
    use crate::model::ParamLayout;

    /// `bytes` of `n` values stored as `storage`, decoded to f32.
    fn decoded(storage: Option<GgmlType>, bytes: &[u8], n: usize) -> Vec<f32> {
        let mut v = vec![0f32; n];
        match storage {
            Some(ty) => dequant::dequantize(ty, bytes, &mut v).unwrap(),
            None => {
                for (x, b) in v.iter_mut().zip(bytes.chunks_exact(4)) {
                    *x = f32::from_le_bytes(b.try_into().unwrap());
                }
            }
        }
        v
    }

    /// A tensor rank's part of each tensor (`--tp 2`), copied as the file's blocks, as q8_0
    /// converted from them, or as f32, holds the values of the whole tensor's copy at the
    /// part's places, bit for bit: Llama's Q and K rows un-permuted, row-parallel columns of
    /// whole blocks, Qwen2's cut biases.
    #[test]
    fn a_part_holds_the_whole_copys_values_at_its_places() {
        for arch in ["llama", "qwen2"] {
            let mut w = tiny_model(arch, false);
            for l in 0..2u64 {
                let name = format!("blk.{l}.ffn_down.weight");
                w.remove_tensor(&name);
                w.random_tensor(&name, &[256, 32], GgmlType::Q8_0, 500 + l);
            }
            let (_tmp, gguf) = write_temp(&w.to_bytes());
            let cache = tempfile::tempdir().unwrap();
            let dir = crate::gguf::cache::model_dir_in(cache.path(), &gguf, "--init", &mut |_| {})
                .unwrap();
            let spec = crate::ckpt::load_spec(&dir).unwrap();
            let whole = ParamLayout::new(&spec);
            let src = BaseSource::open(&gguf).unwrap();
            let types = src.types();
            let mut checked = 0;
            for rank in 0..2 {
                let part = ParamLayout::part(&spec, ModelPart::tensor(TensorSplit::new(2, rank)));
                for t in part.tensors.iter().filter(|t| t.part.is_some()) {
                    let w = whole.get(&t.name).unwrap();
                    let file = types[&t.name];
                    let cols = *t.shape.last().unwrap();
                    let mut storages = vec![None];
                    for ty in [file, GgmlType::Q8_0] {
                        if t.shape.len() == 2 && ty.bytes_for(cols as u64).is_some() {
                            storages.push(Some(ty));
                        }
                    }
                    for storage in storages {
                        let size = |n: usize| match storage {
                            Some(ty) => ty.bytes_for(n as u64).unwrap() as usize,
                            None => 4 * n,
                        };
                        let (mut a, mut b) = (
                            vec![0u8; size(t.range.len())],
                            vec![0u8; size(w.range.len())],
                        );
                        src.copy(t, storage, &mut a).unwrap();
                        src.copy(w, storage, &mut b).unwrap();
                        let (a, b) = (
                            decoded(storage, &a, t.range.len()),
                            decoded(storage, &b, w.range.len()),
                        );
                        let runs = t.part.as_ref().unwrap().runs();
                        let want: Vec<f32> =
                            runs.flat_map(|(at, n)| b[at..at + n].to_vec()).collect();
                        let same = a.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(
                            same && a.len() == want.len(),
                            "{arch} rank {rank} {} as {storage:?}",
                            t.name
                        );
                        checked += 1;
                    }
                }
            }
            assert!(checked >= 20, "{arch}: {checked} parts checked");
        }
    }
}
