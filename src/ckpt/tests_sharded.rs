//! Tests of sharded weights and tokenizer files: shards written by the greedy rule with an
//! exact index, loaded back bitwise (GPT-2, tied and untied Llama), every class of bad index
//! or shard, `latest_checkpoint` on sharded checkpoints, stale files of re-exports, and the
//! tokenizer files copied into checkpoints and exports.

use super::shards::{is_shard_name, plan_shards};
use super::tests::{bits, err_text, setup, small_spec, state};
use super::*;
use crate::ir::{Moments, MomentsMut};
use crate::model::{ModelSpec, ParamLayout};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// Shard files in `dir`, sorted.
fn shard_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| is_shard_name(n))
        .collect();
    v.sort();
    v
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

/// Checks that `dir` holds the weights of `layout` as shards of at most `max` bytes cut by
/// the greedy rule, with an exact index; returns the number of shards.
///
/// The partition is pinned down without re-running the writer's algorithm: the shards hold
/// the layout's tensors consecutively in layout order, each shard holds at most `max` bytes
/// unless it is one tensor, and no shard could have taken the next shard's first tensor.
fn check_index(dir: &Path, layout: &ParamLayout, max: u64) -> usize {
    assert!(!dir.join(MODEL_FILE).exists(), "sharded: no {MODEL_FILE}");
    let index = read_json(&dir.join(MODEL_INDEX_FILE));
    let total: u64 = layout
        .tensors
        .iter()
        .map(|t| 4 * t.range.len() as u64)
        .sum();
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(
        index.as_object().unwrap().len(),
        2,
        "metadata and weight_map only"
    );
    let map: BTreeMap<String, String> =
        serde_json::from_value(index["weight_map"].clone()).unwrap();
    let names: BTreeSet<&str> = layout.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        map.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        names,
        "weight_map names exactly the layout's tensors"
    );
    let shards = shard_files(dir);
    let n = shards.len();
    let expect_names: Vec<String> = (1..=n)
        .map(|k| format!("model-{k:05}-of-{n:05}.safetensors"))
        .collect();
    assert_eq!(shards, expect_names);
    // Each shard's content, in layout order.
    let mut by_shard: Vec<Vec<(String, u64)>> = Vec::new();
    for s in &shards {
        let bytes = fs::read(dir.join(s)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut held: Vec<(usize, String, u64)> = st
            .tensors()
            .into_iter()
            .map(|(name, t)| {
                assert_eq!(map[&name], *s, "{name}: the map names the shard holding it");
                assert_eq!(t.dtype(), Dtype::F32);
                let i = layout.tensors.iter().position(|x| x.name == name).unwrap();
                (i, name, t.data().len() as u64)
            })
            .collect();
        held.sort();
        by_shard.push(held.into_iter().map(|(_, n, b)| (n, b)).collect());
    }
    let order: Vec<&str> = by_shard.iter().flatten().map(|(n, _)| n.as_str()).collect();
    let layout_order: Vec<&str> = layout.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        order, layout_order,
        "shards hold the tensors in layout order"
    );
    for (k, shard) in by_shard.iter().enumerate() {
        let bytes: u64 = shard.iter().map(|(_, b)| b).sum();
        assert!(
            bytes <= max || shard.len() == 1,
            "shard {k}: {bytes} bytes over {max} with {} tensors",
            shard.len()
        );
        if let Some(next) = by_shard.get(k + 1) {
            assert!(
                bytes + next[0].1 > max,
                "shard {k} ({bytes} bytes) had room for {} ({} bytes)",
                next[0].0,
                next[0].1
            );
        }
    }
    n
}

#[test]
fn shards_are_cut_greedily_in_order() {
    assert_eq!(
        plan_shards(&[3, 3, 3, 10, 1, 1, 6], 6),
        vec![0..2, 2..3, 3..4, 4..6, 6..7]
    );
    assert_eq!(plan_shards(&[6, 6], 6), vec![0..1, 1..2]);
    assert_eq!(plan_shards(&[1, 2, 3], 100), vec![0..3]);
    assert_eq!(plan_shards(&[], 5), Vec::<std::ops::Range<usize>>::new());
    assert!(is_shard_name("model-00001-of-00004.safetensors"));
    assert!(is_shard_name("model-123456-of-123456.safetensors"));
    for n in [
        "model.safetensors",
        "model-1-of-4.safetensors",
        "model-00001-of-00004.safetensors.tmp",
        "optimizer-00001-of-00004.safetensors",
        "model-0000a-of-00004.safetensors",
    ] {
        assert!(!is_shard_name(n), "{n}");
    }
}

