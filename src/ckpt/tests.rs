//! Tests of the checkpoint layer: bitwise round trips, Hugging Face names and shapes, naming
//! variants and dtypes, every class of bad input, `latest_checkpoint`, and a full disk.

use super::*;
use crate::ir::{Moments, MomentsMut};
use crate::model::{ModelSpec, ParamLayout};
use crate::run_dir::{CHECKPOINTS_DIR, RunDir};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::fs;
use std::path::Path;

/// A small GPT-2: V=97, maxT=32, C=16, L=2, NH=2.
pub(super) fn small_spec(vocab: usize) -> ModelSpec {
    let s = crate::model::gpt2::spec("small", [vocab, 32, 16, 2, 2]);
    s.validate().unwrap();
    s
}

/// Layout, initialised params and moments with awkward bit patterns (-0.0, negative and
/// positive subnormals, the largest f32) that only a bitwise copy preserves. (NaN and
/// infinity are refused on load: `non_finite_weights_and_moments_are_refused`.)
pub(super) fn setup(spec: &ModelSpec) -> (ParamLayout, Vec<f32>, Vec<f32>, Vec<f32>) {
    let layout = ParamLayout::new(spec);
    let mut p = vec![0f32; layout.total];
    layout.init(&mut p, 7);
    let mut m = vec![0f32; layout.total];
    layout.init(&mut m, 8);
    let mut v: Vec<f32> = m.iter().map(|x| x * x + 1e-30).collect();
    m[0] = -0.0;
    m[1] = f32::from_bits(0x8000_1234);
    m[2] = f32::from_bits(1);
    v[3] = f32::MAX;
    (layout, p, m, v)
}

pub(super) fn state(spec: &ModelSpec, step: u64) -> TrainerState {
    TrainerState {
        step,
        data_position: step * 4 + 1,
        seed: 1337,
        rng_state: 0xdead_beef_0123_4567,
        model: spec.to_hf_config(),
        train: serde_json::json!({ "lr": 6e-4, "batch": 4, "seq": 64 }),
        memwall_version: "0.1.0".into(),
        loss_scale: Some(LossScaleState {
            scale: 1024.0,
            clean_steps: 7,
        }),
    }
}

pub(super) fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|f| f.to_bits()).collect()
}

pub(super) fn err_text<T>(r: anyhow::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => {
            let text = format!("{e:#}");
            eprintln!("error as reported: {text}"); // visible with --nocapture
            text
        }
    }
}

/// Raw little-endian bytes of f32 data.
pub(super) fn le_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Writes `model.safetensors` into `dir` with the safetensors crate (not our writer): each
/// layout tensor under `rename(name)` (None drops it) with `shape(name, shape)`, F32.
fn write_custom(
    dir: &Path,
    layout: &ParamLayout,
    p: &[f32],
    rename: impl Fn(&str) -> Option<String>,
    shape: impl Fn(&str, &[usize]) -> Vec<usize>,
    extra: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
) {
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = layout
        .tensors
        .iter()
        .filter_map(|t| {
            rename(&t.name).map(|n| {
                (
                    n,
                    Dtype::F32,
                    shape(&t.name, &t.shape),
                    le_bytes(&p[t.range.clone()]),
                )
            })
        })
        .collect();
    owned.extend(extra);
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    fs::create_dir_all(dir).unwrap();
    safetensors::serialize_to_file(
        views.iter().map(|(n, v)| (n.clone(), v)),
        None,
        &dir.join(MODEL_FILE),
    )
    .unwrap();
}

#[test]
fn checkpoint_round_trips_bitwise() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let run = tempfile::tempdir().unwrap();
    let st = state(&spec, 42);
    let dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &st,
    )
    .unwrap();
    assert_eq!(dir, run.path().join("checkpoints/step-000042"));
    assert_eq!(dir, RunDir::new(run.path()).checkpoint(42));
    for f in CHECKPOINT_FILES.iter().chain([&MODEL_FILE]) {
        assert!(dir.join(f).is_file(), "{f}");
    }
    assert!(
        !dir.join(MODEL_INDEX_FILE).exists(),
        "not sharded below 5 GB"
    );
    // Only the published directory: no temporary left behind.
    let names: Vec<_> = fs::read_dir(run.path().join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("step-000042")]);

    assert!(load_spec(&dir).unwrap().same_dims(&spec));
    let mut p2 = vec![1f32; layout.total];
    load_params(&dir, &layout, &mut p2).unwrap();
    assert_eq!(bits(&p2), bits(&p));
    let (mut m2, mut v2) = (vec![0f32; layout.total], vec![0f32; layout.total]);
    let st2 = load_trainer_state(
        &dir,
        &layout,
        MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        },
    )
    .unwrap();
    assert_eq!(bits(&m2), bits(&m));
    assert_eq!(bits(&v2), bits(&v));
    assert_eq!(st2, st);
    assert!(st2.model_spec().unwrap().same_dims(&spec));

    // Saving the same step again replaces it.
    let mut p3 = p.clone();
    p3[5] += 1.0;
    save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p3,
        &Moments::F32 { m: &m, v: &v },
        &st,
    )
    .unwrap();
    load_params(&dir, &layout, &mut p2).unwrap();
    assert_eq!(bits(&p2), bits(&p3));
    assert_eq!(
        fs::read_dir(run.path().join("checkpoints"))
            .unwrap()
            .count(),
        1
    );
}

