#!/usr/bin/env bash
# Every check of the CUDA backend that needs a GPU, in one run on a GPU machine (which has no
# Rust): the binaries come from scripts/gpu-build.sh, run here, in .gpu/. Writes under $OUT
# (default /tmp/gpu-check), at most 11 files:
#   check.log        everything, in order (what the device tool's output tail shows the end of),
#                    first nvidia-smi, the driver, CUDA and the NVIDIA libraries found
#   kernels.log      every kernel source compiled by this machine's NVRTC for its card
#   device.log       the device tests (open, allocate, bytes up and down, Zero) and their JSON
#   conformance.log  the conformance suite on the GPU (every op kind, fp32/bf16/fp16)
#   runs.jsonl       memwall plan/bench on the GPU, and PyTorch's reference, one JSON line each
#   ops.json         memwall bench --time-ops: seconds per op kind (each op waited for)
#   train.log        memwall train on the GPU (Shakespeare, GPT-2 124M, bf16), then a sample
#   parity.log       scripts/gpu-parity.sh: the CPU against the GPU (fp32, bf16), twice on the
#                    GPU bitwise, recomputation bitwise, resumed from one device on the other,
#                    offload to pinned RAM bitwise
#   calibrate.log    memwall calibrate --device cuda, and cuda-<gpu>.json: the calibration saved
#   ncu.csv          with NCU=1: every kernel's duration over a bench step (Nsight Compute)
# TORCH=0 skips PyTorch's reference (its figure does not change between commits). PART=1 runs
# the correctness and memory checks, PART=2 speed and the time model (keep cuda-<gpu>.json in
# docs/gpu-runs/; copied to a user cache's memwall/calibration/, plans for that GPU anywhere
# are timed by it); the default runs both.
# Each step is bounded by a timeout, so one that hangs leaves the others' logs, and all of them
# by BUDGET seconds (default 540): a step gets what its own bound and the budget leave, and is
# skipped (counted failed) when under 10 s remain. Exit status: the number of failed steps
# (0: all passed).
#   Usage (device tool): carry [".gpu"], command "scripts/gpu-check.sh", timeout 600.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
bin=.gpu/bin
failed=0
budget=${BUDGET:-540}
step() { # step NAME SECONDS LOG COMMAND...: runs one check, appending to LOG
    local name=$1 secs=$2 log=$3
    shift 3
    local left=$((budget - SECONDS))
    [ "$left" -lt "$secs" ] && secs=$left
    if [ "$secs" -lt 10 ]; then
        echo "=== $name: skipped, the budget of ${budget}s is spent"
        failed=$((failed + 1))
        return
    fi
    echo "=== $name ($(date -u +%T), at most ${secs}s)"
    local t0=$SECONDS
    timeout -k 10 "$secs" "$@" >>"$log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc in $((SECONDS - t0)) s"
    tail -n 15 "$log"
    [ $rc = 0 ] || failed=$((failed + 1))
}
[ -x "$bin/memwall" ] || { echo "gpu-check: no $bin/memwall: run scripts/gpu-build.sh first and carry .gpu"; exit 99; }
echo "commit $(cat .gpu/commit 2>/dev/null || echo unknown), machine $(hostname), $(date -u)"

# The NVIDIA libraries: the CUDA toolkit's, then those that come with Python's packages.
site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null || true)
libs=/usr/local/cuda/lib64
if [ -n "$site" ]; then
    for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do [ -d "$d" ] && libs="$libs:$d"; done
fi
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv
    /usr/local/cuda/bin/nvcc --version
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    for l in libcuda.so.1 libnvrtc.so.13 libcublasLt.so.13 libcublas.so.13; do
        echo "$l: $(ldconfig -p | grep -m1 "$l" || find ${LD_LIBRARY_PATH//:/ } -maxdepth 1 -name "$l*" 2>/dev/null | head -1)"
    done
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1
} 2>&1