#[test]
fn sharded_checkpoint_round_trips_bitwise() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let run = tempfile::tempdir().unwrap();
    // An earlier single-file checkpoint, then a sharded one.
    let first = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &state(&spec, 1),
    )
    .unwrap();
    let opts = SaveOptions {
        max_shard_bytes: 4096,
        tokenizer_dir: None,
        chat_template: None,
        adapter: None,
    };
    let st = state(&spec, 2);
    let moments = Moments::F32 { m: &m, v: &v };
    let dir = save_checkpoint_with(run.path(), &spec, &layout, &p, &moments, &st, &opts).unwrap();
    let n = check_index(&dir, &layout, 4096);
    // wte (97 x 16 x 4 = 6208 bytes) alone, the rest in several more.
    assert!(n >= 4, "{n} shards");
    let index = read_json(&dir.join(MODEL_INDEX_FILE));
    assert_eq!(
        index["weight_map"]["transformer.wte.weight"],
        format!("model-00001-of-{n:05}.safetensors")
    );
    for f in CHECKPOINT_FILES {
        assert!(dir.join(f).is_file(), "{f}");
    }

    let mut p2 = vec![1f32; layout.total];
    load_params(&dir, &layout, &mut p2).unwrap();
    assert_eq!(bits(&p2), bits(&p));
    let (mut m2, mut v2) = (vec![0f32; layout.total], vec![0f32; layout.total]);
    let mm = MomentsMut::F32 {
        m: &mut m2,
        v: &mut v2,
    };
    assert_eq!(load_trainer_state(&dir, &layout, mm).unwrap(), st);
    assert_eq!((bits(&m2), bits(&v2)), (bits(&m), bits(&v)));

    // latest_checkpoint takes a complete sharded checkpoint, and skips it once a shard is gone.
    assert_eq!(latest_checkpoint(run.path()).unwrap(), Some(dir.clone()));
    fs::remove_file(dir.join(&shard_files(&dir)[1])).unwrap();
    assert_eq!(latest_checkpoint(run.path()).unwrap(), Some(first.clone()));
    fs::remove_file(dir.join(MODEL_INDEX_FILE)).unwrap();
    assert_eq!(latest_checkpoint(run.path()).unwrap(), Some(first));
}

#[test]
fn gpt2_tiny_export_shards_and_replaces_stale_files() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let layout = ParamLayout::new(&spec);
    let mut p = vec![0f32; layout.total];
    layout.init(&mut p, 3);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("export");
    let max = 2_000_000;
    let sharded = SaveOptions {
        max_shard_bytes: max,
        tokenizer_dir: None,
        chat_template: None,
        adapter: None,
    };
    save_model_with(&out, &spec, &layout, &p, &sharded).unwrap();
    let n = check_index(&out, &layout, max);
    assert!(n >= 3, "{n} shards");
    let mut q = vec![0f32; layout.total];
    load_params(&out, &layout, &mut q).unwrap();
    assert_eq!(bits(&q), bits(&p));
    let names = |dir: &Path| -> BTreeSet<String> {
        fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect()
    };
    assert_eq!(
        names(&out).len(),
        n + 2,
        "shards, index, config.json: {:?}",
        names(&out)
    );

    // Re-exported as one file: the shards and the index go.
    p[7] += 1.0;
    save_model(&out, &spec, &layout, &p).unwrap();
    assert_eq!(
        names(&out),
        BTreeSet::from([CONFIG_FILE.to_string(), MODEL_FILE.to_string()])
    );
    load_params(&out, &layout, &mut q).unwrap();
    assert_eq!(bits(&q), bits(&p));

    // Sharded again (other shard count): model.safetensors goes.
    p[7] += 1.0;
    let other = SaveOptions {
        max_shard_bytes: 3 * max,
        tokenizer_dir: None,
        chat_template: None,
        adapter: None,
    };
    save_model_with(&out, &spec, &layout, &p, &other).unwrap();
    let n2 = check_index(&out, &layout, 3 * max);
    assert_ne!(n2, n);
    assert_eq!(names(&out).len(), n2 + 2, "{:?}", names(&out));
    load_params(&out, &layout, &mut q).unwrap();
    assert_eq!(bits(&q), bits(&p));
}

