#!/usr/bin/env python3
"""Writes a chat JSONL file for timing `memwall prepare` (docs/benchmarks.md).

Usage: scripts/make-chat-bench.py OUT.jsonl [--mb 100] [--seed 0] [--text DIR]

Each line is an OpenAI-style conversation, `{"messages": [{"role", "content"}, ...]}`: a
system turn in about a third of them, then 1 to 4 user/assistant exchanges; each turn is a
few hundred characters (80 to 600) cut from the plays in DIR (default
../shared/data/shakespeare, relative to the repository), at whitespace, its whitespace
folded to single spaces. Lines are written until the file holds about `--mb` MB (10^6 bytes).
The same seed and text give the same file, byte for byte. Needs only Python 3's standard
library (no memwall).
"""

import argparse
import json
import os
import random
import re
import sys


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--mb", type=float, default=100.0, help="size in MB (10^6 bytes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--text",
        default=os.path.join(here, "..", "..", "shared", "data", "shakespeare"),
        help="folder of .txt files the turns are cut from",
    )
    a = p.parse_args()

    names = sorted(n for n in os.listdir(a.text) if n.endswith(".txt"))
    if not names:
        sys.exit(f"no .txt files in {a.text}")
    text = " ".join(
        re.sub(r"\s+", " ", open(os.path.join(a.text, n), encoding="utf-8").read())
        for n in names
    )
    rng = random.Random(a.seed)

    def cut():
        n = rng.randint(80, 600)
        start = rng.randrange(0, len(text) - n - 1)
        # Start and end at whitespace so that words stay whole.
        s = text.find(" ", start) + 1
        e = text.rfind(" ", s, s + n)
        if e <= s:
            e = s + n
        return text[s:e].strip() or "..."

    limit = int(a.mb * 1e6)
    written = 0
    lines = 0
    with open(a.out, "w", encoding="utf-8") as f:
        while written < limit:
            msgs = []
            if rng.random() < 0.35:
                msgs.append({"role": "system", "content": cut()})
            for _ in range(rng.randint(1, 4)):
                msgs.append({"role": "user", "content": cut()})
                msgs.append({"role": "assistant", "content": cut()})
            line = json.dumps({"messages": msgs}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            lines += 1
    print(f"wrote {a.out}: {lines} conversations, {written / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
