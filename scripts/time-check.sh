#!/usr/bin/env bash
# time-check.sh: predicted against measured step time on the configurations of docs/benchmarks.md.
#
# Usage:
#   scripts/time-check.sh [BIN] [OFFLOAD_DIR]
#   QUICK=1 scripts/time-check.sh target/release/memwall /mnt/nvme/tmp
#
# Runs `memwall bench --threads 2 --steps 2` on each configuration of docs/benchmarks.md's table
# "Predicted against measured step time" (GPT-2 124M and SmolLM2-135M: precisions, optimizer state,
# accumulation, recompute policies; gpt2-large: fp32, bf16 and every offload mode, its offload
# file in OFFLOAD_DIR, default ./memwall-offload) and prints one JSON object per line:
# the configuration, step_s_median, predicted_step_s, time_error_pct, stall_s and the
# prediction's stall. QUICK=1 leaves out gpt2-large (about 5 minutes instead of 25 on
# 2 cores). Uses the calibration in the user cache (`memwall calibrate`); without one, the
# predictions are estimates and say so. Run it on a quiet machine: a shared machine's drift
# shows up as prediction error.
set -euo pipefail

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
bin=${1:-target/release/memwall}
dir=${2:-memwall-offload}
[ -x "$bin" ] || { echo "time-check: $bin is not an executable (cargo build --release)" >&2; exit 2; }

configs=(
    "--model gpt2 --batch 4 --seq 256"
    "--model gpt2 --batch 4 --seq 256 --optim-state int8"
    "--model gpt2 --batch 4 --seq 256 --precision bf16"
    "--model gpt2 --batch 4 --seq 256 --precision fp16"
    "--model gpt2 --batch 2 --grad-accum 2 --seq 256"
    "--model gpt2 --batch 8 --seq 512 --recompute none"
    "--model gpt2 --batch 8 --seq 512 --recompute selective"
    "--model gpt2 --batch 8 --seq 512 --recompute every:3"
    "--model gpt2 --batch 8 --seq 512 --recompute full"
    "--model smollm2-135m --batch 4 --seq 256"
    "--model smollm2-135m --batch 4 --seq 256 --precision bf16"
)
if [ -z "${QUICK:-}" ]; then
    configs+=(
        "--model gpt2-large --batch 4 --seq 256"
        "--model gpt2-large --batch 4 --seq 256 --precision bf16"
    )
    for o in all optimizer params grads activations; do
        configs+=("--model gpt2-large --batch 4 --seq 256 --offload $o --offload-dir $dir")
    done
fi

for c in "${configs[@]}"; do
    # shellcheck disable=SC2086 # the configuration is a list of flags
    "$bin" bench --threads 2 --steps 2 $c 2>/dev/null | python3 -c '
import json, sys
r = json.load(sys.stdin)
print(json.dumps({
    "flags": sys.argv[1],
    "step_s_median": round(r["step_s_median"], 3),
    "predicted_step_s": round(r["predicted_step_s"], 3),
    "time_error_pct": round(r["time_error_pct"], 1),
    "stall_s": round(r["stall_s"], 2),
    "predicted_stall_s": round(r["predicted"]["stall_s"], 2),
    "estimated": r["predicted"]["estimated"],
}))' "$c"
done