#[test]
fn model_file_has_hf_names_and_shapes() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let run = tempfile::tempdir().unwrap();
    let dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &state(&spec, 1),
    )
    .unwrap();
    let bytes = fs::read(dir.join(MODEL_FILE)).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 2 + 12 * 2 + 2);
    let shape = |n: &str| st.tensor(n).unwrap().shape().to_vec();
    assert_eq!(shape("transformer.wte.weight"), vec![97, 16]);
    assert_eq!(shape("transformer.wpe.weight"), vec![32, 16]);
    assert_eq!(shape("transformer.h.0.attn.c_attn.weight"), vec![16, 48]);
    assert_eq!(shape("transformer.h.0.attn.c_attn.bias"), vec![48]);
    assert_eq!(shape("transformer.h.1.attn.c_proj.weight"), vec![16, 16]);
    assert_eq!(shape("transformer.h.1.mlp.c_fc.weight"), vec![16, 64]);
    assert_eq!(shape("transformer.h.1.mlp.c_proj.weight"), vec![64, 16]);
    assert_eq!(shape("transformer.h.0.ln_1.weight"), vec![16]);
    assert_eq!(shape("transformer.ln_f.bias"), vec![16]);
    assert!(st.tensor("lm_head.weight").is_err());
    for (_, t) in st.tensors() {
        assert_eq!(t.dtype(), Dtype::F32);
    }
    // Data is the parameter slice, little-endian.
    let qkv = layout.get("transformer.h.0.attn.c_attn.weight").unwrap();
    assert_eq!(
        st.tensor(&qkv.name).unwrap().data(),
        le_bytes(&p[qkv.range.clone()]).as_slice()
    );

    let bytes = fs::read(dir.join(OPTIMIZER_FILE)).unwrap();
    let opt = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(opt.len(), 2 * (2 + 12 * 2 + 2));
    assert_eq!(
        opt.tensor("exp_avg.transformer.h.0.attn.c_attn.weight")
            .unwrap()
            .shape(),
        &[16, 48]
    );
    let wte = opt.tensor("exp_avg_sq.transformer.wte.weight").unwrap();
    assert_eq!(
        wte.data(),
        le_bytes(&v[layout.range("transformer.wte.weight")]).as_slice()
    );

    let cfg: serde_json::Value =
        serde_json::from_slice(&fs::read(dir.join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(cfg["n_embd"], 16);
    assert_eq!(cfg["model_type"], "gpt2");
    assert_eq!(cfg["tie_word_embeddings"], true);
}

#[test]
fn gpt2_tiny_model_export_round_trips() {
    let spec = ModelSpec::preset("gpt2-tiny").unwrap();
    let layout = ParamLayout::new(&spec);
    let mut p = vec![0f32; layout.total];
    layout.init(&mut p, 3);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("export");
    save_model(&out, &spec, &layout, &p).unwrap();
    let names: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        names.len(),
        2,
        "only config.json and model.safetensors, no temporaries: {names:?}"
    );
    let bytes = fs::read(out.join(MODEL_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 2 + 12 * 4 + 2);
    assert_eq!(
        st.tensor("transformer.h.3.attn.c_attn.weight")
            .unwrap()
            .shape(),
        &[128, 384]
    );
    assert_eq!(
        st.tensor("transformer.wte.weight").unwrap().shape(),
        &[50257, 128]
    );
    drop(bytes);
    assert_eq!(load_spec(&out).unwrap().n_layer, 4);
    let mut q = vec![0f32; layout.total];
    load_params(&out, &layout, &mut q).unwrap();
    assert_eq!(bits(&q), bits(&p));
    // Re-exporting over an existing export works (atomic replace).
    save_model(&out, &spec, &layout, &q).unwrap();
}

#[test]
fn loads_gpt2model_names_and_skips_buffers() {
    let spec = small_spec(97);
    let (layout, p, _, _) = setup(&spec);
    let dir = tempfile::tempdir().unwrap();
    let mask: Vec<u8> = le_bytes(&vec![1f32; 32 * 32]);
    let masked_bias = le_bytes(&[-1e4f32]);
    let lm_head = le_bytes(&p[layout.range("transformer.wte.weight")]);
    write_custom(
        dir.path(),
        &layout,
        &p,
        |n| Some(n.strip_prefix("transformer.").unwrap().to_string()),
        |_, s| s.to_vec(),
        vec![
            (
                "h.0.attn.bias".into(),
                Dtype::F32,
                vec![1, 1, 32, 32],
                mask.clone(),
            ),
            ("h.1.attn.bias".into(), Dtype::F32, vec![1, 1, 32, 32], mask),
            (
                "h.0.attn.masked_bias".into(),
                Dtype::F32,
                vec![],
                masked_bias,
            ),
            ("lm_head.weight".into(), Dtype::F32, vec![97, 16], lm_head),
        ],
    );
    let bytes = fs::read(dir.path().join(MODEL_FILE)).unwrap();
    assert!(
        SafeTensors::deserialize(&bytes)
            .unwrap()
            .tensor("wte.weight")
            .is_ok()
    );
    let mut q = vec![0f32; layout.total];
    load_params(dir.path(), &layout, &mut q).unwrap();
    assert_eq!(bits(&q), bits(&p));
    let file = safetensors_io::StFile::open(&dir.path().join(MODEL_FILE)).unwrap();
    assert!(
        !load::tied_differs(
            &file,
            "lm_head.weight",
            &layout.tensors[0],
            &q[layout.tensors[0].range.clone()]
        ),
        "identical lm_head must not warn"
    );
    q[layout.range("transformer.wte.weight").end - 1] += 1.0;
    assert!(
        load::tied_differs(
            &file,
            "lm_head.weight",
            &layout.tensors[0],
            &q[layout.tensors[0].range.clone()]
        ),
        "a differing lm_head must warn"
    );
}

#[test]
fn loads_f16_and_bf16_converting() {
    let spec = small_spec(97);
    let (layout, p, _, _) = setup(&spec);
    for dtype in [Dtype::F16, Dtype::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let (enc, expect): (Vec<u8>, Vec<f32>) = match dtype {
            Dtype::F16 => (
                p.iter()
                    .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                    .collect(),
                p.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect(),
            ),
            _ => (
                p.iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect(),
                p.iter()
                    .map(|x| half::bf16::from_f32(*x).to_f32())
                    .collect(),
            ),
        };
        let extra = layout
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    dtype,
                    t.shape.clone(),
                    enc[2 * t.range.start..2 * t.range.end].to_vec(),
                )
            })
            .collect();
        write_custom(dir.path(), &layout, &p, |_| None, |_, s| s.to_vec(), extra);
        let mut q = vec![0f32; layout.total];
        load_params(dir.path(), &layout, &mut q).unwrap();
        assert_eq!(bits(&q), bits(&expect), "{dtype:?}");
        assert_ne!(bits(&q), bits(&p), "{dtype:?} conversion should round");
    }
}