#[test]
fn llama_tied_and_untied_round_trip_sharded() {
    let preset = ModelSpec::preset("llama-tiny").unwrap();
    for tied in [true, false] {
        let spec = ModelSpec {
            tied_embeddings: tied,
            ..preset.clone()
        };
        spec.validate().unwrap();
        let layout = ParamLayout::new(&spec);
        let mut p = vec![0f32; layout.total];
        layout.init(&mut p, 5);
        let tmp = tempfile::tempdir().unwrap();
        let max = 1_000_000;
        let opts = SaveOptions {
            max_shard_bytes: max,
            tokenizer_dir: None,
            chat_template: None,
            adapter: None,
        };
        save_model_with(tmp.path(), &spec, &layout, &p, &opts).unwrap();
        let n = check_index(tmp.path(), &layout, max);
        assert!(n >= 3, "tied {tied}: {n} shards");
        let index = read_json(&tmp.path().join(MODEL_INDEX_FILE));
        let has_head = index["weight_map"].get("lm_head.weight").is_some();
        assert_eq!(has_head, !tied, "the LM head is stored only when untied");
        let total: u64 = 4 * layout.total as u64;
        assert_eq!(
            index["metadata"]["total_size"], total,
            "a tied head counted once"
        );
        assert!(load_spec(tmp.path()).unwrap().same_dims(&spec));
        let mut q = vec![0f32; layout.total];
        load_params(tmp.path(), &layout, &mut q).unwrap();
        assert_eq!(bits(&q), bits(&p), "tied {tied}");
    }
}

/// A GPT-2 export in shards of at most 4096 bytes, its layout and parameters.
fn sharded_export(dir: &Path) -> (ParamLayout, Vec<f32>) {
    let spec = small_spec(97);
    let (layout, p, _, _) = setup(&spec);
    let opts = SaveOptions {
        max_shard_bytes: 4096,
        tokenizer_dir: None,
        chat_template: None,
        adapter: None,
    };
    save_model_with(dir, &spec, &layout, &p, &opts).unwrap();
    (layout, p)
}

/// Rewrites shard `name` of `dir` with the safetensors crate: its tensors passed through
/// `edit` (which may change shapes), plus `extra`.
fn rewrite_shard(
    dir: &Path,
    name: &str,
    edit: impl Fn(&str, Vec<usize>) -> Vec<usize>,
    extra: Vec<(String, Vec<usize>, Vec<u8>)>,
) {
    let bytes = fs::read(dir.join(name)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let shape = edit(&n, t.shape().to_vec());
            (n, shape, t.data().to_vec())
        })
        .collect();
    owned.extend(extra);
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(
        views.iter().map(|(n, v)| (n.clone(), v)),
        None,
        &dir.join(name),
    )
    .unwrap();
}

