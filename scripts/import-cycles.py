#!/usr/bin/env python3
"""Lists import cycles between the files of src/ and between its top-level modules (src/plan,
src/backend, ...; the house rule: none, so the module graph runs one way, down to src/ir and
src/dtype), and checks that no file of src/plan reaches backend::cpu, directly or through the
files it imports. With --order, prints the modules from the lowest (imports nothing of the
crate) to the highest, each with the modules it imports.

A file imports another when it names an item of it: through a `use` tree (braces nested to
any depth, `pub use` re-exports included), or through a path in its code (`crate::a::b`,
`super::x`, `self::x`, `child::f` for a child module, or `name::x` where `name` was imported
by a `use`). A path resolves to the module file that defines the item it names: a module's
re-exports (`pub use child::Item` in a `mod.rs`) are followed to where the item lives, so a
file that takes `Item` through its parent's facade imports the child, not the parent, and a
parent that re-exports a child depends on that child.

Left out: modules compiled only for tests (`#[cfg(test)] mod x;`, and the `mod tests { ... }`
block at the end of a file). Comments and string literals are not code.
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
    return tuple(rel)


files = {}
for d, _, names in os.walk(ROOT):
    for n in names:
        if n.endswith(".rs"):
            p = os.path.join(d, n)
            if os.path.relpath(p, ROOT) in ("main.rs", "cli.rs"):
                continue  # the binary's: it uses the library as `memwall::`, never `crate::`
            files[module_of(p)] = p


def code_only(text):
    """The text with comments, string and char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            out.append(" ")
        elif c == "r" and re.match(r'r#*"', text[i:]) and not re.match(r"\w", text[i - 1 : i] or " "):
            hashes = re.match(r'r(#*)"', text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            i = n if end < 0 else end + 1 + len(hashes)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and (text[i + 1 : i + 2] == "\\" or text[i + 2 : i + 3] == "'"):
            j = text.find("'", i + 2)
            i = n if j < 0 else j + 1
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def blocks(code, mod):
    """The file's code split by inline module: (module path, its own code) pairs, the file's
    own code first; blocks of `#[cfg(test)] mod x { ... }` are left out."""
    out, own, i = [], [], 0
    for m in re.finditer(r"(#\[cfg\(test\)\]\s*)?(?:pub(?:\(\w+\))?\s+)?mod\s+(\w+)\s*\{", code):
        if m.start() < i:
            continue  # nested in a block already taken
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        own.append(code[i : m.start()])
        if not m.group(1):
            out += blocks(code[m.end() : j - 1], mod + (m.group(2),))
        i = j
    own.append(code[i:])
    return [(mod, "".join(own))] + out


def test_only_children(code, mod):
    """Child modules this file declares for tests only."""
    return {
        mod + (m.group(1),)
        for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:pub(?:\(\w+\))?\s+)?mod\s+(\w+)\s*;", code)
    }


def use_tree(s):
    """Expands a `use` tree (`a::{b, c::{d as e, self}}`) into (path, name) pairs: the path's
    segments and the name it binds (None for `*` and for `self` at the top)."""
    s = re.sub(r"\s+", "", s)
    out = []

    def walk(prefix, s, i):
        # Parses a list of trees from s[i:] up to a closing brace or the end; returns the index.
        while i < len(s):
            m = re.match(r"((?:\w+::)*)(\{|\*|\w+(?:as\w+)?)", s[i:])
            if not m:
                return i
            segs = [x for x in m.group(1).split("::") if x]
            i += m.end()
            head = m.group(2)
            if head == "{":
                i = walk(prefix + segs, s, i)
                i += 1  # the closing brace
            elif head != "*":
                name, alias = (head.split("as") + [None])[:2] if re.match(r"\w+as\w+$", head) and head not in ("as",) else (head, None)
                if name == "self":
                    out.append((prefix + segs, alias or (prefix + segs)[-1]))
                else:
                    out.append((prefix + segs + [name], alias or name))
            if i < len(s) and s[i] == ",":
                i += 1
            elif i < len(s) and s[i] == "}":
                return i
        return i

    walk([], s, 0)
    return out