#[test]
fn missing_tensor_is_named() {
    let spec = small_spec(97);
    let (layout, p, _, _) = setup(&spec);
    let dir = tempfile::tempdir().unwrap();
    let gone = ["transformer.h.1.ln_2.bias", "transformer.wpe.weight"];
    write_custom(
        dir.path(),
        &layout,
        &p,
        |n| (!gone.contains(&n)).then(|| n.to_string()),
        |_, s| s.to_vec(),
        vec![],
    );
    let mut q = vec![0.5f32; layout.total];
    let e = err_text(load_params(dir.path(), &layout, &mut q));
    assert!(e.contains("model.safetensors"), "{e}");
    assert!(e.contains("2 missing tensor(s)"), "{e}");
    for g in gone {
        assert!(e.contains(g), "{e}");
    }
    assert!(
        q.iter().all(|x| *x == 0.5),
        "params must be untouched on error"
    );
}

#[test]
fn wrong_shape_names_tensor_expected_and_found() {
    let spec = small_spec(97);
    let (layout, p, _, _) = setup(&spec);
    let dir = tempfile::tempdir().unwrap();
    write_custom(
        dir.path(),
        &layout,
        &p,
        |n| Some(n.to_string()),
        |n, s| {
            if n == "transformer.h.0.attn.c_attn.weight" {
                vec![s[1], s[0]]
            } else {
                s.to_vec()
            }
        },
        vec![],
    );
    let mut q = vec![0f32; layout.total];
    let e = err_text(load_params(dir.path(), &layout, &mut q));
    assert!(e.contains("transformer.h.0.attn.c_attn.weight"), "{e}");
    assert!(e.contains("expected shape [16, 48], found [48, 16]"), "{e}");
    assert!(e.contains("model.safetensors"), "{e}");

    // A model of other dimensions (wider vocabulary) is a shape error too.
    let other = small_spec(101);
    let olayout = ParamLayout::new(&other);
    let mut oq = vec![0f32; olayout.total];
    let dir2 = tempfile::tempdir().unwrap();
    save_model(dir2.path(), &spec, &layout, &p).unwrap();
    let e = err_text(load_params(dir2.path(), &olayout, &mut oq));
    assert!(
        e.contains("transformer.wte.weight (expected shape [101, 16], found [97, 16])"),
        "{e}"
    );
}

