//! LoRA adapters' vocabulary (Hu et al. 2021, as PEFT's `LoraLayer` has it): which linear
//! layers of the blocks a run adapts (`--lora-targets`), the adapters' tensors with PEFT's
//! names, shapes and initialisation, and PEFT's `adapter_config.json`.
//!
//! For an adapted linear layer `W` (`in` features to `out`), `y = x Wᵀ + (alpha / r) ·
//! dropout(x) Aᵀ Bᵀ` with `A [r, in]` drawn Kaiming-uniform (a = √5: uniform in
//! ±1/√in, as `nn.Linear` initialises its weight) and `B [out, r]` zero, so that before
//! the first update the model is exactly the base. Only `A` and `B` train.
//!
//! The adapters form a [`ParamLayout`] of their own ([`AdapterLayout::params`]): one group
//! per block, in the order of the base's layers, each layer's `A` then `B`; gradients and
//! optimizer state are planned over it as over any layout, and the base has neither.
//!
//! Under tensor parallelism (`--tp`) an adapter is cut with its layer (Megatron's layout):
//! on a column-parallel layer (q|k|v, gate|up, GPT-2's `c_attn` and `c_fc`: output features
//! cut) a rank keeps `B`'s rows of its output features (the weight's ranges, `c_attn`'s
//! three) and `A` whole; on a row-parallel one (o, down, the `c_proj`s: input features cut)
//! `A`'s columns of its input features and `B` whole. The tensors a rank keeps whole get
//! partial gradients, summed over the tensor ranks (`plan::lora`). Initialisation draws the
//! whole tensors' values ([`ParamLayout::initializer`]), so every rank starts as one process.
//!
//! Names are PEFT's, without an adapter name in the key: the base module's Hugging Face path
//! under `base_model.model.`, then `lora_A.weight` / `lora_B.weight`, e.g.
//! `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. GPT-2's linear layers are
//! Conv1D (`[in, out]`), which PEFT marks with `fan_in_fan_out`; its `A` and `B` keep the
//! shapes above all the same.

use super::params::{Init, LayoutBuilder, ParamLayout, TensorPart};
use super::spec::Family;
use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// A kind of linear layer of a block that can carry an adapter (`--lora-targets`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Llama's `self_attn.q_proj`.
    Q,
    /// Llama's `self_attn.k_proj`.
    K,
    /// Llama's `self_attn.v_proj`.
    V,
    /// Llama's `self_attn.o_proj`.
    O,
    /// Llama's `mlp.gate_proj`.
    Gate,
    /// Llama's `mlp.up_proj`.
    Up,
    /// Llama's `mlp.down_proj`.
    Down,
    /// Phi-3's `self_attn.qkv_proj` (q, k and v in one Linear).
    Qkv,
    /// Phi-3's `mlp.gate_up_proj` (gate and up in one Linear).
    GateUp,
    /// GPT-2's `attn.c_attn` (q, k and v in one Conv1D).
    Attn,
    /// GPT-2's `attn.c_proj`.
    Proj,
    /// GPT-2's `mlp.c_fc`.
    Fc,
    /// GPT-2's `mlp.c_proj`.
    MlpProj,
}

const LLAMA: [Target; 7] = [
    Target::Q,
    Target::K,
    Target::V,
    Target::O,
    Target::Gate,
    Target::Up,
    Target::Down,
];
const PHI3: [Target; 4] = [Target::Qkv, Target::O, Target::GateUp, Target::Down];
const GPT2: [Target; 4] = [Target::Attn, Target::Proj, Target::Fc, Target::MlpProj];