export RUST_BACKTRACE=1
# The card's memory in use, sampled every 50 ms while COMMAND runs: its highest figure, as a
# JSON line in runs.jsonl beside the plan's (`sampled WHAT COMMAND...`).
sampled() {
    local what=$1
    shift
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 >/tmp/gpu-mem.txt 2>/dev/null &
    local sampler=$!
    "$@"
    kill $sampler 2>/dev/null
    echo "{\"gpu_memory_used_max_mib\": $(sort -n /tmp/gpu-mem.txt | tail -1), \"during\": \"$what\"}" | tee -a "$OUT/runs.jsonl"
}
# A cache of its own (the kernels' PTX, the calibration); the GPU calibration is copied to
# $OUT at the end.
export XDG_CACHE_HOME=/tmp/gpu-check-cache
part=${PART:-all}
if [ "$part" = all ] || [ "$part" = 1 ]; then
    # Part 1: correctness and memory.
    step "kernels: NVRTC for this card" 120 "$OUT/kernels.log" "$bin/cuda_kernels" --test-threads 1
    step "device: open, allocate, round trip, Zero" 60 "$OUT/device.log" "$bin/cuda_device" --ignored --nocapture --test-threads 1
    CUBLASLT_LOG_LEVEL=1 step "conformance suite on the GPU" 180 "$OUT/conformance.log" "$bin/backend_ops" --ignored cuda:: --test-threads 1
    if [ -d .gpu/data ]; then
        step "parity: the CPU against the GPU, bitwise repeats, recomputation, resumed across devices, offload to pinned RAM" 210 "$OUT/parity.log" scripts/gpu-parity.sh
    fi
    # The issue's QLoRA shape (llama-3-8b, r 16, q4_k, 1 x 2048, full recomputation): the
    # device peak against the plan's (6.44 GiB with the context).
    sampled "bench llama-3-8b QLoRA 16 q4_k 1 x 2048 bf16" \
        step "memwall bench on the GPU (llama-3-8b QLoRA 16 on q4_k, 1 x 2048, bf16, recompute full)" 200 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model llama-3-8b --lora 16 --base-quant q4_k --batch 1 --seq 2048 --precision bf16 --recompute full --steps 2
    # [gpu-offload]: the optimizer's moments and the parameters in pinned RAM, staged in
    # for each use: the device's peak against the plan's, and the step time beside the
    # bench above.
    sampled "bench gpt2 16 x 1024 bf16 --offload optimizer,params" \
        step "memwall bench on the GPU, state in pinned RAM (gpt2, 16 x 1024, bf16, --offload optimizer,params)" 120 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model gpt2 --batch 16 --seq 1024 --precision bf16 --offload optimizer,params --steps 5
    # The update's whole state in pinned RAM: each AdamW on the host's cores, in place.
    sampled "bench gpt2 16 x 1024 bf16 --offload all" \
        step "memwall bench on the GPU, updates on the host (gpt2, 16 x 1024, bf16, --offload all)" 120 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model gpt2 --batch 16 --seq 1024 --precision bf16 --offload all --steps 5
    step "plan for the GPU" 60 "$OUT/runs.jsonl" "$bin/memwall" plan --device cuda --model gpt2 --batch 16 --seq 1024 --precision bf16 --json
    sampled "bench gpt2 16 x 1024 bf16" \
        step "memwall bench on the GPU (gpt2, 16 x 1024, bf16)" 120 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model gpt2 --batch 16 --seq 1024 --precision bf16 --steps 5
