#!/usr/bin/env python3
"""Builds and runs the CPU-emulated tests of src/backend/cuda/kernels/attention.cu and
attention_mma.cu (attention_check.cpp with attention_emu.h): the prelude common.cuh and both
sources are rewritten for g++ (the f16 `asm` conversions become _Float16 ones, the tensor cores'
`mma.sync` asm a call of the emulator's emu_mma_m16n8k16; `__shared__` variables function
statics, `extern __shared__` arrays a pointer into the emulator's guarded buffer) into a
generated header.

    python3 scripts/cuda-emu/tests/attention_run.py [--tsan] [--quick | --long | --window]

--tsan builds with ThreadSanitizer (a missing barrier between shared-memory writes and reads
shows up as a data race); --quick runs two cases only (and a windowed one), --long adds a
T = 200 case, --window runs only the sliding-window cases (FMA and mma entries). The
kernel sources are $ATT_SRC and $ATT_MMA_SRC when set (to try a modified copy, e.g. with a
planted bug), else attention.cu and attention_mma.cu."""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
K = os.path.join(ROOT, "src", "backend", "cuda", "kernels")
OUT = os.environ.get("ATT_EMU_DIR", "/tmp/attention-emu")


def rewrite(src):
    src = src.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));',
                      "{ _Float16 hh; std::memcpy(&hh, &x.bits, 2); f = (float)hh; }")
    src = src.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));',
                      "{ _Float16 hh = (_Float16)x; std::memcpy(&r.bits, &hh, 2); }")
    # mw_mma_m16n8k16<bf16 | f16>: the whole asm statement becomes the emulator's call.
    src, n = re.subn(r'asm volatile\("mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)\.'
                     r'\1\.f32 .*?\);',
                     lambda m: f"emu_mma_m16n8k16(c, a, b, {'true' if m[1] == 'bf16' else 'false'});",
                     src, flags=re.S)
    assert "asm(" not in src and "asm volatile" not in src
    src = src.replace("extern __shared__ float att_sm[];", "float* att_sm = emu_dyn_smem;")
    src = src.replace("extern __shared__ unsigned int attm_sm[];",
                      "unsigned int* attm_sm = (unsigned int*)emu_dyn_smem;")
    src = src.replace("__shared__", "static")
    return src


def main():
    os.makedirs(OUT, exist_ok=True)
    gen = os.path.join(OUT, "attention_gen.h")
    text = rewrite(open(os.path.join(K, "common.cuh")).read()) + "\n" + \
        rewrite(open(os.environ.get("ATT_SRC", os.path.join(K, "attention.cu"))).read()) + \
        "\n" + rewrite(open(os.environ.get("ATT_MMA_SRC",
                                            os.path.join(K, "attention_mma.cu"))).read())
    open(gen, "w").write(text)
    exe = os.path.join(OUT, "attention_check")
    # No strict aliasing: attention_mma.cu reads its shared memory as 16- and 32-bit words.
    flags = ["-O2", "-g", "-fno-strict-aliasing"]
    if "--tsan" in sys.argv:
        flags = ["-O1", "-g", "-fsanitize=thread", "-fno-strict-aliasing"]
        exe += "-tsan"
    cmd = ["g++", "-std=c++20", *flags, "-pthread", f'-DATT_GEN="{gen}"', "-I", HERE,
           os.path.join(HERE, "attention_check.cpp"), "-o", exe]
    subprocess.run(cmd, check=True)
    mode = [m[2:] for m in ("--quick", "--long", "--window") if m in sys.argv]
    args = [exe] + mode[:1]
    sys.exit(subprocess.run(args).returncode)


if __name__ == "__main__":
    main()