impl Target {
    /// Every target of `family`'s blocks, in the order of a block's layers.
    pub fn all(family: Family) -> &'static [Target] {
        match family {
            Family::Gpt2 => &GPT2,
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Mistral | Family::Gemma3 => {
                &LLAMA
            }
            Family::Phi3 => &PHI3,
        }
    }

    /// The name `--lora-targets` takes.
    pub fn flag(self) -> &'static str {
        match self {
            Target::Q => "q",
            Target::K => "k",
            Target::V => "v",
            Target::O => "o",
            Target::Gate => "gate",
            Target::Up => "up",
            Target::Down => "down",
            Target::Qkv => "qkv",
            Target::GateUp => "gate_up",
            Target::Attn => "attn",
            Target::Proj => "proj",
            Target::Fc => "fc",
            Target::MlpProj => "mlp_proj",
        }
    }

    /// The module's path inside a block, as Hugging Face names it.
    pub fn module(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::O => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
            Target::Qkv => "self_attn.qkv_proj",
            Target::GateUp => "mlp.gate_up_proj",
            Target::Attn => "attn.c_attn",
            Target::Proj => "attn.c_proj",
            Target::Fc => "mlp.c_fc",
            Target::MlpProj => "mlp.c_proj",
        }
    }

    /// The entry of PEFT's `target_modules` that names this layer and no other: the module's
    /// last name where that is unique among the family's targets (`q_proj`, `c_attn`), else
    /// with its parent (`attn.c_proj`, `mlp.c_proj`). PEFT matches an entry against the end of
    /// a module's path.
    pub fn peft_module(self) -> &'static str {
        match self {
            Target::Proj | Target::MlpProj => self.module(),
            _ => self.module().rsplit('.').next().expect("a name"),
        }
    }
}

/// The targets `--lora-targets` names (`all`, or a comma list such as `q,k,v,o`) for
/// `family`, in the order of a block's layers; an unknown or repeated name is refused,
/// naming the family's targets.
pub fn parse_targets(s: &str, family: Family) -> Result<Vec<Target>> {
    let all = Target::all(family);
    let names = || all.iter().map(|t| t.flag()).collect::<Vec<_>>().join(", ");
    if s.trim() == "all" {
        return Ok(all.to_vec());
    }
    let mut out = Vec::new();
    for name in s.split(',').map(str::trim) {
        let Some(t) = all.iter().find(|t| t.flag() == name) else {
            bail!(
                "--lora-targets {s}: {} has no layer '{name}'; its layers are {} (or all)",
                family.model_type(),
                names()
            );
        };
        if out.contains(t) {
            bail!("--lora-targets {s}: '{name}' is given twice");
        }
        out.push(*t);
    }
    out.sort();
    Ok(out)
}

/// `x` as a JSON integer when it is a whole number (PEFT's `lora_alpha` is an `int`), else
/// as a number.
fn whole_as_int<S: serde::Serializer>(x: &f32, s: S) -> std::result::Result<S::Ok, S::Error> {
    if x.fract() == 0.0 && x.abs() < 1e9 {
        s.serialize_i64(*x as i64)
    } else {
        s.serialize_f32(*x)
    }
}

/// A target is saved (in a run's options) by its `--lora-targets` name.
impl Serialize for Target {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.flag())
    }
}

impl<'de> Deserialize<'de> for Target {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Target, D::Error> {
        let name = String::deserialize(d)?;
        LLAMA
            .iter()
            .chain(&GPT2)
            .find(|t| t.flag() == name)
            .copied()
            .ok_or_else(|| serde::de::Error::custom(format!("no LoRA target named '{name}'")))
    }
}

/// What adapters a run trains: their rank, scale and dropout, and the layers they adapt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoraSpec {
    /// The rank r of every adapter (`--lora`).
    pub r: usize,
    /// `--lora-alpha`: the adapters' output is scaled by alpha / r.
    pub alpha: f32,
    /// `--lora-dropout`: the probability an input element of an adapter is dropped.
    pub dropout: f32,
    /// The layers adapted in every block.
    pub targets: Vec<Target>,
}

impl LoraSpec {
    /// The factor on the adapters' output, alpha / r.
    pub fn scale(&self) -> f32 {
        self.alpha / self.r as f32
    }
}

/// A tensor rank's part of an adapted layer (the base weight's [`TensorPart`]): of its
/// output features (`outputs`: a column-parallel layer) or of its input features (a
/// row-parallel one), the ranges kept, in order.
struct Cut {
    outputs: bool,
    ranges: Vec<std::ops::Range<usize>>,
}

