#!/usr/bin/env bash
# Parity of the CUDA backend with the CPU backend, as issue #45 asks it, by whole training runs
# on prepared data (scripts/gpu-build.sh puts Shakespeare in .gpu/data); called by
# scripts/gpu-check.sh, or alone:
#   1. fp32, gpt2-tiny, a llama-tiny (GQA, RoPE, SwiGLU) and a gemma3-tiny (1 + w norms, q/k
#      and post-norms, GeGLU, the √C embedding, sliding and full layers), 100 steps on the CPU
#      and on the GPU: first-step loss within 1e-5 relative, first gradient norm within 1e-4, every
#      step's loss within 1e-4; bf16 gpt2-tiny: every loss within 1e-2.
#   2. Two GPU runs: bitwise the same losses and the same checkpoint bytes.
#   3. Recomputation on the GPU, fp32: --recompute none and full, bitwise the same.
#   4. A run started on the GPU resumes on the CPU (--resume --device cpu), and the reverse:
#      each within 1e-4 of the run that stayed where it started.
#   5. Offload ([gpu-offload]: pinned host RAM beneath the GPU): --offload all, optimizer and
#      params, grads, activations, each bitwise the weights of the run that offloads nothing
#      (fp32), and all in bf16 (with all of the update's state in pinned RAM, the update runs
#      on the host's cores: the CPU's AdamW, bitwise the GPU's); --update in-backward with the
#      update's state in pinned RAM (each update on the host inside the backward), bitwise
#      --update end, both without clipping (on the CPU, without offload).
# A and B name the two devices (default cpu and cuda); `B=cpu scripts/gpu-parity.sh` runs the
# same checks on a machine without a GPU, which tests this script (every comparison then
# holds bitwise). Writes runs under $WORK (default /tmp/gpu-parity); prints one line per check;
# exit status: the number of checks that failed.
set -u
cd "$(dirname "$0")/.."
bin=${BIN:-.gpu/bin/memwall}
data=${DATA:-.gpu/data}
A=${A:-cpu}
B=${B:-cuda}
work=${WORK:-/tmp/gpu-parity}
steps=${STEPS:-100}
rm -rf "$work"
mkdir -p "$work"
[ -x "$bin" ] || { echo "gpu-parity: no $bin (BIN=...)"; exit 99; }
[ -d "$data" ] || { echo "gpu-parity: no prepared data in $data (DATA=...)"; exit 99; }
cat >"$work/llama-tiny.json" <<'EOF'
{"model_type": "llama", "vocab_size": 50257, "hidden_size": 128, "intermediate_size": 352,
 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
 "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
 "tie_word_embeddings": true}
EOF
cat >"$work/gemma3-tiny.json" <<'EOF'
{"model_type": "gemma3_text", "vocab_size": 50257, "hidden_size": 128, "intermediate_size": 352,
 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
 "query_pre_attn_scalar": 32, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
 "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 48,
 "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
 "tie_word_embeddings": true, "pad_token_id": 0}
EOF
failed=0
train() { # train NAME DEVICE MODEL STEPS EXTRA...: a run in $work/NAME
    local name=$1 device=$2 model=$3 n=$4
    shift 4
    "$bin" train --device "$device" --model "$model" --data "$data" --out "$work/$name" \
        --batch 4 --seq 128 --steps "$n" --lr 1e-3 --eval-every 0 --save-every 10 --seed 7 "$@" \
        >"$work/$name.log" 2>&1 || { echo "FAIL $name: train exited $? (see below)"; tail -5 "$work/$name.log"; return 1; }
}
compare() { # compare WHAT RUN_A RUN_B FIRST_REL GNORM_REL LOSS_REL ('bitwise': all three exact)
    python3 - "$@" <<'EOF'
import json, sys
what, a, b, first, gnorm, loss = sys.argv[1:7]
def read(run):
    rows = [json.loads(l) for l in open(run + "/metrics.jsonl")]
    return [r for r in rows if "loss" in r]
ra, rb = read(a), read(b)
if len(ra) != len(rb) or not ra:
    print(f"FAIL {what}: {len(ra)} and {len(rb)} steps")
    sys.exit(1)
rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30)
f = rel(ra[0]["loss"], rb[0]["loss"])
g = rel(ra[0]["grad_norm"], rb[0]["grad_norm"])
worst = max(rel(x["loss"], y["loss"]) for x, y in zip(ra, rb))
at = max(range(len(ra)), key=lambda i: rel(ra[i]["loss"], rb[i]["loss"]))
if first == "bitwise":
    ok = all(x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"] for x, y in zip(ra, rb))
else:
    ok = f <= float(first) and g <= float(gnorm) and worst <= float(loss)
print(f"{'ok  ' if ok else 'FAIL'} {what}: {len(ra)} steps, first loss {ra[0]['loss']:.7f} vs "
      f"{rb[0]['loss']:.7f} (rel {f:.2e}), first grad norm rel {g:.2e}, worst loss rel {worst:.2e} "
      f"at step {ra[at]['step']}, last {ra[-1]['loss']:.5f} vs {rb[-1]['loss']:.5f} "
      f"(bounds: {first} {gnorm} {loss})")
sys.exit(0 if ok else 1)
EOF
}
check() { "$@" || failed=$((failed + 1)); }
same_bytes() { # same_bytes WHAT DIR_A DIR_B: every file of the last checkpoints equal
    local what=$1 a=$2 b=$3
    local ca cb
    ca=$(ls -d "$a"/checkpoints/step-* | tail -1)
    cb=$(ls -d "$b"/checkpoints/step-* | tail -1)
    if cmp -s "$ca/model.safetensors" "$cb/model.safetensors"; then
        echo "ok   $what: $(basename "$ca")/model.safetensors bitwise the same"
    else
        echo "FAIL $what: $ca/model.safetensors and $cb/model.safetensors differ"
        return 1
    fi
}