#[test]
fn unsupported_dtype_and_duplicates_are_errors() {
    let spec = small_spec(97);
    let (layout, p, _, _) = setup(&spec);
    let dir = tempfile::tempdir().unwrap();
    let t = layout.get("transformer.ln_f.weight").unwrap();
    let ints: Vec<u8> = (0..t.range.len() as i32)
        .flat_map(|i| i.to_le_bytes())
        .collect();
    write_custom(
        dir.path(),
        &layout,
        &p,
        |n| (n != t.name).then(|| n.to_string()),
        |_, s| s.to_vec(),
        vec![(t.name.clone(), Dtype::I32, t.shape.clone(), ints)],
    );
    let mut q = vec![0f32; layout.total];
    let e = err_text(load_params(dir.path(), &layout, &mut q));
    assert!(
        e.contains("transformer.ln_f.weight (I32)") && e.contains("unsupported dtype"),
        "{e}"
    );

    // Both naming variants of one tensor: ambiguous.
    let dir = tempfile::tempdir().unwrap();
    let bias = le_bytes(&p[layout.range("transformer.ln_f.bias")]);
    write_custom(
        dir.path(),
        &layout,
        &p,
        |n| Some(n.to_string()),
        |_, s| s.to_vec(),
        vec![("ln_f.bias".into(), Dtype::F32, vec![16], bias)],
    );
    let e = err_text(load_params(dir.path(), &layout, &mut q));
    assert!(e.contains("ln_f.bias") && e.contains("both provide"), "{e}");
}

#[test]
fn corrupt_files_are_errors_naming_the_file() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let run = tempfile::tempdir().unwrap();
    let dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &state(&spec, 5),
    )
    .unwrap();
    let good = fs::read(dir.join(MODEL_FILE)).unwrap();
    let mut q = vec![0f32; layout.total];
    let (mut m2, mut v2) = (vec![0f32; layout.total], vec![0f32; layout.total]);
    let model_path = dir.join(MODEL_FILE);

    // Truncated in the data, in the header, and inside the length prefix.
    for len in [good.len() - 1, good.len() / 2, 100, 4, 0] {
        fs::write(&model_path, &good[..len]).unwrap();
        let e = err_text(load_params(&dir, &layout, &mut q));
        assert!(
            e.contains(&model_path.display().to_string()) && e.contains("truncated"),
            "len {len}: {e}"
        );
    }
    // Trailing garbage, random bytes, a header length pointing past the end, bad JSON.
    let mut longer = good.clone();
    longer.extend_from_slice(b"junk");
    let mut rng = crate::util::rng::Rng::new(9);
    let garbage: Vec<u8> = (0..4096)
        .map(|_| (rng.normal() * 1000.0) as i64 as u8)
        .collect();
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let mut bad_json = good.clone();
    bad_json[8] = b'[';
    for (what, bytes) in [
        ("longer", longer),
        ("garbage", garbage),
        ("huge header", huge),
        ("bad json", bad_json),
    ] {
        fs::write(&model_path, &bytes).unwrap();
        let e = err_text(load_params(&dir, &layout, &mut q));
        assert!(
            e.contains(&model_path.display().to_string()) && e.contains("corrupt"),
            "{what}: {e}"
        );
    }
    // Missing file.
    fs::remove_file(&model_path).unwrap();
    let e = err_text(load_params(&dir, &layout, &mut q));
    assert!(
        e.contains(&model_path.display().to_string()) && e.contains("no such file"),
        "{e}"
    );

    // Optimizer file truncated.
    let opt_path = dir.join(OPTIMIZER_FILE);
    let opt = fs::read(&opt_path).unwrap();
    fs::write(&opt_path, &opt[..opt.len() - 8]).unwrap();
    let e = err_text(load_trainer_state(
        &dir,
        &layout,
        MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        },
    ));
    assert!(e.contains(&opt_path.display().to_string()), "{e}");
    // Optimizer file lacking a moment.
    fs::write(&opt_path, &opt).unwrap();
    let st_path = dir.join(STATE_FILE);
    let st_text = fs::read_to_string(&st_path).unwrap();
    // Trainer state garbage, then with a field missing, then of another model.
    fs::write(&st_path, "{ step: 3").unwrap();
    let e = err_text(load_trainer_state(
        &dir,
        &layout,
        MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        },
    ));
    assert!(e.contains(&st_path.display().to_string()), "{e}");
    fs::write(&st_path, st_text.replace("\"rng_state\"", "\"rng\"")).unwrap();
    let e = err_text(load_trainer_state(
        &dir,
        &layout,
        MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        },
    ));
    assert!(
        e.contains("trainer_state.json") && e.contains("rng_state"),
        "{e}"
    );
    let mut other = state(&small_spec(101), 5);
    other.step = 5;
    fs::write(&st_path, serde_json::to_vec(&other).unwrap()).unwrap();
    let e = err_text(load_trainer_state(
        &dir,
        &layout,
        MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        },
    ));
    assert!(e.contains("different model"), "{e}");
    // Config missing.
    fs::remove_file(dir.join(CONFIG_FILE)).unwrap();
    let e = err_text(load_spec(&dir));
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn optimizer_moment_missing_is_named() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let run = tempfile::tempdir().unwrap();
    let dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &state(&spec, 5),
    )
    .unwrap();
    // Rewrite optimizer.safetensors without one exp_avg_sq tensor.
    let bytes = fs::read(dir.join(OPTIMIZER_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let keep: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "exp_avg_sq.transformer.h.1.mlp.c_fc.bias")
        .collect();
    let out = safetensors::serialize(keep.iter().map(|(n, t)| (n.clone(), t)), None).unwrap();
    drop(st);
    fs::write(dir.join(OPTIMIZER_FILE), out).unwrap();
    let (mut m2, mut v2) = (vec![0f32; layout.total], vec![0f32; layout.total]);
    let e = err_text(load_trainer_state(
        &dir,
        &layout,
        MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        },
    ));
    assert!(
        e.contains("optimizer.safetensors")
            && e.contains("exp_avg_sq.transformer.h.1.mlp.c_fc.bias"),
        "{e}"
    );
}

