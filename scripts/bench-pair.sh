#!/usr/bin/env bash
# bench-pair.sh: compare the training speed of two memwall binaries on this machine.
#
# Usage:
#   scripts/bench-pair.sh OLD_BIN NEW_BIN [extra bench args...]
#   PAIRS=1 scripts/bench-pair.sh target/same-results/bin/<sha>/memwall target/release/memwall --precision bf16
#
# Runs `memwall bench --model gpt2 --batch 4 --seq 256 --steps 3 --threads 2 [extra args]`
# alternately with OLD_BIN and NEW_BIN (old, new, old, new, ...), PAIRS pairs (default 3), so
# that a slow spell of a shared machine falls on both sides. Prints each pair's tokens/s (the
# bench's `tokens_per_s`: tokens of one step over the median step time) and the median of the
# pairs' new/old ratios. Extra args are added to the fixed ones (clap refuses a flag given
# twice, so they cannot override --model, --batch, --seq, --steps or --threads).
# Also says whether the two binaries' losses (the bench's `losses`) are bitwise the same, and
# compares the fastest step each side ran over all its runs (the bench's `step_s`): a shared
# machine's neighbours only ever slow a step down, so on a noisy machine the fastest steps are
# the steadier comparison of the two (the medians swung 0.86-1.12 between pairs of one
# sitting on a contended Zen 4, where the fastest steps agree within a few percent).
# NEW_ARGS: arguments for the new side only, to compare two settings of one binary, e.g.
#   NEW_ARGS="--precision bf16" scripts/bench-pair.sh target/release/memwall target/release/memwall
# Each run takes about 75 s on 2 shared cores (gpt2, fp32).
set -euo pipefail

if [ $# -lt 2 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    [ $# -ge 2 ] && exit 0 || exit 2
fi
old=$1
new=$2
shift 2
pairs=${PAIRS:-3}
for bin in "$old" "$new"; do
    [ -x "$bin" ] || { echo "bench-pair: $bin is not an executable" >&2; exit 2; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/bench-pair.XXXXXX")
trap 'rm -rf "$work"' EXIT
args=(bench --model gpt2 --batch 4 --seq 256 --steps 3 --threads 2 "$@")
echo "memwall ${args[*]}${NEW_ARGS:+ (new side also: $NEW_ARGS)}"
field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$@"; }

ratios=()
for i in $(seq 1 "$pairs"); do
    for side in old new; do
        bin=$old
        side_args=()
        if [ "$side" = new ]; then
            bin=$new
            read -r -a side_args <<<"${NEW_ARGS:-}"
        fi
        "$bin" "${args[@]}" "${side_args[@]}" >"$work/$side.$i.json" 2>"$work/$side.$i.err" || {
            echo "bench-pair: $bin exited $?:" >&2
            tail -5 "$work/$side.$i.err" >&2
            exit 1
        }
    done
    o=$(field "$work/old.$i.json" tokens_per_s)
    n=$(field "$work/new.$i.json" tokens_per_s)
    r=$(python3 -c "print(f'{$n / $o:.4f}')")
    ratios+=("$r")
    same=no
    [ "$(field "$work/old.$i.json" losses)" = "$(field "$work/new.$i.json" losses)" ] && same=yes
    printf 'pair %d: old %.2f tokens/s, new %.2f tokens/s, new/old %s, losses bitwise equal: %s\n' \
        "$i" "$o" "$n" "$r" "$same"
done
echo "median new/old: $(printf '%s\n' "${ratios[@]}" | python3 -c 'import statistics, sys; print(f"{statistics.median(float(l) for l in sys.stdin):.4f}")')"
python3 - "$work" "$pairs" <<'PY'
import json, sys
work, pairs = sys.argv[1], int(sys.argv[2])
fastest = {side: min(min(json.load(open(f"{work}/{side}.{i}.json"))["step_s"]) for i in range(1, pairs + 1))
           for side in ("old", "new")}
print(f"fastest step: old {fastest['old']:.3f} s, new {fastest['new']:.3f} s, "
      f"new/old speed {fastest['old'] / fastest['new']:.4f}")
PY
