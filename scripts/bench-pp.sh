#!/bin/bash
# Pipeline parallelism's speed against one process, alternated (issue #46: pp 2 with m = 8
# micro-batches should take at most (1 + (p - 1)/m) x the ideal step + 10%, the ideal being
# half of one process's step on one core: so pp 2 on 2 ranks x 1 thread should reach
# 2 / (1.125 x 1.1) = 1.62x the tokens/s of one process x 1 thread). Each round runs pp 2
# once per variant in VARIANTS (default "even auto": --pp-layers even, --pp-layers auto;
# "v2" is --pp-chunks 2, the interleaved schedule), the order rotating between rounds, so
# each round saw the same machine; one process x 1 thread (the ideal's base) and x 2 threads
# run before the first round and after the last. Needs a release build with
# `--features mpi` and a prepared data directory:
#   [VARIANTS="even auto v2"] scripts/bench-pp.sh DATA [MODEL] [ROUNDS]
# Prints, per run, the mean tokens/s of steps 3 to STEPS (default 8) (batch 1 x seq 256 x 8
# micro-batches); MEMWALL names the binary.
set -euo pipefail
DATA=${1:?usage: scripts/bench-pp.sh DATA [MODEL] [ROUNDS]}
MODEL=${2:-gpt2}
PAIRS=${3:-2}
M=${MEMWALL:-$(dirname "$0")/../target/release/memwall}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
mean() {
  python3 -c "
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if '\"tokens_per_s\"' in l]
v = [x['tokens_per_s'] for x in r if x.get('step', 0) >= 3]
print(f'{sum(v) / len(v):.1f}')" "$1/metrics.jsonl"
}
RUN=(--model "$MODEL" --data "$DATA" --batch 1 --seq 256 --grad-accum 8 --steps ${STEPS:-8} --eval-every 0)
# pp 2 as variant $1 (even, auto: --pp-layers; vN: --pp-chunks N); prints its tokens/s.
pp() {
  local how=(--pp-layers "$1")
  [[ $1 == v* ]] && how=(--pp-chunks "${1#v}")
  rm -rf "$OUT/pp-$1"
  mpirun --allow-run-as-root --oversubscribe -np 2 "$M" train "${RUN[@]}" --out "$OUT/pp-$1" \
    --threads 1 --pp 2 "${how[@]}" >"$OUT/pp-$1.log" 2>&1
  mean "$OUT/pp-$1"
}
# One process on $1 threads; prints its tokens/s.
one() {
  rm -rf "$OUT/one-$1"
  "$M" train "${RUN[@]}" --out "$OUT/one-$1" --threads "$1" >"$OUT/one-$1.log" 2>&1
  mean "$OUT/one-$1"
}
read -r -a VARS <<<"${VARIANTS:-even auto}"
echo "config: $MODEL, batch 1 x seq 256 x 8 micro-batches, ${STEPS:-8} steps; pp 2 = mpirun -np 2 --threads 1 --pp 2 with ${VARS[*]} (even|auto: --pp-layers; vN: --pp-chunks N); one = one process; $(nproc) CPUs; $M"
echo "before: one x1 $(one 1) tokens/s, one x2 $(one 2) tokens/s"
n=${#VARS[@]}
for i in $(seq "$PAIRS"); do
  line="round $i:"
  declare -A got=()
  for j in $(seq 0 $((n - 1))); do
    v=${VARS[$(((i - 1 + j) % n))]}
    got[$v]=$(pp "$v")
    line+=" $v ${got[$v]}"
  done
  cut=$(grep -o 'cuts the [0-9]* layers [0-9,]*' "$OUT/pp-auto.log" 2>/dev/null | head -1 || true)
  echo "$line tokens/s (in the order run)${cut:+; auto $cut}"
  unset got
done
echo "after: one x1 $(one 1) tokens/s, one x2 $(one 2) tokens/s"
