#!/usr/bin/env python3
"""Compiles every CUDA kernel source of memwall with NVRTC, as the CUDA backend does when it
starts (the prelude `common.cuh` before each source), for each architecture given, and checks
that every `extern "C" __global__` entry a source declares is in its PTX. Needs no GPU and no
driver: only NVRTC's library (PyPI `nvidia-cuda-nvrtc==13.0.88`).

    python3 scripts/nvrtc-check.py [--lib DIR] [--arch sm_80 --arch sm_90] [FILE.cu ...]

DIR holds libnvrtc.so.13 (default: $MEMWALL_NVRTC_LIB, else target/cuda-sdk/nvidia/cu13/lib,
where `.ci/run` installs the wheel). Prints each source's result and NVRTC's log on failure;
exits 1 when any source fails. This is the quick loop for writing kernels; `cargo test
--features cuda --test cuda_kernels` checks the same through the backend's own compile path.
"""
import argparse
import ctypes
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "src", "backend", "cuda", "kernels")


def load_nvrtc(libdir):
    path = os.path.join(libdir, "libnvrtc.so.13")
    if not os.path.exists(path):
        sys.exit(f"nvrtc-check: no {path}; install it with: python3 -m pip install --target "
                 f"target/cuda-sdk nvidia-cuda-nvrtc==13.0.88 (or pass --lib DIR)")
    # NVRTC opens its builtins library by name: load it first, from the same folder.
    ctypes.CDLL(os.path.join(libdir, "libnvrtc-builtins.so.13.0"), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(path)


def compile_one(nv, src, name, arch):
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    opts = [f"--gpu-architecture=compute_{arch[3:]}", "--std=c++17", "-default-device",
            "--fmad=false"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    ptx = b""
    if rc == 0:
        nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetPTX(prog, buf)
        ptx = buf.value
    nv.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), ptx.decode(errors="replace")


def entries(src):
    """The `extern "C"` entry names a source declares: direct ones, and those its
    MW_STORAGE_ENTRIES instantiations make (a macro `#define NAME(T, S) ... void name_##S(`)."""
    names = set(re.findall(
        r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+(\w+)\s*\(', src))
    for macro, body in re.findall(r"#define\s+(\w+)\(T,\s*S\)((?:.*\\\n)*.*)", src):
        if re.search(rf"MW_STORAGE_ENTRIES\(\s*{macro}\s*\)", src):
            for stem in re.findall(r"void\s+(\w+?)_##\s*S\b", body):
                for s in ("f32", "bf16", "f16"):
                    names.add(f"{stem}_{s}")
    return sorted(names)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.environ.get(
        "MEMWALL_NVRTC_LIB", os.path.join(ROOT, "target", "cuda-sdk", "nvidia", "cu13", "lib")))
    ap.add_argument("--arch", action="append")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    archs = a.arch or ["sm_80", "sm_90"]
    nv = load_nvrtc(a.lib)
    prelude = open(os.path.join(KERNELS, "common.cuh")).read()
    files = a.files or sorted(glob.glob(os.path.join(KERNELS, "*.cu")))
    failed = 0
    for f in files:
        body = open(f).read()
        src = prelude + "\n#line 1 \"" + os.path.basename(f) + "\"\n" + body
        want = entries(body)
        for arch in archs:
            rc, log, ptx = compile_one(nv, src, os.path.basename(f), arch)
            missing = [n for n in want if f".entry {n}(" not in ptx] if rc == 0 else want
            ok = rc == 0 and not missing and want
            print(f"{'ok  ' if ok else 'FAIL'} {os.path.basename(f)} {arch}: "
                  f"{len(want) - len(missing)}/{len(want)} entries")
            if not ok:
                failed += 1
                if log.strip():
                    print(log)
                if rc == 0 and missing:
                    print("  missing from the PTX:", ", ".join(missing))
                if not want:
                    print("  no extern \"C\" __global__ entry found")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