fi
if [ "$part" = all ] || [ "$part" = 2 ]; then
    # Part 2: speed and the time model.
    step "memwall calibrate --device cuda (the GPU's time model)" 200 "$OUT/calibrate.log" "$bin/memwall" calibrate --device cuda
    # The tensor-core attention (off by default until a card confirms it): the suite and a bench.
    MEMWALL_CUDA_ATTENTION=mma step "conformance suite, attention on the tensor cores (MEMWALL_CUDA_ATTENTION=mma)" 180 "$OUT/conformance.log" "$bin/backend_ops" --ignored cuda:: --test-threads 1
    MEMWALL_CUDA_ATTENTION=mma step "memwall bench, attention on the tensor cores (gpt2, 16 x 1024, bf16)" 90 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model gpt2 --batch 16 --seq 1024 --precision bf16 --steps 5
    step "memwall bench on the GPU (gpt2, 16 x 1024, bf16; predicted by the calibration)" 120 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model gpt2 --batch 16 --seq 1024 --precision bf16 --steps 5
    step "memwall bench on the GPU (smollm2-135m, 16 x 1024, bf16: RMSNorm, SwiGLU, RoPE, GQA)" 90 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model smollm2-135m --batch 16 --seq 1024 --precision bf16 --steps 3
    step "memwall bench on the GPU (smollm2-135m QLoRA 16 on q4_0, 16 x 1024, bf16)" 90 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model smollm2-135m --lora 16 --base-quant q4_0 --batch 16 --seq 1024 --precision bf16 --steps 3
    # [gpu-offload]: updates on the host's cores (llama-3.2-1b, 17 GiB of pinned state), after
    # the backward and inside it: the step against the calibration's prediction (GPU, bus
    # and host AdamW all measured now), the device's peak against the plan's.
    for upd in end in-backward; do
        sampled "bench llama-3.2-1b 1 x 2048 bf16 --offload optimizer,params,grads --update $upd" \
            step "memwall bench, updates on the host (llama-3.2-1b, 1 x 2048, bf16, recompute full, --update $upd)" 150 "$OUT/runs.jsonl" "$bin/memwall" bench --device cuda --model llama-3.2-1b --batch 1 --seq 2048 --precision bf16 --recompute full --offload optimizer,params,grads --update "$upd" --steps 3
    done
    step "memwall plan --device cuda --fit (gpt2, 24 GiB)" 60 "$OUT/runs.jsonl" "$bin/memwall" plan --device cuda --model gpt2 --seq 1024 --global-batch 32 --max-memory 24GiB --fit --json
    step "memwall bench --time-ops on the GPU (each op waited for)" 90 "$OUT/ops.json" "$bin/memwall" bench --device cuda --model gpt2 --batch 16 --seq 1024 --precision bf16 --steps 3 --time-ops
    if [ "${NCU:-0}" = 1 ]; then
        ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
        step "every kernel's duration over a bench step (Nsight Compute)" 200 "$OUT/ncu.csv" \
            "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 2500 \
            "$bin/memwall" bench --device cuda --model gpt2 --batch 16 --seq 1024 --precision bf16 --steps 1
    fi
    if [ "${TRAIN:-1}" != 0 ] && [ -d .gpu/data ]; then
        step "memwall train on the GPU (Shakespeare, gpt2, 8 x 1024, bf16, 60 steps)" 120 "$OUT/train.log" \
            "$bin/memwall" train --device cuda --model gpt2 --data .gpu/data --out /tmp/gpu-run --batch 8 --seq 1024 --precision bf16 --steps 60 --lr 6e-4
        step "memwall sample from the GPU run" 60 "$OUT/train.log" "$bin/memwall" sample --model /tmp/gpu-run/checkpoints/step-000060 --tokens 60
    fi
    if [ "${TORCH:-1}" != 0 ] && [ -f .gpu/torch_reference.py ]; then
        step "PyTorch reference (gpt2, 16 x 1024, bf16, compile)" 240 "$OUT/runs.jsonl" python3 .gpu/torch_reference.py --device cuda --compile --precision bf16 --layers 12 --embd 768 --heads 12 --batch 16 --seq 1024 --steps 20
    fi
fi
cp "$XDG_CACHE_HOME"/memwall/calibration/cuda-*.json "$OUT/" 2>/dev/null
echo "=== done: $failed step(s) failed"
exit $failed
