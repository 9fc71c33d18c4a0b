#!/usr/bin/env bash
# Prepares a GPU run on a machine without one (the GPU machines have no Rust): builds memwall
# with the `cuda` feature and the test binaries scripts/gpu-check.sh runs, strips them, and
# puts them with the references the check needs in .gpu/ (ignored by git), which the device
# tool then carries:
#   scripts/gpu-build.sh && <device run: carry [".gpu"], command "scripts/gpu-check.sh">
# Prints the folder's size (the device tool carries 64 MiB at most).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu
rm -rf "$out"
mkdir -p "$out/bin"
cargo build --release --features cuda
cp target/release/memwall "$out/bin/memwall"
# The test binaries, by name, from cargo's own report of what it built.
cargo test --features cuda --no-run --message-format=json --test backend_ops --test cuda_kernels --test cuda_device \
    | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
' "$out/bin"
strip "$out"/bin/*
# What the checks compare against: PyTorch's reference script (../shared does not travel).
cp ../shared/bench/torch_reference.py "$out/" 2>/dev/null || echo "gpu-build: no ../shared/bench/torch_reference.py: the PyTorch reference will be skipped"
# Shakespeare prepared (GPT-2 tokens) for a training run on the GPU.
if [ -d ../shared/data/shakespeare ]; then
    "$out/bin/memwall" prepare ../shared/data/shakespeare --out "$out/data" >/dev/null
else
    echo "gpu-build: no ../shared/data/shakespeare: the training run will be skipped"
fi
git rev-parse HEAD > "$out/commit"
du -sh "$out" "$out"/bin/*
