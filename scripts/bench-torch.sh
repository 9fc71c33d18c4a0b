#!/usr/bin/env bash
# bench-torch.sh: memwall against the PyTorch + transformers reference, side by side.
#
# Usage:
#   TORCH_PY=/path/to/torch-ref/bin/python scripts/bench-torch.sh [--precision bf16] [memwall bench args...]
#   PAIRS=3 MODEL=smollm2-135m scripts/bench-torch.sh --precision bf16
#
# Runs `memwall bench --model $MODEL --batch 4 --seq 256 --steps 4 --threads 2 [args]` and
# `../shared/bench/torch_reference.py` on the same shape (GPT-2 124M for MODEL=gpt2, a preset
# otherwise: --arch qwen3 / gemma3 / llama --preset $MODEL) alternately, memwall first, PAIRS pairs
# (default 3), so a slow spell of a shared machine falls on both sides. Prints each pair's
# tokens/s and peak RSS, the pair's ratios (memwall/torch), their medians, and memwall's
# fraction of the machine's measured FMA peak. A --precision given here goes to both; every
# other argument goes to memwall only (e.g. --recompute none).
# Set-up of the reference (about 3 GB): python3 -m venv torch-ref &&
#   torch-ref/bin/pip install torch transformers safetensors numpy
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
torch_py=${TORCH_PY:-$root/../torch-ref/bin/python}
reference=$root/../shared/bench/torch_reference.py
model=${MODEL:-smollm2-135m}
pairs=${PAIRS:-3}
bin=${MEMWALL:-$root/target/release/memwall}
[ -x "$torch_py" ] || { echo "bench-torch: no Python with torch at $torch_py (set TORCH_PY)" >&2; exit 2; }
[ -f "$reference" ] || { echo "bench-torch: $reference is missing (../shared)" >&2; exit 2; }
[ -x "$bin" ] || { echo "bench-torch: $bin is not built (cargo build --release, or set MEMWALL)" >&2; exit 2; }

precision=fp32
extra=()
while [ $# -gt 0 ]; do
    case "$1" in
    --precision) precision=$2; shift 2 ;;
    *) extra+=("$1"); shift ;;
    esac
done
shape=(--batch 4 --seq 256 --steps 4 --threads 2)
if [ "$model" = gpt2 ]; then
    torch_shape=(--layers 12 --embd 768 --heads 12)
else
    # The reference's own presets (published shapes) for the families it builds apart.
    case "$model" in
    qwen3-*) arch=qwen3 ;;
    gemma-3-*) arch=gemma3 ;;
    *) arch=llama ;;
    esac
    torch_shape=(--arch "$arch" --preset "$model")
fi

echo "config: model=$model precision=$precision ${shape[*]} memwall-extra=[${extra[*]}] pairs=$pairs"
work=$(mktemp -d "${TMPDIR:-/tmp}/bench-torch.XXXXXX")
trap 'rm -rf "$work"' EXIT
for i in $(seq "$pairs"); do
    "$bin" bench --model "$model" "${shape[@]}" --precision "$precision" "${extra[@]}" >"$work/mw.$i.json" 2>"$work/mw.$i.err" ||
        { echo "bench-torch: memwall failed:" >&2; tail -5 "$work/mw.$i.err" >&2; exit 1; }
    OMP_NUM_THREADS=2 "$torch_py" "$reference" "${torch_shape[@]}" "${shape[@]}" --precision "$precision" \
        >"$work/pt.$i.json" 2>"$work/pt.$i.err" ||
        { echo "bench-torch: the reference failed:" >&2; tail -5 "$work/pt.$i.err" >&2; exit 1; }
done
python3 - "$work" "$pairs" <<'PY'
import json, statistics, sys
work, pairs = sys.argv[1], int(sys.argv[2])
def load(path):
    text = open(path).read()
    return json.loads(text[text.index("{"):])
speed, mem = [], []
for i in range(1, pairs + 1):
    mw, pt = load(f"{work}/mw.{i}.json"), load(f"{work}/pt.{i}.json")
    s = mw["tokens_per_s"] / pt["tokens_per_s"]
    m = mw["peak_rss_bytes"] / pt["peak_rss_bytes"]
    speed.append(s)
    mem.append(m)
    fma = mw.get("fma_peak") or {}
    print(f"pair {i}: memwall {mw['tokens_per_s']:.1f} tok/s {mw['peak_rss_bytes']/1e9:.2f} GB "
          f"({fma.get('fraction_reached', float('nan')):.2f} of fma_peak {fma.get('gflops_per_s_after', float('nan')):.0f} GFLOP/s) | "
          f"torch {pt['tokens_per_s']:.1f} tok/s {pt['peak_rss_bytes']/1e9:.2f} GB | speed {s:.2f}x memory {m:.2f}x")
print(f"median: speed {statistics.median(speed):.2f}x memory {statistics.median(mem):.2f}x (memwall/torch)")
PY
