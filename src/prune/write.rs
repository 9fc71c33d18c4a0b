//! Writing the pruned model: its config, its weights cut from the original's files as they
//! are written (a tensor a piece of rows at a time, in the original's dtype, [`Cut`] lent to
//! the safetensors writer), the tokenizer and chat template files, and `prune.json`, into a
//! temporary sibling of the output that is renamed into place: a prune that stops leaves no
//! partial model, and writing one holds a few pieces of it, never the whole.

use super::cut::{Cut, Read};
use crate::ckpt::{self, Lend, OutData};
use crate::model::{ModelSpec, ParamLayout};
use anyhow::{Context, Result, bail};
use std::cell::RefCell;
use std::ops::Range;
use std::path::Path;

/// The report `prune` writes beside the pruned model.
pub const REPORT_FILE: &str = "prune.json";

/// The pruned parameters (`layout`'s order) lent as they are cut from the original's
/// (`read`), rounded to bf16 where `bf16`.
struct Lent<'a, 'b> {
    cut: RefCell<Cut<'a>>,
    read: RefCell<&'a mut Read<'b>>,
    layout: &'a ParamLayout,
    bf16: bool,
}

impl Lend for Lent<'_, '_> {
    fn elem(&self) -> OutData<'static> {
        match self.bf16 {
            true => OutData::Bf16(&[]),
            false => OutData::F32(&[]),
        }
    }

    fn len(&self) -> usize {
        self.layout.total
    }

    fn lend(
        &self,
        range: Range<usize>,
        put: &mut dyn FnMut(OutData<'_>) -> Result<()>,
    ) -> Result<()> {
        let (mut cut, mut read) = (self.cut.borrow_mut(), self.read.borrow_mut());
        let mut at = range.start;
        let mut rounded = Vec::new();
        let inside = (self.layout.tensors.iter())
            .filter(|t| range.start <= t.range.start && t.range.end <= range.end);
        for t in inside {
            if t.range.start != at {
                break;
            }
            cut.tensor(t, *read, &mut |piece| match self.bf16 {
                true => {
                    rounded.clear();
                    rounded.extend(piece.iter().map(|&x| half::bf16::from_f32(x)));
                    put(OutData::Bf16(&rounded))
                }
                false => put(OutData::F32(piece)),
            })?;
            at = t.range.end;
        }
        if at != range.end {
            bail!("internal error: parameters {range:?} are not whole tensors of the pruned model");
        }
        Ok(())
    }
}

/// Writes the pruned model `spec` (`layout`) cut by `cut` from the parameters of the
/// original in `model` (`read`), with its tokenizer files and `report` as
/// [`REPORT_FILE`], to `out`.
pub fn write(
    (model, out): (&Path, &Path),
    (spec, layout): (&ModelSpec, &ParamLayout),
    (cut, read): (Cut<'_>, &mut Read<'_>),
    report: &[u8],
) -> Result<()> {
    let params = Lent {
        cut: RefCell::new(cut),
        read: RefCell::new(read),
        layout,
        bf16: ckpt::adapter::stored_as_bf16(model),
    };
    let save = ckpt::SaveOptions {
        tokenizer_dir: Some(model),
        ..Default::default()
    };
    let tmp = crate::util::atomic_dir::TempDir::create_for(out)?;
    ckpt::save_model_lent(&tmp.path, spec, layout, &params, &save)?;
    crate::util::atomic::write_file(&tmp.path.join(REPORT_FILE), report)
        .with_context(|| format!("writing {REPORT_FILE}"))?;
    ckpt::adapter::check_new_out_dir(out)?;
    tmp.publish(out)
}