/// One adapted linear layer (a tensor rank's part of it under `--tp`: its features kept).
#[derive(Clone, Debug, PartialEq)]
pub struct Adapted {
    /// The base module's Hugging Face path, e.g. `model.layers.0.self_attn.q_proj`.
    pub module: String,
    pub target: Target,
    /// The block it is in.
    pub layer: usize,
    /// Its input and output features: a tensor rank's part's (its `A` `[r, in]` and `B`
    /// `[out, r]` are those of the part).
    pub in_features: usize,
    pub out_features: usize,
    /// Index of the base weight in the base's [`ParamLayout::tensors`].
    pub base_tensor: usize,
}

/// The adapters of a run: every adapted layer and the layout of their tensors.
#[derive(Clone, Debug)]
pub struct AdapterLayout {
    pub spec: LoraSpec,
    /// In the order of the base's tensors (a pipeline stage's: its own layers').
    pub layers: Vec<Adapted>,
    /// The index of each of `layers` among the whole model's adapters (`0..` but on a
    /// pipeline stage): what an adapter's dropout mask is drawn by, so a stage draws one
    /// process's masks.
    pub whole_index: Vec<usize>,
    /// `A` then `B` of each layer, one group per block (`h{l}.lora`).
    pub params: ParamLayout,
}

/// A base tensor in the whole model's order: (name, whole shape, this rank's part of it, its
/// index among this rank's tensors, `None` where another stage holds it).
type Ordered<'a> = (&'a str, &'a [usize], Option<&'a TensorPart>, Option<usize>);

impl AdapterLayout {
    /// No adapters: the base alone, frozen (a generation plan of a model kept as quantized
    /// blocks, `plan::build`'s `generation`). Its trainable layout is empty.
    pub fn none(base: &ParamLayout) -> AdapterLayout {
        AdapterLayout {
            spec: LoraSpec {
                r: 0,
                alpha: 1.0,
                dropout: 0.0,
                targets: Vec::new(),
            },
            layers: Vec::new(),
            whole_index: Vec::new(),
            params: LayoutBuilder::new(base.family).finish(Vec::new(), crate::ir::ModelPart::WHOLE),
        }
    }