#[test]
fn wrong_buffer_lengths_are_errors_not_panics() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let run = tempfile::tempdir().unwrap();
    let e = err_text(save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m[1..], v: &v },
        &state(&spec, 1),
    ));
    assert!(e.contains("exp_avg (m)"), "{e}");
    let other = ParamLayout::new(&small_spec(101));
    let e = err_text(save_checkpoint(
        run.path(),
        &spec,
        &other,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &state(&spec, 1),
    ));
    assert!(e.contains("layout"), "{e}");
    assert!(latest_checkpoint(run.path()).unwrap().is_none());
    save_model(run.path(), &spec, &layout, &p).unwrap();
    let mut short = vec![0f32; 10];
    assert!(err_text(load_params(run.path(), &layout, &mut short)).contains("10 elements"));
}

#[test]
fn latest_checkpoint_picks_highest_complete_step() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let run = tempfile::tempdir().unwrap();
    assert_eq!(latest_checkpoint(run.path()).unwrap(), None);
    fs::create_dir_all(run.path().join(CHECKPOINTS_DIR)).unwrap();
    assert_eq!(latest_checkpoint(run.path()).unwrap(), None);
    for step in [100, 200, 50] {
        save_checkpoint(
            run.path(),
            &spec,
            &layout,
            &p,
            &Moments::F32 { m: &m, v: &v },
            &state(&spec, step),
        )
        .unwrap();
    }
    let ck = run.path().join(CHECKPOINTS_DIR);
    // A leftover temporary of a crashed save, complete in content: still ignored.
    let leftover = ck.join("step-000300.tmp-123");
    fs::create_dir(&leftover).unwrap();
    for f in CHECKPOINT_FILES.iter().chain([&MODEL_FILE]) {
        fs::copy(ck.join("step-000200").join(f), leftover.join(f)).unwrap();
    }
    // An incomplete step directory, one with an empty file, and unrelated entries.
    fs::create_dir(ck.join("step-000400")).unwrap();
    fs::copy(
        ck.join("step-000200/config.json"),
        ck.join("step-000400/config.json"),
    )
    .unwrap();
    fs::create_dir(ck.join("step-000500")).unwrap();
    for f in CHECKPOINT_FILES {
        fs::write(ck.join("step-000500").join(f), b"x").unwrap();
    }
    fs::write(ck.join("step-000500").join(MODEL_FILE), b"").unwrap();
    fs::create_dir(ck.join("step-abc")).unwrap();
    fs::write(ck.join("step-000900"), b"a file, not a directory").unwrap();
    assert_eq!(
        latest_checkpoint(run.path()).unwrap(),
        Some(ck.join("step-000200"))
    );
    // Steps compare as numbers, beyond six digits too.
    save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &state(&spec, 1_000_000),
    )
    .unwrap();
    assert_eq!(
        latest_checkpoint(run.path()).unwrap(),
        Some(ck.join("step-1000000"))
    );
}