# 1. The CPU against the GPU.
for m in gpt2-tiny llama gemma3; do
    model=$m
    [ "$m" = llama ] && model="$work/llama-tiny.json"
    [ "$m" = gemma3 ] && model="$work/gemma3-tiny.json"
    if train "$m-fp32-a" "$A" "$model" "$steps" --precision fp32 &&
        train "$m-fp32-b" "$B" "$model" "$steps" --precision fp32; then
        check compare "$m fp32, $A against $B" "$work/$m-fp32-b" "$work/$m-fp32-a" 1e-5 1e-4 1e-4
    else
        failed=$((failed + 1))
    fi
done
if train "bf16-a" "$A" gpt2-tiny "$steps" --precision bf16 &&
    train "bf16-b" "$B" gpt2-tiny "$steps" --precision bf16; then
    check compare "gpt2-tiny bf16, $A against $B" "$work/bf16-b" "$work/bf16-a" 1e-2 1e-2 1e-2
else
    failed=$((failed + 1))
fi
# 2. Twice on B.
if train "again-b" "$B" gpt2-tiny "$steps" --precision fp32; then
    check compare "gpt2-tiny fp32 on $B twice" "$work/again-b" "$work/gpt2-tiny-fp32-b" bitwise - -
    check same_bytes "gpt2-tiny fp32 on $B twice" "$work/again-b" "$work/gpt2-tiny-fp32-b"
else
    failed=$((failed + 1))
fi
# 3. Recomputation on B.
if train "none-b" "$B" "$work/llama-tiny.json" 20 --precision fp32 --recompute none &&
    train "full-b" "$B" "$work/llama-tiny.json" 20 --precision fp32 --recompute full; then
    check compare "llama fp32 on $B, --recompute none against full" "$work/none-b" "$work/full-b" bitwise - -
    check same_bytes "llama fp32 on $B, --recompute none against full" "$work/none-b" "$work/full-b"
else
    failed=$((failed + 1))
fi
# 4. Resumed on the other device: a 20-step run's copy from its step-10 checkpoint on.
for pair in "$B $A b" "$A $B a"; do
    set -- $pair
    from=$1 to=$2 role=$3
    stay="gpt2-tiny-stay-$role" name="resume-$role"
    if train "$stay" "$from" gpt2-tiny 20 --precision fp32 &&
        cp -r "$work/$stay" "$work/$name" && rm -rf "$work/$name/checkpoints/step-000020" &&
        "$bin" train --resume "$work/$name" --device "$to" >"$work/$name.log" 2>&1; then
        check compare "gpt2-tiny fp32 started on $from, resumed on $to at step 10" "$work/$name" "$work/$stay" 1e-5 1e-4 1e-4
    else
        echo "FAIL $name: see $work/$name.log"
        tail -5 "$work/$name.log"
        failed=$((failed + 1))
    fi
done
# 5. Offload on B (pinned RAM beneath a GPU; the disk on the CPU): weights bitwise those of
#    the run that offloads nothing (3.), fp32 and bf16.
for set in all optimizer,params grads activations; do
    if train "offload-$set-b" "$B" "$work/llama-tiny.json" 20 --precision fp32 --recompute full --offload "$set"; then
        check compare "llama fp32 on $B, --offload $set against none" "$work/offload-$set-b" "$work/full-b" bitwise - -
        check same_bytes "llama fp32 on $B, --offload $set against none" "$work/offload-$set-b" "$work/full-b"
    else
        failed=$((failed + 1))
    fi
done
if train "bf16-none-b" "$B" "$work/llama-tiny.json" 20 --precision bf16 --recompute full &&
    train "bf16-offload-b" "$B" "$work/llama-tiny.json" 20 --precision bf16 --recompute full --offload all; then
    check compare "llama bf16 on $B, --offload all against none" "$work/bf16-offload-b" "$work/bf16-none-b" bitwise - -
    check same_bytes "llama bf16 on $B, --offload all against none" "$work/bf16-offload-b" "$work/bf16-none-b"
else
    failed=$((failed + 1))
fi
# In-backward updates on the host (B a GPU; the CPU runs them in RAM): bitwise --update end.
inb_offload=""
[ "$B" = cuda ] && inb_offload="--offload optimizer,params,grads"
if train "end-noclip-b" "$B" "$work/llama-tiny.json" 20 --precision fp32 --recompute full --grad-clip 0 $inb_offload &&
    train "inb-b" "$B" "$work/llama-tiny.json" 20 --precision fp32 --recompute full --update in-backward $inb_offload; then
    check compare "llama fp32 on $B, --update in-backward against end $inb_offload" "$work/inb-b" "$work/end-noclip-b" bitwise - -
    check same_bytes "llama fp32 on $B, --update in-backward against end $inb_offload" "$work/inb-b" "$work/end-noclip-b"
else
    failed=$((failed + 1))
fi
echo "gpu-parity: $failed check(s) failed"
exit $failed
