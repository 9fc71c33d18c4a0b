#!/bin/bash
# Tensor parallelism's speed against one process, in alternated pairs (issue #46: tp 2 on
# 2 ranks x 1 thread should reach 0.85x one process with 2 threads). Needs a release build
# with `--features mpi` and a prepared data directory:
#   scripts/bench-tp.sh DATA [MODEL] [PAIRS]
# Prints, per pair, the mean tokens/s of steps 3-8 of each (gpt2, batch 4 x seq 256). With
# SP=1 each round also runs tp 2 with --sequence-parallel, between the two.
set -euo pipefail
DATA=${1:?usage: scripts/bench-tp.sh DATA [MODEL] [PAIRS]}
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
echo "config: $MODEL, batch 4 x seq 256, ${STEPS:-8} steps; tp 2 = mpirun -np 2 --threads 1 --tp 2${SP:+ (and with --sequence-parallel)}; one = --threads 2; $(nproc) CPUs"
tp() { # OUT_NAME [FLAGS...]
  local out=$1
  shift
  rm -rf "${OUT:?}/$out"
  mpirun --allow-run-as-root --oversubscribe -np 2 "$M" train --model "$MODEL" --data "$DATA" \
    --out "$OUT/$out" --batch 4 --seq 256 --steps ${STEPS:-8} --eval-every 0 --threads 1 --tp 2 "$@" \
    >"$OUT/$out.log" 2>&1
}
for i in $(seq "$PAIRS"); do
  rm -rf "$OUT"/one
  tp tp
  sp=""
  if [ -n "${SP:-}" ]; then
    tp sp --sequence-parallel
    sp=", tp2x1 --sequence-parallel $(mean "$OUT"/sp) tokens/s"
  fi
  "$M" train --model "$MODEL" --data "$DATA" --out "$OUT"/one --batch 4 --seq 256 --steps ${STEPS:-8} \
    --eval-every 0 --threads 2 >"$OUT"/one.log 2>&1
  echo "pair $i: tp2x1 $(mean "$OUT"/tp) tokens/s$sp, one x2 $(mean "$OUT"/one) tokens/s"
done
