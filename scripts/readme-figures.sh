#!/usr/bin/env bash
# readme-figures.sh: regenerates the figures README.md quotes from runs (not timings of the
# engine's kernels: those come from bench-pair.sh and time-check.sh), one JSON object per line,
# each with the command that made it, the date and the CPU. README's "Current figures" table
# names each row it feeds by its figure name; the dated log of past values is docs/benchmarks.md.
#
# Usage:
#   scripts/readme-figures.sh [BIN] [WORKDIR]
#   scripts/readme-figures.sh target/release/memwall /tmp/figures
#
# Figures:
#   demo_finetune     `memwall demo finetune`: validation loss before and after, predicted and
#                     measured peak RSS (fetches SmolLM2-135M-Instruct once, about 98 MB)
#   finetune_example  README's fine-tune example (convert, prepare, 3 steps of 2 x 64):
#                     validation losses, predicted and measured peak RSS
#   offload_auto      `plan --model gpt2-xl ... --offload auto --recompute auto --max-memory 6GiB`:
#                     the placement and policy picked, with its peak and predicted step time
#                     (the pick depends on this machine's calibration)
# Needs ../shared/data/shakespeare (or MEMWALL_CORPUS); about 6 minutes on 2 cores.
set -euo pipefail

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
bin=$(realpath "${1:-target/release/memwall}")
work=${2:-$(mktemp -d)}
[ -x "$bin" ] || { echo "readme-figures: $bin is not an executable (cargo build --release)" >&2; exit 2; }
mkdir -p "$work"
corpus=${MEMWALL_CORPUS:-$(dirname "$0")/../../shared/data/shakespeare}
corpus=$(realpath "$corpus")
date=$(date -u +%Y-%m-%d)
cpu=$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')
flags=$(grep -m1 '^flags' /proc/cpuinfo)
isa=AVX2
case "$flags" in *avx512f*) isa=AVX-512F ;; esac
case "$flags" in *avx512_bf16*) isa="AVX-512 with AVX512_BF16" ;; esac
threads=$(nproc)

# emit NAME COMMAND LOG RUN_DIR: one JSON line from a run's summary and plan.json.
emit() {
    python3 - "$1" "$2" "$3" "$4" "$date" "$cpu ($isa)" "$threads" <<'PY'
import json, re, sys
name, command, log, run, date, cpu, threads = sys.argv[1:]
text = open(log).read()
out = {"figure": name, "command": command, "date": date, "cpu": cpu, "threads": int(threads)}
m = re.findall(r"peak RSS ([\d.]+ \w+) \(plan", text)
if m:
    out["measured_peak_rss"] = m[-1]
try:
    plan = json.load(open(run + "/plan.json"))
    out["predicted_peak_rss_gib"] = round(plan["predicted_peak_rss_bytes"] / 2**30, 3)
except OSError:
    pass
vals = []
try:
    for line in open(run + "/metrics.jsonl"):
        r = json.loads(line)
        if "val_loss" in r:
            vals.append((r["step"], r["val_loss"]))
except OSError:
    pass
if vals:
    out["val_loss_first"] = {"step": vals[0][0], "loss": round(vals[0][1], 4)}
    out["val_loss_last"] = {"step": vals[-1][0], "loss": round(vals[-1][1], 4)}
print(json.dumps(out))
PY
}

cmd="memwall demo finetune --out $work/demo"
rm -rf "$work/demo"
"$bin" demo finetune --out "$work/demo" >"$work/demo.log" 2>&1
emit demo_finetune "$cmd" "$work/demo.log" "$work/demo/run-smollm2"

gguf="${MEMWALL_SMOLLM2_GGUF:-${XDG_CACHE_HOME:-$HOME/.cache}/memwall/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
rm -rf "$work/smol" "$work/dsmol" "$work/rsmol"
"$bin" convert "$gguf" --out "$work/smol" >"$work/ft.log" 2>&1
"$bin" prepare "$corpus" --tokenizer "$work/smol" --out "$work/dsmol" >>"$work/ft.log" 2>&1
"$bin" train --init "$work/smol" --data "$work/dsmol" --out "$work/rsmol" --steps 3 --batch 2 \
    --seq 64 --eval-every 3 --eval-batches 2 --lr 1e-4 >>"$work/ft.log" 2>&1
emit finetune_example "memwall train --init smol --data dsmol --out rsmol --steps 3 --batch 2 --seq 64 --eval-every 3 --eval-batches 2 --lr 1e-4" "$work/ft.log" "$work/rsmol"

cmd="memwall plan --model gpt2-xl --batch 4 --seq 512 --offload auto --recompute auto --max-memory 6GiB"
"$bin" plan --model gpt2-xl --batch 4 --seq 512 --offload auto --recompute auto --max-memory 6GiB --json \
    >"$work/xl.json" 2>"$work/xl.log"
python3 - "$work/xl.json" "$cmd" "$date" "$cpu ($isa)" "$threads" <<'PY'
import json, sys
path, command, date, cpu, threads = sys.argv[1:]
p = json.load(open(path))
c = p["config"]
print(json.dumps({
    "figure": "offload_auto", "command": command, "date": date, "cpu": cpu,
    "threads": int(threads), "offload": c["offload"]["set"], "recompute": c["recompute"],
    "predicted_peak_rss_gib": round(p["predicted_peak_rss_bytes"] / 2**30, 3),
    "predicted_step_s": round(p.get("predicted_step_s") or 0.0, 1),
}))
PY