    /// The adapters `spec` puts on the base whose parameters are `base`: every block's
    /// targeted weight gets an `A` and a `B`. Refuses a rank of 0 or above a layer's
    /// min(in, out), naming `--lora`, and targets the base lacks.
    pub fn new(base: &ParamLayout, spec: LoraSpec) -> Result<AdapterLayout> {
        if spec.r == 0 {
            bail!("--lora 0: the rank of the adapters must be at least 1");
        }
        if !(spec.alpha > 0.0 && spec.alpha.is_finite()) {
            bail!("--lora-alpha {}: it must be a positive number", spec.alpha);
        }
        if !(0.0..1.0).contains(&spec.dropout) {
            bail!("--lora-dropout {}: it must be in [0, 1)", spec.dropout);
        }
        let family = base.family;
        if let Some(t) = spec
            .targets
            .iter()
            .find(|t| !Target::all(family).contains(t))
        {
            bail!(
                "--lora-targets: {} has no layer '{}'",
                family.model_type(),
                t.flag()
            );
        }
        if spec.targets.is_empty() {
            bail!("--lora-targets: no layer given");
        }
        // The base's tensors in model order: its own (their index), and on a pipeline stage
        // the other stages' (`None`), whose adapters are absent here but drawn at
        // initialisation, so each stage's adapters start as one process's do.
        let mut order: Vec<Ordered> = Vec::new();
        let mut absent = base.absent.iter().peekable();
        for (i, t) in base.tensors.iter().enumerate() {
            while let Some(a) = absent.next_if(|a| a.before <= i) {
                order.push((&a.name, &a.shape, None, None));
            }
            order.push((&t.name, t.whole_shape(), t.part.as_ref(), Some(i)));
        }
        order.extend(absent.map(|a| (a.name.as_str(), a.shape.as_slice(), None, None)));
        // Conv1D weights are [in, out]; nn.Linear's [out, in]: the dimension of the outputs.
        let out_dim = match family {
            Family::Gpt2 => 1,
            Family::Llama
            | Family::Qwen2
            | Family::Qwen3
            | Family::Mistral
            | Family::Phi3
            | Family::Gemma3 => 0,
        };
        let mut all: Vec<(Adapted, bool)> = Vec::new();
        // The whole layers' (in, out) and each adapter's cut, in the order of `all`.
        let mut wholes: Vec<((usize, usize), Option<Cut>)> = Vec::new();
        for (name, shape, part, held) in order {
            let Some((layer, target, module)) = adapted(family, name, &spec.targets) else {
                continue;
            };
            let (in_whole, out_whole) = match *shape {
                [a, b] if out_dim == 1 => (a, b),
                [o, i] => (i, o),
                _ => bail!("internal error: {name} is not a matrix ({shape:?})"),
            };
            // A tensor rank's part of the layer: its output features (column-parallel: B's
            // rows cut alike) or its input features (row-parallel: A's columns cut alike).
            let cut = part.map(|p| Cut {
                outputs: p.dim == out_dim,
                ranges: p.ranges.clone(),
            });
            let kept = |whole: usize, cut_here: bool| match &cut {
                Some(c) if cut_here => c.ranges.iter().map(|r| r.len()).sum(),
                _ => whole,
            };
            let outputs = cut.as_ref().is_some_and(|c| c.outputs);
            let a = Adapted {
                module,
                target,
                layer,
                in_features: kept(in_whole, !outputs),
                out_features: kept(out_whole, outputs),
                base_tensor: held.unwrap_or(usize::MAX),
            };
            all.push((a, held.is_some()));
            wholes.push(((in_whole, out_whole), cut));
        }
        // The rank is bounded by the narrowest adapted layer (a GQA model's k and v), whole.
        if let Some((a, (i, o))) = (all.iter().zip(&wholes))
            .map(|((a, _), (w, _))| (a, *w))
            .min_by_key(|(_, (i, o))| *i.min(o))
            && spec.r > i.min(o)
        {
            bail!(
                "--lora {}: above the rank of {} ({i} -> {o}), the narrowest layer adapted; give \
                 at most {}",
                spec.r,
                a.module,
                i.min(o)
            );
        }
        let found: std::collections::BTreeSet<Target> = all.iter().map(|(a, _)| a.target).collect();
        if let Some(t) = spec.targets.iter().find(|t| !found.contains(t)) {
            bail!(
                "--lora-targets: the model has no {} layer ({}) to adapt",
                t.flag(),
                t.module()
            );
        }
        let mut cur = LayoutBuilder::new(family);
        let mut block = None;
        for ((a, held), ((in_whole, out_whole), cut)) in all.iter().zip(&wholes) {
            if block.is_some_and(|b| b != a.layer) {
                cur.group(format!("h{}.lora", block.expect("a block")));
            }
            block = Some(a.layer);
            cur.hold(*held);
            // Whole A [r, in] and B [out, r], of which a tensor rank keeps A's columns of its
            // input features (row-parallel) or B's rows of its output features
            // (column-parallel), and the other whole.
            let whole = |n: usize| std::iter::once(0..n).collect::<Vec<_>>();
            let (a_cut, b_cut) = match cut {
                Some(c) if c.outputs => ((1, whole(*in_whole)), (0, c.ranges.clone())),
                Some(c) => ((1, c.ranges.clone()), (0, whole(*out_whole))),
                None => ((1, whole(*in_whole)), (0, whole(*out_whole))),
            };
            let bound = 1.0 / (*in_whole as f32).sqrt();
            cur.push_cut(
                peft_name(&a.module, 'A'),
                &[spec.r, *in_whole],
                a_cut,
                true,
                Init::Uniform { bound },
            );
            cur.push_cut(
                peft_name(&a.module, 'B'),
                &[*out_whole, spec.r],
                b_cut,
                true,
                Init::Zeros,
            );
        }
        if let Some(b) = block {
            cur.group(format!("h{b}.lora"));
        }
        let whole_index = (all.iter().enumerate())
            .filter(|(_, (_, h))| *h)
            .map(|(i, _)| i)
            .collect();
        let layers = all
            .into_iter()
            .filter(|(_, h)| *h)
            .map(|(a, _)| a)
            .collect();
        Ok(AdapterLayout {
            spec,
            layers,
            whole_index,
            // The adapters of the base's part: its pipeline stage's, cut as its tensor
            // rank's layers are.
            params: cur.finish(
                Vec::new(),
                crate::ir::ModelPart {
                    tensor: base.split,
                    stage: base.stage,
                },
            ),
        })
    }

