#!/usr/bin/env python3
"""Lists import cycles between the files of src/ (the house rule: none), and checks that
src/plan imports nothing from backend::cpu outside its tests.

A file imports another when it names a path through `use crate::...`, `use super::...` or a
`crate::a::b` path in its code; a path resolves to the deepest module file that exists.
Test modules (`#[cfg(test)] mod tests { ... }` at the end of a file) are left out.
Exit status 1 when a cycle or a forbidden import is found.
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(path):
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return rel


files = {}
for d, _, names in os.walk(ROOT):
    for n in names:
        if n.endswith(".rs"):
            p = os.path.join(d, n)
            files[tuple(module_of(p))] = p


def resolve(parts):
    """The deepest existing module file for a module path."""
    for k in range(len(parts), -1, -1):
        if tuple(parts[:k]) in files:
            return tuple(parts[:k])
    return None


def strip_tests(text):
    """The file without its test module and comments (doc links are not imports)."""
    m = re.search(r"\n#\[cfg\(test\)\]\s*\nmod tests\b", text)
    text = text[: m.start()] if m else text
    return re.sub(r"//[^\n]*", "", text)


def paths_in(text):
    """Module paths used by a file: `use` trees (one level of braces) and inline crate paths."""
    out = []
    for m in re.finditer(r"\buse\s+((?:crate|super|self)(?:::\w+)*)(?:::\{([^;]*)\})?", text):
        base = m.group(1).split("::")
        if m.group(2):
            for item in re.split(r",", m.group(2)):
                item = item.strip().split(" as ")[0].strip()
                if not item:
                    continue
                sub = item.split("::{")[0].split("::")
                out.append(base + [s for s in sub if s and s != "self"])
        else:
            out.append(base)
    for m in re.finditer(r"\b(crate(?:::\w+)+)", text):
        out.append(m.group(1).split("::"))
    return out


graph = {}
for mod, path in files.items():
    text = strip_tests(open(path, encoding="utf-8").read())
    deps = set()
    for p in paths_in(text):
        here = list(mod) if not path.endswith(("mod.rs", "lib.rs")) else list(mod)
        if p[0] == "crate":
            target = p[1:]
        elif p[0] == "super":
            base = list(mod[:-1]) if not path.endswith("mod.rs") else list(mod[:-1])
            rest = p[1:]
            while rest and rest[0] == "super":
                base, rest = base[:-1], rest[1:]
            target = base + rest
        else:  # self
            target = here + p[1:]
        r = resolve(target)
        if r is not None and r != mod and r != ():
            deps.add(r)
    graph[mod] = deps

# Cycles: strongly connected components with more than one file.
index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]


def strong(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
        if w not in index:
            strong(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            sccs.append(comp)


sys.setrecursionlimit(10000)
for v in list(graph):
    if v not in index:
        strong(v)

bad = 0
for comp in sccs:
    bad += 1
    print("import cycle:", " <-> ".join(sorted("/".join(c) for c in comp)))
for mod, deps in graph.items():
    if mod[:1] == ("plan",):
        for d in deps:
            if d[:2] == ("backend", "cpu"):
                bad += 1
                print(f"forbidden: {'/'.join(mod)} imports {'/'.join(d)} (the plan does not know the backend)")
print(f"{len(graph)} files, {sum(len(d) for d in graph.values())} imports: {bad} problems")
sys.exit(1 if bad else 0)