# Per file: its code, its `use` pairs, and the names its uses bind.
code_of, uses_of, tests_only = {}, {}, set()
for mod, path in files.items():
    code = code_only(open(path, encoding="utf-8").read())
    tests_only |= test_only_children(code, mod)
    code_of[mod] = blocks(code, mod)
    uses_of[mod] = [
        [
            (segs, n, bool(m.group(1)))
            for m in re.finditer(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", text)
            for segs, n in use_tree(m.group(2))
        ]
        for _, text in code_of[mod]
    ]


def absolute(mod, segs, bound):
    """The path from the crate root that `segs`, written in `mod`, names; None when it is
    outside the crate (std, a dependency) or a local name."""
    if not segs:
        return None
    head, rest = segs[0], segs[1:]
    if head == "crate":
        return list(rest)
    if head == "self":
        return list(mod) + rest
    if head == "super":
        base = list(mod[:-1])
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
        return base + rest
    if mod + (head,) in files:
        return list(mod) + segs
    if head in bound and bound[head] is not None:
        return bound[head] + rest
    return None


# The names each module's `use`s bind, as absolute paths (re-exports and private imports
# alike: a child may name either through `super::`).
bound_of = {}
for mod in files:
    bound = {}
    for segs, name, _ in uses_of[mod][0]:
        if name and name != "self":
            bound[name] = absolute(mod, segs, {})
    bound_of[mod] = bound


def resolve(path, seen=()):
    """The module file defining what the absolute `path` names."""
    cur = ()
    for k, seg in enumerate(path):
        if cur + (seg,) in files:
            cur = cur + (seg,)
            continue
        target = bound_of.get(cur, {}).get(seg)
        key = (cur, seg)
        if target is not None and key not in seen:
            return resolve(target + list(path[k + 1 :]), seen + (key,))
        return cur
    return cur


PATH = re.compile(r"(?<![\w:])((?:\w+::)+\w+)")

graph = {}
why = {}  # (file, file it imports): the first path that made the edge
for mod in files:
    if mod in tests_only or any(mod[: k] in tests_only for k in range(len(mod))):
        continue
    deps = set()
    for (inner, text), uses in zip(code_of[mod], uses_of[mod]):
        bound = {n: absolute(inner, segs, {}) for segs, n, _ in uses if n and n != "self"}
        # A re-export is the module's facade, not a need of its own code: a path through it
        # resolves to the file defining the item, so it is not an edge of this file.
        paths = [segs for segs, _, public in uses if not public]
        body = re.sub(r"\buse\s+[^;]+;", " ", text)
        paths += [m.group(1).split("::") for m in PATH.finditer(body)]
        for segs in paths:
            a = absolute(inner, segs, bound)
            if a is None:
                continue
            r = resolve(a)
            if r != mod and r != () and r not in tests_only:
                deps.add(r)
                why.setdefault((mod, r), "::".join(segs))
    graph[mod] = deps

# Cycles: strongly connected components with more than one file.
index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]


def strong(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
        if w not in graph:
            continue
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


def name(m):
    return "/".join(m)


sys.setrecursionlimit(10000)
for v in list(graph):
    if v not in index:
        strong(v)

bad = 0
for comp in sccs:
    bad += 1
    members = set(comp)
    print("import cycle:", " <-> ".join(sorted(name(c) for c in comp)))
    for c in sorted(comp):
        inside = sorted(d for d in graph[c] if d in members)
        print(f"    {name(c)} imports " + ", ".join(f"{name(d)} ({why[(c, d)]})" for d in inside))
# The planner knows no backend: no file of src/plan reaches backend/cpu, directly or
# through what it imports (dist, model, ...).
for mod in sorted(graph):
    if mod[:1] != ("plan",):
        continue
    seen, todo, via = {mod}, [mod], {mod: None}
    while todo:
        v = todo.pop()
        for d in sorted(graph.get(v, ())):
            if d not in seen:
                seen.add(d)
                via[d] = v
                todo.append(d)
    for d in sorted(seen):
        if d[:2] == ("backend", "cpu"):
            chain, v = [], d
            while v is not None:
                chain.append(name(v))
                v = via[v]
            bad += 1
            print(f"forbidden: {' -> '.join(reversed(chain))} (the plan does not know the backend)")
            break
# Modules: the crate's top-level modules (src/plan, src/backend, ...) import each other
# one way too. A module imports another when one of its files imports one of the other's.
modules = {}
for f, deps in graph.items():
    if len(f) == 0:
        continue
    m = f[0]
    modules.setdefault(m, set())
    for d in deps:
        if d and d[0] != m:
            modules[m].add(d[0])
            why.setdefault(((m,), (d[0],)), f"{name(f)} -> {name(d)} ({why[(f, d)]})")
mod_graph = {(m,): {(d,) for d in ds} for m, ds in modules.items()}
graph, index, low, stack, on, sccs, counter = mod_graph, {}, {}, [], set(), [], [0]
for v in list(graph):
    if v not in index:
        strong(v)
for comp in sccs:
    bad += 1
    members = set(comp)
    print("module cycle:", " <-> ".join(sorted(name(c) for c in comp)))
    for c in sorted(comp):
        for d in sorted(x for x in graph[c] if x in members):
            print(f"    {name(c)} -> {name(d)}: {why[(c, d)]}")
if "--order" in sys.argv and not sccs:
    done, order = set(), []
    while len(order) < len(modules):
        ready = sorted(m for m in modules if m not in done and modules[m] <= done)
        order += ready
        done |= set(ready)
    for m in order:
        print(f"{m}: {', '.join(sorted(modules[m])) or '-'}")
print(
    f"{len(files)} files, {len(modules)} modules "
    f"({sum(len(d) for d in modules.values())} module imports): {bad} problems"
)
sys.exit(1 if bad else 0)