    /// PEFT's `adapter_config.json` for these adapters on the base named `base` (a path or
    /// a hub name, as `base_model_name_or_path`).
    pub fn config(&self, base: &str) -> AdapterConfig {
        AdapterConfig {
            peft_type: "LORA".into(),
            task_type: "CAUSAL_LM".into(),
            r: self.spec.r,
            lora_alpha: self.spec.alpha,
            lora_dropout: self.spec.dropout,
            target_modules: self
                .spec
                .targets
                .iter()
                .map(|t| t.peft_module().into())
                .collect(),
            bias: "none".into(),
            fan_in_fan_out: self.params.family == Family::Gpt2,
            base_model_name_or_path: Some(base.into()),
            inference_mode: true,
            init_lora_weights: serde_json::Value::Bool(true),
            lora_bias: false,
            modules_to_save: None,
            use_rslora: false,
            use_dora: false,
            rank_pattern: Default::default(),
            alpha_pattern: Default::default(),
            layers_to_transform: None,
        }
    }
}

/// PEFT's name of `module`'s `A` or `B` weight.
pub fn peft_name(module: &str, which: char) -> String {
    format!("base_model.model.{module}.lora_{which}.weight")
}

/// The block, target and module path of a base weight named `name` when it is one of
/// `targets` (`model.layers.3.self_attn.q_proj.weight`, `transformer.h.3.mlp.c_fc.weight`).
fn adapted(family: Family, name: &str, targets: &[Target]) -> Option<(usize, Target, String)> {
    let blocks = match family {
        Family::Gpt2 => "transformer.h.",
        Family::Llama
        | Family::Qwen2
        | Family::Qwen3
        | Family::Mistral
        | Family::Phi3
        | Family::Gemma3 => "model.layers.",
    };
    let rest = name.strip_prefix(blocks)?.strip_suffix(".weight")?;
    let (layer, module) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    let target = *targets.iter().find(|t| t.module() == module)?;
    Some((layer, target, format!("{blocks}{rest}")))
}

/// PEFT's `adapter_config.json` (the fields `peft.LoraConfig` reads; others are ignored when
/// reading one made elsewhere).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdapterConfig {
    pub peft_type: String,
    pub task_type: String,
    pub r: usize,
    /// Written as an integer when it is one, as PEFT writes its `int` field.
    #[serde(serialize_with = "whole_as_int")]
    pub lora_alpha: f32,
    #[serde(default)]
    pub lora_dropout: f32,
    /// Module names matched against the end of each module's path (PEFT also takes one
    /// string: `all-linear`, or a regular expression, which memwall refuses by name).
    #[serde(deserialize_with = "string_or_list")]
    pub target_modules: Vec<String>,
    #[serde(default = "none")]
    pub bias: String,
    /// True for GPT-2's Conv1D layers (weights stored `[in, out]`).
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    #[serde(default)]
    pub inference_mode: bool,
    /// How PEFT initialised the adapters: `true`, `false` or `"gaussian"` (the weights saved
    /// are what counts); the methods that change the base too (`"pissa"`, `"olora"`,
    /// `"corda"`, `"loftq"`, `"eva"`) are refused, as their adapters need that changed base.
    #[serde(default = "yes")]
    pub init_lora_weights: serde_json::Value,
    /// PEFT's `lora_bias` (a bias on each `lora_B`): read, refused when true, never written.
    #[serde(default, skip_serializing)]
    pub lora_bias: bool,
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub use_dora: bool,
    /// Per-module ranks and alphas, and the layers adapted: PEFT's variations on one rank
    /// and one scale everywhere, which memwall refuses when set (read, never written).
    #[serde(default, skip_serializing)]
    pub rank_pattern: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing)]
    pub alpha_pattern: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing)]
    pub layers_to_transform: Option<serde_json::Value>,
}