/// Edits the index's JSON.
fn edit_index(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join(MODEL_INDEX_FILE);
    let mut v = read_json(&path);
    edit(&mut v);
    fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

/// Loads `dir` expecting an error; checks that the destination stayed untouched.
fn load_err(dir: &Path, layout: &ParamLayout) -> String {
    let mut q = vec![0.5f32; layout.total];
    let e = err_text(load_params(dir, layout, &mut q));
    assert!(q.iter().all(|x| *x == 0.5), "params must be untouched: {e}");
    e
}

#[test]
fn bad_index_or_shards_are_errors_naming_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let fresh = |case: &str| {
        let dir = tmp.path().join(case);
        let (layout, p) = sharded_export(&dir);
        (dir, layout, p)
    };

    // A shard the index names is missing.
    let (dir, layout, _) = fresh("missing-shard");
    let shards = shard_files(&dir);
    fs::remove_file(dir.join(&shards[1])).unwrap();
    let index = dir.join(MODEL_INDEX_FILE).display().to_string();
    let e = load_err(&dir, &layout);
    assert!(
        e.contains(&index) && e.contains(&shards[1]) && e.contains("does not exist"),
        "{e}"
    );

    // A shard that is truncated: named, with the index.
    let (dir, layout, _) = fresh("truncated-shard");
    let shard = dir.join(&shard_files(&dir)[2]);
    let bytes = fs::read(&shard).unwrap();
    fs::write(&shard, &bytes[..bytes.len() - 4]).unwrap();
    let e = load_err(&dir, &layout);
    let index = dir.join(MODEL_INDEX_FILE).display().to_string();
    assert!(
        e.contains(&shard.display().to_string()) && e.contains(&index) && e.contains("truncated"),
        "{e}"
    );

    // The map places a tensor in a shard that lacks it.
    let (dir, layout, _) = fresh("wrong-shard");
    let first = shard_files(&dir)[0].clone();
    edit_index(&dir, |v| {
        v["weight_map"]["transformer.ln_f.bias"] = Value::from(first.clone());
    });
    let e = load_err(&dir, &layout);
    assert!(
        e.contains(&format!("transformer.ln_f.bias (mapped to {first})"))
            && e.contains("not in their shard")
            && e.contains(MODEL_INDEX_FILE),
        "{e}"
    );

    // A parameter in a shard that the map does not list.
    let (dir, layout, _) = fresh("unlisted");
    let holder = read_json(&dir.join(MODEL_INDEX_FILE))["weight_map"]["transformer.h.1.ln_2.bias"]
        .as_str()
        .unwrap()
        .to_string();
    edit_index(&dir, |v| {
        v["weight_map"]
            .as_object_mut()
            .unwrap()
            .remove("transformer.h.1.ln_2.bias");
    });
    let e = load_err(&dir, &layout);
    assert!(
        e.contains(&format!("transformer.h.1.ln_2.bias (in {holder})"))
            && e.contains("not in the weight_map")
            && e.contains(MODEL_INDEX_FILE),
        "{e}"
    );

    // Not JSON; no weight_map; an empty one; a value that is no file name; a path.
    for (case, text, expect) in [
        ("not-json", "{ \"weight_map\": ", "not valid JSON"),
        (
            "no-map",
            r#"{"metadata": {"total_size": 1}}"#,
            "no 'weight_map'",
        ),
        (
            "empty-map",
            r#"{"weight_map": {}}"#,
            "'weight_map' is empty",
        ),
        (
            "not-a-name",
            r#"{"weight_map": {"transformer.wte.weight": 3}}"#,
            "expected a shard file name",
        ),
        (
            "a-path",
            r#"{"weight_map": {"transformer.wte.weight": "../model-00001-of-00009.safetensors"}}"#,
            "not a file name",
        ),
    ] {
        let (dir, layout, _) = fresh(case);
        fs::write(dir.join(MODEL_INDEX_FILE), text).unwrap();
        let e = load_err(&dir, &layout);
        let index = dir.join(MODEL_INDEX_FILE).display().to_string();
        assert!(e.contains(&index) && e.contains(expect), "{case}: {e}");
    }

    // A wrong shape names the tensor and the shard holding it.
    let (dir, layout, _) = fresh("wrong-shape");
    let name = "transformer.h.0.attn.c_attn.weight";
    let holder = read_json(&dir.join(MODEL_INDEX_FILE))["weight_map"][name]
        .as_str()
        .unwrap()
        .to_string();
    rewrite_shard(
        &dir,
        &holder,
        |n, s| if n == name { vec![s[1], s[0]] } else { s },
        vec![],
    );
    let e = load_err(&dir, &layout);
    assert!(
        e.contains(&format!(
            "{name} (expected shape [16, 48], found [48, 16]) in {holder}"
        )),
        "{e}"
    );
}