#[test]
#[ignore = "needs root to mount a 1 MiB tmpfs: .ci/run runs it as root"]
fn full_disk_leaves_previous_checkpoint_loadable() {
    let disk = crate::util::small_disk::SmallDisk::mount("1m");
    let mnt = disk.path().to_path_buf();
    let run = mnt.join("run");

    // Small: about 3 × 35 KB, fits in 1 MiB.
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let first = save_checkpoint(
        &run,
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &state(&spec, 1),
    )
    .unwrap();

    // Big: wte alone is 20000 × 16 × 4 B = 1.28 MB per file.
    let big = small_spec(20_000);
    let (blayout, bp, bm, bv) = setup(&big);
    let e = err_text(save_checkpoint(
        &run,
        &big,
        &blayout,
        &bp,
        &Moments::F32 { m: &bm, v: &bv },
        &state(&big, 2),
    ));
    assert!(e.contains("step-000002"), "{e}");
    assert!(e.contains("No space left on device"), "{e}");
    let left: Vec<_> = fs::read_dir(run.join(CHECKPOINTS_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        vec![std::ffi::OsString::from("step-000001")],
        "temporary directory must be removed"
    );
    assert_eq!(latest_checkpoint(&run).unwrap(), Some(first.clone()));

    let mut q = vec![0f32; layout.total];
    load_params(&first, &layout, &mut q).unwrap();
    assert_eq!(bits(&q), bits(&p));
    let (mut m2, mut v2) = (vec![0f32; layout.total], vec![0f32; layout.total]);
    assert_eq!(
        load_trainer_state(
            &first,
            &layout,
            MomentsMut::F32 {
                m: &mut m2,
                v: &mut v2
            }
        )
        .unwrap(),
        state(&spec, 1)
    );
    assert_eq!(bits(&m2), bits(&m));
    assert_eq!(bits(&v2), bits(&v));

    // A model export that does not fit: the error names the file; no temporary remains.
    let out = mnt.join("export");
    let e = err_text(save_model(&out, &big, &blayout, &bp));
    assert!(
        e.contains("model.safetensors") && e.contains("No space left on device"),
        "{e}"
    );
    assert_eq!(
        fs::read_dir(&out).unwrap().count(),
        0,
        "temporary file must be removed"
    );
}

/// An array lent in pieces of `piece` elements (as the executor lends offloaded state, one
/// group's buffer at a time), failing instead of lending piece `fail_at`, or lending one
/// element short.
struct Pieces<'a> {
    data: &'a [f32],
    piece: usize,
    fail_at: Option<usize>,
    short: bool,
}

impl Lend for Pieces<'_> {
    fn elem(&self) -> OutData<'static> {
        OutData::F32(&[])
    }

    fn len(&self) -> usize {
        self.data.len()
    }

    fn lend(
        &self,
        range: std::ops::Range<usize>,
        put: &mut dyn FnMut(OutData<'_>) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let end = range.end - usize::from(self.short);
        let mut at = range.start;
        while at < end {
            let k = at / self.piece;
            if self.fail_at == Some(k) {
                anyhow::bail!("cannot read piece {k} of the test array");
            }
            let stop = ((k + 1) * self.piece).min(end);
            put(OutData::F32(&self.data[at..stop]))?;
            at = stop;
        }
        Ok(())
    }
}

/// Lent piece by piece (pieces cutting through tensors and shards), a checkpoint is the one
/// written from slices, byte for byte; a lender that fails or lends short fails the save with
/// an error naming the tensors, and leaves no checkpoint behind.
#[test]
fn lent_state_saves_like_slices_and_its_failures_are_errors() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let st = state(&spec, 3);
    let opts = SaveOptions {
        max_shard_bytes: 9_000,
        tokenizer_dir: None,
        chat_template: None,
        adapter: None,
    };
    let want_run = tempfile::tempdir().unwrap();
    let want = save_checkpoint_with(
        want_run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &st,
        &opts,
    )
    .unwrap();
    let lent = |data, fail_at, short| Pieces {
        data,
        piece: 777,
        fail_at,
        short,
    };
    let save = |run: &Path, params: &Pieces| {
        let (m, v) = (lent(&m, None, false), lent(&v, None, false));
        let state = LentState {
            params,
            moments: LentMoments {
                format: crate::ir::OptimState::F32,
                m: &m,
                v: &v,
                absmax: None,
            },
        };
        save_checkpoint_lent(run, &spec, &layout, &state, &st, &opts)
    };
    let run = tempfile::tempdir().unwrap();
    let got = save(run.path(), &lent(&p, None, false)).unwrap();
    let names: Vec<_> = fs::read_dir(&want)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(names.len() > 6, "{names:?}: not sharded");
    for name in names {
        assert!(
            fs::read(want.join(&name)).unwrap() == fs::read(got.join(&name)).unwrap(),
            "{name:?} differs"
        );
    }

    for (params, expect) in [
        (
            lent(&p, Some(5), false),
            "cannot read piece 5 of the test array",
        ),
        (lent(&p, None, true), "internal error: lent"),
    ] {
        let run = tempfile::tempdir().unwrap();
        let e = err_text(save(run.path(), &params));
        assert!(e.contains(expect) && e.contains("writing tensor"), "{e}");
        assert!(e.contains("earlier checkpoints are untouched"), "{e}");
        assert!(latest_checkpoint(run.path()).unwrap().is_none());
        let left = fs::read_dir(run.path().join(CHECKPOINTS_DIR))
            .unwrap()
            .count();
        assert_eq!(left, 0, "the incomplete checkpoint is removed");
    }
}

