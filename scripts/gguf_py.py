#!/usr/bin/env python3
"""What the `gguf` Python package (llama.cpp's gguf-py) makes of memwall's inputs and outputs,
for the tests that check memwall's GGUF export against it (`.ci/run` installs gguf and numpy
into target/pyenv and passes that python as MEMWALL_GGUF_PY).

  gguf_py.py quantize TYPE IN.f32 OUT.bin    little-endian f32 values -> gguf.quants.quantize
  gguf_py.py dequantize TYPE IN.bin OUT.f32  block bytes -> gguf.quants.dequantize
  gguf_py.py metadata FILE.gguf OUT.json     GGUFReader's fields (GGUF.* left out), as
                                             {key: {"types": [...], "value": ...}}
  gguf_py.py tensor-names ARCH N OUT.json    the tensor names gguf-py's constants give
                                             architecture ARCH (MODEL_TENSORS, TENSOR_NAMES)
                                             for N blocks, as a JSON list

TYPE is a GGMLQuantizationType name (Q8_0, Q4_K, ...). Exit status 2 when gguf or numpy is
missing, 1 on any other failure.
"""
import json
import sys

try:
    import numpy as np
    import gguf
    from gguf.quants import dequantize, quantize
except ImportError as e:
    print(f"gguf_py.py: {e}: install them with `pip install gguf numpy` (.ci/run does)", file=sys.stderr)
    sys.exit(2)


def plain(v):
    """JSON-ready: numpy scalars and arrays as Python numbers and lists."""
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, np.ndarray):
        return [plain(x) for x in v.tolist()]
    if isinstance(v, np.generic):
        return v.item()
    return v


def main(argv):
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if len(args) != {"quantize": 3, "dequantize": 3, "metadata": 2, "tensor-names": 3}.get(cmd):
        sys.exit(__doc__)
    if cmd == "quantize":
        a, b, c = args
        x = np.fromfile(b, dtype="<f4")
        quantize(x, gguf.GGMLQuantizationType[a]).tofile(c)
    elif cmd == "dequantize":
        a, b, c = args
        q = np.fromfile(b, dtype=np.uint8)
        dequantize(q, gguf.GGMLQuantizationType[a]).astype("<f4").tofile(c)
    elif cmd == "tensor-names":
        a, b, c = args
        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == a)
        names = []
        for t in gguf.MODEL_TENSORS[arch]:
            fmt = gguf.TENSOR_NAMES[t]
            names += [fmt.format(bid=i) for i in range(int(b))] if "{bid}" in fmt else [fmt]
        with open(c, "w") as fh:
            json.dump(names, fh)
    else:
        a, b = args
        r = gguf.GGUFReader(a)
        out = {}
        for name, f in r.fields.items():
            if name.startswith("GGUF."):
                continue
            out[name] = {"types": [t.name for t in f.types], "value": plain(f.contents())}
        with open(b, "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
