#!/bin/bash
# Pipeline parallelism's speed against one process, alternated (issue #46: pp 2 with m = 8
# micro-batches should take at most (1 + (p - 1)/m) x the ideal step + 10%, the ideal being
# half of one process's step on one core: so pp 2 on 2 ranks x 1 thread should reach
# 2 / (1.125 x 1.1) = 1.62x the tokens/s of one process x 1 thread). One process x 2 threads
# is shown beside them. Needs a release build with `--features mpi` and a prepared data
# directory:
#   scripts/bench-pp.sh DATA [MODEL] [PAIRS]
# Prints, per pair, the mean tokens/s of steps 3 to STEPS (default 8) of each (batch 1 x seq 256 x 8 micro-batches).
set -euo pipefail
DATA=${1:?usage: scripts/bench-pp.sh DATA [MODEL] [PAIRS]}
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
echo "config: $MODEL, batch 1 x seq 256 x 8 micro-batches, ${STEPS:-8} steps; pp 2 = mpirun -np 2 --threads 1 --pp 2; one = one process; $(nproc) CPUs; $M"
for i in $(seq "$PAIRS"); do
  rm -rf "$OUT"/pp "$OUT"/one "$OUT"/one1
  mpirun --allow-run-as-root --oversubscribe -np 2 "$M" train "${RUN[@]}" --out "$OUT"/pp \
    --threads 1 --pp 2 >"$OUT"/pp.log 2>&1
  "$M" train "${RUN[@]}" --out "$OUT"/one1 --threads 1 >"$OUT"/one1.log 2>&1
  "$M" train "${RUN[@]}" --out "$OUT"/one --threads 2 >"$OUT"/one.log 2>&1
  echo "round $i: pp2x1 $(mean "$OUT"/pp) tokens/s, one x1 $(mean "$OUT"/one1) tokens/s, one x2 $(mean "$OUT"/one) tokens/s"
done