/// `target_modules` as a list, or one string (`all-linear`, a regular expression).
fn string_or_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Modules {
        One(String),
        List(Vec<String>),
    }
    Ok(match Modules::deserialize(d)? {
        Modules::One(s) => vec![s],
        Modules::List(l) => l,
    })
}

fn none() -> String {
    "none".into()
}

fn yes() -> serde_json::Value {
    serde_json::Value::Bool(true)
}

impl AdapterConfig {
    /// The spec this config describes for a `family` base: its `target_modules` matched as
    /// PEFT matches them (an entry names every target whose module path ends with it, so
    /// GPT-2's `c_proj` is both `proj` and `mlp_proj`). Refuses what memwall does not train:
    /// another PEFT type, biases, DoRA, rsLoRA, modules saved whole, and entries that name no
    /// layer of the family's blocks, naming `file`.
    pub fn spec(&self, family: Family, file: &str) -> Result<LoraSpec> {
        let refuse = |what: &str| -> Result<LoraSpec> {
            bail!("{file}: {what}; memwall trains plain LoRA adapters (peft_type LORA, bias none)")
        };
        if self.peft_type != "LORA" {
            return refuse(&format!("peft_type is {}", self.peft_type));
        }
        if self.bias != "none" {
            return refuse(&format!("bias is {}", self.bias));
        }
        if self.lora_bias {
            return refuse("lora_bias is true (a bias on each lora_B)");
        }
        match &self.init_lora_weights {
            serde_json::Value::Bool(_) => {}
            serde_json::Value::String(s) if s == "gaussian" => {}
            other => {
                return refuse(&format!(
                    "init_lora_weights is {other}, a method that changes the base weights too \
                     (its adapters apply to that changed base, not to the original)"
                ));
            }
        }
        if self.use_dora || self.use_rslora {
            return refuse("use_dora or use_rslora is set");
        }
        if self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return refuse("modules_to_save is set");
        }
        if !self.rank_pattern.is_empty() || !self.alpha_pattern.is_empty() {
            return refuse("rank_pattern or alpha_pattern is set (ranks or scales per module)");
        }
        if self
            .layers_to_transform
            .as_ref()
            .is_some_and(|l| !l.is_null())
        {
            return refuse("layers_to_transform is set (adapters on some layers only)");
        }
        let mut targets = Vec::new();
        // PEFT's one-string forms: `all-linear` (every linear layer of the blocks), or a
        // regular expression over module paths.
        if let [one] = self.target_modules.as_slice() {
            let plain = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
            if one == "all-linear" {
                targets.extend_from_slice(Target::all(family));
            } else if !one.chars().all(plain) {
                return refuse(&format!(
                    "target_modules is the regular expression '{one}'; give it as a list of \
                     module names"
                ));
            }
        }
        for entry in self.target_modules.iter().filter(|e| *e != "all-linear") {
            let matched: Vec<Target> = Target::all(family)
                .iter()
                .copied()
                .filter(|t| t.module() == entry || t.module().ends_with(&format!(".{entry}")))
                .collect();
            if matched.is_empty() {
                bail!(
                    "{file}: target_modules names '{entry}', which is no linear layer of a {} block ({})",
                    family.model_type(),
                    Target::all(family)
                        .iter()
                        .map(|t| t.module())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            for t in matched {
                if !targets.contains(&t) {
                    targets.push(t);
                }
            }
        }
        targets.sort();
        Ok(LoraSpec {
            r: self.r,
            alpha: self.lora_alpha,
            dropout: self.lora_dropout,
            targets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelSpec;

    fn spec(r: usize, targets: &str, family: Family) -> LoraSpec {
        LoraSpec {
            r,
            alpha: 32.0,
            dropout: 0.0,
            targets: parse_targets(targets, family).unwrap(),
        }
    }

    #[test]
    fn llama_adapters_have_peft_names_shapes_and_groups() {
        let base = ModelSpec::preset("llama-tiny").unwrap();
        let layout = crate::model::ParamLayout::new(&base);
        let a = AdapterLayout::new(&layout, spec(4, "all", Family::Llama)).unwrap();
        assert_eq!(a.layers.len(), 7 * base.n_layer);
        let q = &a.params.tensors[0];
        assert_eq!(
            q.name,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        );
        assert_eq!(q.shape, [4, base.n_embd]);
        let down_b = &a.params.tensors[13];
        assert_eq!(
            down_b.name,
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
        );
        assert_eq!(down_b.shape, [base.n_embd, 4]);
        assert_eq!(a.params.groups.len(), base.n_layer);
        assert_eq!(a.params.groups[1].name, "h1.lora");
        assert!(
            matches!(q.init, Init::Uniform { bound } if bound == 1.0 / (base.n_embd as f32).sqrt())
        );
        assert_eq!(down_b.init, Init::Zeros);
        assert_eq!(a.spec.scale(), 8.0);
    }

    #[test]
    fn gpt2_adapters_read_conv1d_shapes_and_name_c_proj_apart() {
        let base = ModelSpec::preset("gpt2-tiny").unwrap();
        let layout = crate::model::ParamLayout::new(&base);
        let a = AdapterLayout::new(&layout, spec(8, "attn,mlp_proj", Family::Gpt2)).unwrap();
        let c = base.n_embd;
        let attn = &a.layers[0];
        assert_eq!(attn.module, "transformer.h.0.attn.c_attn");
        assert_eq!((attn.in_features, attn.out_features), (c, 3 * c));
        let proj = &a.layers[1];
        assert_eq!(proj.module, "transformer.h.0.mlp.c_proj");
        assert_eq!((proj.in_features, proj.out_features), (4 * c, c));
        let cfg = a.config("gpt2-tiny");
        assert!(cfg.fan_in_fan_out);
        assert_eq!(cfg.target_modules, ["c_attn", "mlp.c_proj"]);
        // PEFT's own reading of the entries gives back the targets.
        assert_eq!(
            cfg.spec(Family::Gpt2, "x").unwrap().targets,
            [Target::Attn, Target::MlpProj]
        );
        // A bare c_proj, as configs made for GPT-2 elsewhere say, is both projections.
        let mut other = cfg.clone();
        other.target_modules = vec!["c_proj".into()];
        assert_eq!(
            other.spec(Family::Gpt2, "x").unwrap().targets,
            [Target::Proj, Target::MlpProj]
        );
    }

    #[test]
    fn the_config_is_peft_json_and_reads_back() {
        let base = ModelSpec::preset("llama-tiny").unwrap();
        let layout = crate::model::ParamLayout::new(&base);
        let a = AdapterLayout::new(&layout, spec(4, "q,v", Family::Llama)).unwrap();
        let json = serde_json::to_value(a.config("smol")).unwrap();
        assert_eq!(json["peft_type"], "LORA");
        assert_eq!(json["task_type"], "CAUSAL_LM");
        assert_eq!(json["r"], 4);
        assert_eq!(json["lora_alpha"], 32.0);
        assert_eq!(
            json["target_modules"],
            serde_json::json!(["q_proj", "v_proj"])
        );
        assert_eq!(json["bias"], "none");
        assert_eq!(json["fan_in_fan_out"], false);
        let back: AdapterConfig = serde_json::from_value(json).unwrap();
        assert_eq!(back.spec(Family::Llama, "x").unwrap(), a.spec);
    }

    #[test]
    fn bad_targets_ranks_and_configs_are_refused_naming_the_flag_or_file() {
        let e = format!("{:#}", parse_targets("q,attn", Family::Llama).unwrap_err());
        assert!(
            e.contains("--lora-targets q,attn")
                && e.contains("no layer 'attn'")
                && e.contains("q, k, v, o, gate, up, down"),
            "{e}"
        );
        let e = format!("{:#}", parse_targets("q,q", Family::Llama).unwrap_err());
        assert!(e.contains("given twice"), "{e}");
        let base = ModelSpec::preset("llama-tiny").unwrap();
        let layout = crate::model::ParamLayout::new(&base);
        let too_big = base.n_embd + 1;
        let e = format!(
            "{:#}",
            AdapterLayout::new(&layout, spec(too_big, "q", Family::Llama)).unwrap_err()
        );
        assert!(
            e.contains(&format!("--lora {too_big}")) && e.contains("give at most"),
            "{e}"
        );
        // The bound is the narrowest adapted layer's, whichever comes first: a GQA model's k.
        let narrow = base.n_kv_head * base.head_dim;
        assert!(
            narrow < base.n_embd,
            "llama-tiny has grouped-query attention"
        );
        let e = format!(
            "{:#}",
            AdapterLayout::new(&layout, spec(narrow + 1, "all", Family::Llama)).unwrap_err()
        );
        assert!(
            e.contains("k_proj") && e.contains(&format!("give at most {narrow}")),
            "{e}"
        );
        let e = format!(
            "{:#}",
            AdapterLayout::new(&layout, spec(0, "q", Family::Llama)).unwrap_err()
        );
        assert!(e.contains("--lora 0"), "{e}");
        let mut cfg = AdapterLayout::new(&layout, spec(4, "q", Family::Llama))
            .unwrap()
            .config("b");
        cfg.use_dora = true;
        let e = format!(
            "{:#}",
            cfg.spec(Family::Llama, "adapter_config.json").unwrap_err()
        );
        assert!(
            e.contains("adapter_config.json") && e.contains("use_dora"),
            "{e}"
        );
        cfg.use_dora = false;
        // PEFT's variations memwall does not train, refused by name; its one-string forms.
        for (json, says) in [
            (r#""rank_pattern": {"q_proj": 8}"#, "rank_pattern"),
            (r#""alpha_pattern": {"v_proj": 4}"#, "alpha_pattern"),
            (r#""layers_to_transform": [0, 1]"#, "layers_to_transform"),
            (r#""target_modules": ".*q_proj""#, "regular expression"),
            (r#""lora_bias": true"#, "lora_bias"),
            (r#""init_lora_weights": "pissa""#, "pissa"),
        ] {
            let mut v = serde_json::to_value(&cfg).unwrap();
            let extra: serde_json::Value = serde_json::from_str(&format!("{{{json}}}")).unwrap();
            for (k, x) in extra.as_object().unwrap() {
                v[k] = x.clone();
            }
            let other: AdapterConfig = serde_json::from_value(v).unwrap();
            let e = format!("{:#}", other.spec(Family::Llama, "c.json").unwrap_err());
            assert!(e.contains("c.json") && e.contains(says), "{e}");
        }
        // Gaussian initialisation (or none) leaves the base as it is: taken.
        for init in [serde_json::json!("gaussian"), serde_json::json!(false)] {
            let mut v = serde_json::to_value(&cfg).unwrap();
            v["init_lora_weights"] = init;
            let other: AdapterConfig = serde_json::from_value(v).unwrap();
            assert!(other.spec(Family::Llama, "x").is_ok());
        }
        let mut v = serde_json::to_value(&cfg).unwrap();
        v["target_modules"] = serde_json::json!("all-linear");
        let all: AdapterConfig = serde_json::from_value(v).unwrap();
        assert_eq!(
            all.spec(Family::Llama, "x").unwrap().targets,
            Target::all(Family::Llama)
        );
        cfg.target_modules = vec!["lm_head".into()];
        let e = format!(
            "{:#}",
            cfg.spec(Family::Llama, "adapter_config.json").unwrap_err()
        );
        assert!(e.contains("'lm_head'"), "{e}");
    }

    /// `A` is drawn in ±1/√in (and not all the same), `B` is zero: the model starts as the base.
    #[test]
    fn adapters_start_as_peft_initialises_them() {
        let base = ModelSpec::preset("llama-tiny").unwrap();
        let layout = crate::model::ParamLayout::new(&base);
        let a = AdapterLayout::new(&layout, spec(4, "q,down", Family::Llama)).unwrap();
        let mut values = vec![0f32; a.params.total];
        a.params.initializer(7).fill(0..a.params.total, &mut values);
        for t in &a.params.tensors {
            let v = &values[t.range.clone()];
            match t.init {
                Init::Uniform { bound } => {
                    assert!(v.iter().all(|x| x.abs() <= bound), "{}", t.name);
                    let spread = v.iter().fold(0f32, |m, x| m.max(x.abs()));
                    assert!(spread > 0.5 * bound, "{}: {spread} of {bound}", t.name);
                }
                _ => assert!(v.iter().all(|&x| x == 0.0), "{}", t.name),
            }
        }
    }
}
