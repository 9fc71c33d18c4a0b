#!/usr/bin/env bash
# Tests xent.cu, optimizer.cu, lora.cu and dequant.cu on the CPU, without a GPU:
#   1. k2_ref.rs (the CPU backend's arithmetic, copied verbatim) is built with rustc and the
#      `half` crate's rlib from a cargo target directory (no cargo run), and writes inputs and
#      expected outputs into $K2_REF;
#   2. k2_check.cpp runs the kernels on them and compares, bitwise where the kernels promise
#      it: under the shared emulator (scripts/cuda-emu/run.py: fibers, two schedule orders,
#      ASan/UBSan, poisoned shared memory) where it exists, else (or with --own) under
#      k2_emu.h (g++, one thread per CUDA thread).
# Usage: scripts/cuda-emu/tests/run-k2.sh [--own] [TARGET_DIR]   (TARGET_DIR: where to find
# {release,debug}/deps/libhalf-*.rlib; default: target, then /work/main/target)
set -euo pipefail
own=0
if [ "${1:-}" = "--own" ]; then own=1; shift; fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
kernels=$root/src/backend/cuda/kernels
work=$(mktemp -d /tmp/k2-emu.XXXXXX)
trap 'rm -rf "$work"' EXIT

rlib=""
for t in "${1:-}" "$root/target" /work/main/target; do
    [ -n "$t" ] || continue
    for mode in release debug; do
        c=$(ls "$t/$mode/deps"/libhalf-*.rlib 2>/dev/null | head -1 || true)
        if [ -n "$c" ]; then rlib=$c; break 2; fi
    done
done
[ -n "$rlib" ] || { echo "run-k2: no libhalf-*.rlib found (build memwall once)"; exit 2; }

rustc -O --edition 2021 -o "$work/k2_ref" "$here/k2_ref.rs" \
    --extern half="$rlib" -L dependency="$(dirname "$rlib")"
"$work/k2_ref" "$work/ref"
export K2_REF="$work/ref"

if [ $own = 0 ] && [ -f "$root/scripts/cuda-emu/run.py" ]; then
    python3 "$root/scripts/cuda-emu/run.py" ${K2_EMU_FLAGS:-} "$here/k2_check.cpp"
    exit 0
fi

# The prelude with its two f16 inline-PTX conversions replaced by the emulation's.
python3 - "$kernels/common.cuh" "$work/prelude_emu.cuh" <<'EOF'
import sys
s = open(sys.argv[1]).read()
a = 'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));'
b = 'asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));'
assert a in s and b in s, "common.cuh's f16 conversions changed: update run-k2.sh"
s = s.replace(a, 'f = emu_f16_to_f32(x.bits);').replace(b, 'r.bits = emu_f32_to_f16(x);')
open(sys.argv[2], 'w').write(s)
EOF

g++ -std=c++20 -O1 -ffp-contract=off -pthread -DK2_OWN_EMU -I"$root" \
    -include "$here/k2_emu.h" -include "$work/prelude_emu.cuh" \
    -o "$work/k2_check" "$here/k2_check.cpp"
"$work/k2_check"
