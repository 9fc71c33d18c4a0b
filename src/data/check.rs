//! Does the prepared data suit the model? Token ids only mean something under the tokenizer
//! that made them: data prepared with another tokenizer than the model's trains the model on
//! noise (silently, when the ids happen to fit its vocabulary). [`check_tokenizer`] refuses it
//! before any work starts, and [`check_vocabulary`] ids beyond the model's vocabulary.

use crate::data::loader::Meta;
use crate::data::tokenizer::{GPT2_HASH, TokenizerId};
use anyhow::{Result, bail};
use std::path::Path;

/// Refuses data (`meta.json` of `data_dir`) made with another tokenizer than `model`'s,
/// naming both (name and hash prefix) and saying how to prepare matching data.
pub fn check_tokenizer(model: &TokenizerId, data: &Meta, data_dir: &Path) -> Result<()> {
    if data.tokenizer_hash == model.hash {
        return Ok(());
    }
    let data_id = TokenizerId {
        name: data.tokenizer.clone(),
        hash: data.tokenizer_hash.clone(),
        vocab_size: data.vocab_size,
        eot: data.eot,
    };
    let arg = if model.hash == GPT2_HASH {
        "gpt2"
    } else {
        "<the model's directory, holding its tokenizer.json>"
    };
    bail!(
        "--data {}: prepared with tokenizer {}, but the model uses tokenizer {}; the token ids \
         would mean other text to the model. Re-run `memwall prepare <FILES> --tokenizer {arg} \
         --out DIR` and pass --data DIR",
        data_dir.display(),
        data_id.describe(),
        model.describe()
    )
}

/// Refuses data (`meta.json` of `data_dir`) whose token ids reach beyond a model's
/// vocabulary of `vocab_size`.
pub fn check_vocabulary(data: &Meta, vocab_size: usize, data_dir: &Path) -> Result<()> {
    if data.vocab_size > vocab_size {
        bail!(
            "--data {}: prepared for a vocabulary of {} tokens but the model has vocab_size {}",
            data_dir.display(),
            data.vocab_size,
            vocab_size
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::prepare::{PrepareOptions, prepare, prepare_with};
    use crate::data::tokenizer::Tokenizer;
    use crate::data::tokenizer::fixture::Spec;
    use crate::data::{DataSet, GPT2_VOCAB};

    fn prepared(dir: &Path, tok: Option<&Tokenizer>) -> DataSet {
        std::fs::create_dir_all(dir).unwrap();
        let src = dir.join("src.txt");
        std::fs::write(&src, "the cat and the hat sat on the mat. ".repeat(20)).unwrap();
        let opts = PrepareOptions {
            inputs: vec![src],
            out: dir.join("data"),
            val_fraction: 0.1,
        };
        match tok {
            Some(t) => prepare_with(&opts, t).unwrap(),
            None => prepare(&opts).unwrap(),
        };
        DataSet::open(&dir.join("data")).unwrap()
    }

    #[test]
    fn same_tokenizer_passes_another_is_refused_naming_both() {
        let tmp = tempfile::tempdir().unwrap();
        let smol =
            Tokenizer::from_file(Spec::byte_level().write(&tmp.path().join("smol"))).unwrap();
        let gpt2_data = prepared(&tmp.path().join("g"), None);
        let hf_data = prepared(&tmp.path().join("h"), Some(&smol));

        let gpt2 = TokenizerId::gpt2();
        check_tokenizer(&gpt2, &gpt2_data.meta, &gpt2_data.dir).unwrap();
        check_tokenizer(&smol.id(), &hf_data.meta, &hf_data.dir).unwrap();
        // The same tokenizer.json copied elsewhere is the same tokenizer.
        let copy =
            Tokenizer::from_file(Spec::byte_level().write(&tmp.path().join("copy"))).unwrap();
        check_tokenizer(&copy.id(), &hf_data.meta, &hf_data.dir).unwrap();

        // A GPT-2 model on the fixture's data.
        let e = check_tokenizer(&gpt2, &hf_data.meta, &hf_data.dir)
            .unwrap_err()
            .to_string();
        let hf_hash = &smol.id().hash[..12];
        assert!(
            e.contains(&format!("hf:smol (hash {hf_hash})"))
                && e.contains("gpt2-r50k_base (hash r50k_base)")
                && e.contains("--tokenizer gpt2")
                && e.contains(&hf_data.dir.display().to_string()),
            "{e}"
        );
        // The fixture's model on GPT-2 data; and on data of a tokenizer that differs by one merge.
        let e = check_tokenizer(&smol.id(), &gpt2_data.meta, &gpt2_data.dir)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("hf:smol") && e.contains("gpt2-r50k_base") && e.contains("memwall prepare"),
            "{e}"
        );
        let other = Spec {
            merges: crate::data::tokenizer::fixture::MERGES[..9].to_vec(),
            ..Spec::byte_level()
        };
        let other = Tokenizer::from_file(other.write(&tmp.path().join("smol2"))).unwrap();
        let e = check_tokenizer(&other.id(), &hf_data.meta, &hf_data.dir)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hf:smol2") && e.contains("hf:smol "), "{e}");
        assert_eq!(gpt2_data.meta.vocab_size, GPT2_VOCAB);
    }
}