#[test]
fn non_finite_weights_and_moments_are_refused() {
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let t = layout
        .tensors
        .iter()
        .find(|t| t.name == "transformer.h.1.mlp.c_fc.weight")
        .unwrap();
    // Weights: an F32 NaN, then an F16 infinity, in that tensor.
    for (dtype, bad, shown) in [
        (Dtype::F32, f32::NAN, "is NaN"),
        (Dtype::F16, f32::INFINITY, "is inf"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut bad_p = p.clone();
        bad_p[t.range.start + 37] = bad;
        let data = &bad_p[t.range.clone()];
        let bytes = match dtype {
            Dtype::F32 => le_bytes(data),
            _ => data
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect(),
        };
        let extra = vec![(t.name.clone(), dtype, t.shape.clone(), bytes)];
        let keep = |n: &str| (n != t.name).then(|| n.to_string());
        write_custom(dir.path(), &layout, &bad_p, keep, |_, s| s.to_vec(), extra);
        let mut q = vec![0f32; layout.total];
        let e = err_text(load_params(dir.path(), &layout, &mut q));
        for want in [
            &dir.path().join(MODEL_FILE).display().to_string(),
            "tensor transformer.h.1.mlp.c_fc.weight",
            &format!("element 37 of {} {shown}", t.range.len()),
            "NaN or infinite weights",
        ] {
            assert!(e.contains(want), "{want:?} in {e}");
        }
    }
    // Moments, in every format: a NaN f32 moment, a NaN bf16 one, an infinite int8 scale.
    let run = tempfile::tempdir().unwrap();
    let mut bad_m = m.clone();
    bad_m[t.range.start + 3] = f32::NAN;
    let dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &bad_m, v: &v },
        &state(&spec, 5),
    )
    .unwrap();
    let (mut m2, mut v2) = (vec![0f32; layout.total], vec![0f32; layout.total]);
    let e = err_text(load_trainer_state(
        &dir,
        &layout,
        MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        },
    ));
    assert!(
        e.contains("optimizer.safetensors")
            && e.contains("exp_avg.transformer.h.1.mlp.c_fc.weight")
            && e.contains("element 3 ")
            && e.contains("is NaN"),
        "{e}"
    );

    let n = layout.total;
    let mut mb = vec![half::bf16::from_f32(0.5); n];
    let vb = vec![half::bf16::from_f32(0.25); n];
    mb[n - 2] = half::bf16::NAN;
    let run = tempfile::tempdir().unwrap();
    let dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::Bf16 { m: &mb, v: &vb },
        &state(&spec, 5),
    )
    .unwrap();
    let (mut m2, mut v2) = (vec![half::bf16::ZERO; n], vec![half::bf16::ZERO; n]);
    let e = err_text(load_trainer_state(
        &dir,
        &layout,
        MomentsMut::Bf16 {
            m: &mut m2,
            v: &mut v2,
        },
    ));
    assert!(
        e.contains("optimizer.safetensors")
            && e.contains("tensor exp_avg:")
            && e.contains(&format!("element {} is NaN", n - 2)),
        "{e}"
    );

    let blocks = layout.block_offsets(crate::ir::strategy::QBLOCK).1;
    let (mi, vi) = (vec![1i8; n], vec![1u8; n]);
    let ma = vec![1.0f32; blocks];
    let mut va = vec![1.0f32; blocks];
    va[blocks - 1] = f32::INFINITY;
    let run = tempfile::tempdir().unwrap();
    let dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::Int8 {
            m: &mi,
            m_absmax: &ma,
            v: &vi,
            v_absmax: &va,
        },
        &state(&spec, 5),
    )
    .unwrap();
    let (mut mi2, mut vi2) = (vec![0i8; n], vec![0u8; n]);
    let (mut ma2, mut va2) = (vec![0f32; blocks], vec![0f32; blocks]);
    let e = err_text(load_trainer_state(
        &dir,
        &layout,
        MomentsMut::Int8 {
            m: &mut mi2,
            m_absmax: &mut ma2,
            v: &mut vi2,
            v_absmax: &mut va2,
        },
    ));
    assert!(
        e.contains("tensor exp_avg_sq.absmax")
            && e.contains(&format!("element {} is inf", blocks - 1)),
        "{e}"
    );
}

