#!/usr/bin/env bash
# The [prune] quality comparison on held-out Shakespeare (issue #49): SmolLM2-135M-Instruct
# (its Q4_1 GGUF) pruned to about 75% of its parameters by width (--keep 0.75) and by depth
# (--depth 20, ShortGPT's Block Influence), each healed STEPS steps; the width-pruned one
# also trained as long on the data's cross-entropy without a teacher. Prints one JSON line per
# model: its validation loss (the data's cross-entropy, EVAL batches of BATCH x SEQ).
#
#   scripts/prune-quality.sh SMOLLM2.gguf DATA [STEPS] [BATCH] [SEQ] [EVAL]
#
# DATA: `memwall prepare ../shared/data/shakespeare --tokenizer SMOLLM2.gguf --out DATA`.
# ALPHA (environment, default 1): the distilled runs' --distill-alpha.
set -euo pipefail
GGUF=$1; DATA=$2; STEPS=${3:-300}; BATCH=${4:-2}; SEQ=${5:-128}; EVAL=${6:-16}
M=${MEMWALL:-target/release/memwall}
ALPHA=${ALPHA:-1}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
val() { # RUN: the last val_loss in its metrics
  python3 -c "import json,sys; v=[json.loads(l)['val_loss'] for l in open('$1/metrics.jsonl') if 'val_loss' in json.loads(l)]; print(v[-1])"
}
train() { # NAME INIT [FLAGS...]
  local name=$1 init=$2; shift 2
  $M train --init "$init" --data "$DATA" --out "$W/$name" --steps "$STEPS" --batch "$BATCH" \
    --seq "$SEQ" --lr 3e-4 --eval-every "$STEPS" --eval-batches "$EVAL" --save-every "$STEPS" \
    "$@" >"$W/$name.log" 2>&1
  echo "{\"model\": \"$name\", \"steps\": $STEPS, \"alpha\": $ALPHA, \"val_loss\": $(val "$W/$name")}"
}
eval0() { # NAME DIR: the step-0 validation loss
  $M train --init "$2" --data "$DATA" --out "$W/e-$1" --steps 1 --batch "$BATCH" --seq "$SEQ" \
    --eval-every 1 --eval-batches "$EVAL" >"$W/e-$1.log" 2>&1
  python3 -c "import json; print(json.dumps({'model': '$1', 'steps': 0, 'val_loss': next(json.loads(l)['val_loss'] for l in open('$W/e-$1/metrics.jsonl') if json.loads(l).get('step') == 0 and 'val_loss' in json.loads(l))}))"
}
$M prune --model "$GGUF" --data "$DATA" --out "$W/width" --keep 0.75 --json >"$W/width.json" 2>/dev/null
$M prune --model "$GGUF" --data "$DATA" --out "$W/depth" --depth 20 --json >"$W/depth.json" 2>/dev/null
python3 -c "import json; [print(json.dumps({'pruned': n, 'params': json.load(open('$W/'+n+'.json'))['params_after']})) for n in ('width', 'depth')]"
eval0 original "$GGUF"
eval0 width-pruned "$W/width"
eval0 depth-pruned "$W/depth"
train width-distilled "$W/width" --distill-from "$GGUF" --distill-alpha "$ALPHA"
train width-cross-entropy "$W/width"
train depth-distilled "$W/depth" --distill-from "$GGUF" --distill-alpha "$ALPHA"