#[test]
fn unlisted_non_parameters_are_ignored_and_a_single_file_wins() {
    let tmp = tempfile::tempdir().unwrap();
    // Known non-parameters in a shard but not in the map: GPT-2's attention-mask buffer and
    // the tied LM head (equal to wte). They load as if absent.
    let dir = tmp.path().join("extras");
    let (layout, p) = sharded_export(&dir);
    let last = shard_files(&dir).last().unwrap().clone();
    let mask: Vec<u8> = vec![0u8; 4 * 32 * 32];
    let wte: Vec<u8> = p[layout.range("transformer.wte.weight")]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    rewrite_shard(
        &dir,
        &last,
        |_, s| s,
        vec![
            ("transformer.h.0.attn.bias".into(), vec![1, 1, 32, 32], mask),
            ("lm_head.weight".into(), vec![97, 16], wte),
        ],
    );
    let mut q = vec![0f32; layout.total];
    load_params(&dir, &layout, &mut q).unwrap();
    assert_eq!(bits(&q), bits(&p));

    // A directory with both forms loads model.safetensors (here of other values).
    let spec = small_spec(97);
    let mut p2 = p.clone();
    p2.iter_mut().for_each(|x| *x *= 2.0);
    let single = tmp.path().join("single");
    save_model(&single, &spec, &layout, &p2).unwrap();
    fs::copy(single.join(MODEL_FILE), dir.join(MODEL_FILE)).unwrap();
    load_params(&dir, &layout, &mut q).unwrap();
    assert_eq!(bits(&q), bits(&p2));
}

/// A tokenizer directory with three of the four files (no special_tokens_map.json) and an
/// unrelated file; returns the contents by name.
fn tokenizer_source(dir: &Path) -> BTreeMap<&'static str, Vec<u8>> {
    fs::create_dir_all(dir).unwrap();
    // Larger than one copy buffer, with non-ASCII text.
    let big: String = (0..20_000)
        .map(|i| format!("\"tok{i}\u{0120}é\": {i},"))
        .collect();
    let files = BTreeMap::from([
        (
            "tokenizer.json",
            format!("{{\"model\": {{{big}}}}}").into_bytes(),
        ),
        (
            "tokenizer_config.json",
            b"{\"model_max_length\": 2048}\n".to_vec(),
        ),
        ("generation_config.json", b"{\"bos_token_id\": 1}".to_vec()),
    ]);
    for (n, b) in &files {
        fs::write(dir.join(n), b).unwrap();
    }
    fs::write(dir.join("vocab.txt"), b"not copied").unwrap();
    files
}

#[test]
fn tokenizer_files_are_copied_into_checkpoints_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf-model");
    let files = tokenizer_source(&src);
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let opts = SaveOptions {
        max_shard_bytes: 4096,
        tokenizer_dir: Some(&src),
        chat_template: None,
        adapter: None,
    };
    let run = tmp.path().join("run");
    let moments = Moments::F32 { m: &m, v: &v };
    let st = state(&spec, 3);
    let dir = save_checkpoint_with(&run, &spec, &layout, &p, &moments, &st, &opts).unwrap();
    for (n, b) in &files {
        assert_eq!(&fs::read(dir.join(n)).unwrap(), b, "{n}");
    }
    let n = check_index(&dir, &layout, 4096);
    let listed: BTreeSet<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    // No special_tokens_map.json (absent in the source), no vocab.txt, no temporaries.
    assert_eq!(
        listed.len(),
        n + 1 + CHECKPOINT_FILES.len() + files.len(),
        "{listed:?}"
    );
    assert!(latest_checkpoint(&run).unwrap().is_some());

    let export = tmp.path().join("export");
    save_model_with(&export, &spec, &layout, &p, &opts).unwrap();
    for (n, b) in &files {
        assert_eq!(&fs::read(export.join(n)).unwrap(), b, "{n}");
    }

    let copied = copy_tokenizer_files(&src, &tmp.path().join("export")).unwrap();
    assert_eq!(
        copied,
        [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json"
        ]
    );

    // A tokenizer directory that does not exist: the checkpoint is not written.
    let gone = tmp.path().join("no-such-model");
    let bad = SaveOptions {
        max_shard_bytes: 4096,
        tokenizer_dir: Some(&gone),
        chat_template: None,
        adapter: None,
    };
    let st = state(&spec, 4);
    let e = err_text(save_checkpoint_with(
        &run, &spec, &layout, &p, &moments, &st, &bad,
    ));
    assert!(
        e.contains(&gone.display().to_string()) && e.contains("no such directory"),
        "{e}"
    );
    assert_eq!(latest_checkpoint(&run).unwrap(), Some(dir));
    assert_eq!(
        fs::read_dir(run.join("checkpoints")).unwrap().count(),
        1,
        "no temporary left"
    );
}