/// A tensor-parallel rank's layout loads its parts of the whole files: each tensor's part
/// taken from the whole tensor (weights, f32 moments by name, bf16 moments from the flat
/// arrays), whole tensors whole; the trainer state is checked against the whole model, and
/// a part of another model is refused naming both.
#[test]
fn tensor_parallel_parts_load_their_runs_of_the_whole_files() {
    use crate::ir::TensorSplit;
    let spec = small_spec(97);
    let (layout, p, m, v) = setup(&spec);
    let run = tempfile::tempdir().unwrap();
    let st = state(&spec, 4);
    let f32_dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::F32 { m: &m, v: &v },
        &st,
    )
    .unwrap();
    // In bf16, f32::MAX would round to infinity (refused on load).
    let to_bf16 = |x: &[f32]| -> Vec<half::bf16> {
        x.iter()
            .map(|&y| half::bf16::from_f32(y.min(1e30)))
            .collect()
    };
    let (mb, vb) = (to_bf16(&m), to_bf16(&v));
    let bf16_dir = save_checkpoint(
        run.path(),
        &spec,
        &layout,
        &p,
        &Moments::Bf16 { m: &mb, v: &vb },
        &state(&spec, 5),
    )
    .unwrap();
    let mut cut = 0;
    for rank in 0..2 {
        let part = ParamLayout::part(
            &spec,
            crate::ir::ModelPart::tensor(TensorSplit::new(2, rank)),
        );
        // What the rank should hold: each tensor's part of the whole one.
        let mine = |whole: &[f32]| -> Vec<f32> {
            let mut out = vec![f32::NAN; part.total];
            for t in &part.tensors {
                let w = &whole[layout.range(&t.name)];
                match &t.part {
                    Some(tp) => tp.take(w, &mut out[t.range.clone()]),
                    None => out[t.range.clone()].copy_from_slice(w),
                }
            }
            out
        };
        cut += part.tensors.iter().filter(|t| t.part.is_some()).count();
        let mut pp = vec![0f32; part.total];
        load_params(&f32_dir, &part, &mut pp).unwrap();
        assert_eq!(bits(&pp), bits(&mine(&p)), "rank {rank}: weights");
        let (mut m2, mut v2) = (vec![0f32; part.total], vec![0f32; part.total]);
        let mm = MomentsMut::F32 {
            m: &mut m2,
            v: &mut v2,
        };
        assert_eq!(load_trainer_state(&f32_dir, &part, mm).unwrap(), st);
        assert_eq!((bits(&m2), bits(&v2)), (bits(&mine(&m)), bits(&mine(&v))));
        let zero = half::bf16::ZERO;
        let (mut m3, mut v3) = (vec![zero; part.total], vec![zero; part.total]);
        let mm = MomentsMut::Bf16 {
            m: &mut m3,
            v: &mut v3,
        };
        load_trainer_state(&bf16_dir, &part, mm).unwrap();
        let f32s = |x: &[half::bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        let rounded = |x: &[f32]| f32s(&to_bf16(x));
        assert_eq!(
            bits(&f32s(&m3)),
            bits(&mine(&rounded(&m))),
            "rank {rank}: bf16 m"
        );
        assert_eq!(
            bits(&f32s(&v3)),
            bits(&mine(&rounded(&v))),
            "rank {rank}: bf16 v"
        );

        // A part of another model: refused, naming the whole models.
        let other = ParamLayout::part(
            &small_spec(101),
            crate::ir::ModelPart::tensor(TensorSplit::new(2, rank)),
        );
        let (mut m4, mut v4) = (vec![0f32; other.total], vec![0f32; other.total]);
        let mm = MomentsMut::F32 {
            m: &mut m4,
            v: &mut v4,
        };
        let e = err_text(load_trainer_state(&f32_dir, &other, mm));
        assert!(e.contains("different model"), "{e}");
        assert!(e.contains("[101, 16]") && e.contains("[97, 16]"), "{e}");
        assert!(
            e.contains(&format!("tensor-parallel part {} of 2", rank + 1)),
            "{e}"
        );
    }
    assert!(cut >= 2 * 2 * 4, "{cut} cut tensors: the parts were cut");
}
