#!/usr/bin/env python3
"""Runs CUDA kernel tests on the CPU under memwall's emulator (emu.h), with g++.

    python3 scripts/cuda-emu/run.py [options] TEST.cpp ...   build and run tests
    python3 scripts/cuda-emu/run.py --all                      every test in tests/ (and
                                                               tests/negative/, which must fail)
    python3 scripts/cuda-emu/run.py --compile-only K.cu ...    compile kernel sources alone

A test is a C++ file with a main() that includes "emu.h", then the kernel sources under test
(`#include "src/backend/cuda/kernels/foo.cu"`, a path relative to the test's folder or to the
repository root), then launches them with emu_launch and checks the results (emu::finish()).
Each `.cu`/`.cuh` the test includes is inlined here, transformed (below), after the prelude
common.cuh, as NVRTC sees them: prelude, then `#line 1 "foo.cu"`, then the source. The prelude
is the common.cuh next to the first kernel included (or next to this repository's kernels).

Transformations, applied to the inlined sources and to the test itself (line numbers kept):
  - asm("text" : "=c"(out) : "c"(in)) becomes emu::asm_exec("text", &(out), (in)): the real
    prelude's f16 conversions run as the emulator's bit-exact C++ versions;
  - `extern __shared__ T name[];` becomes a pointer to the launch's dynamic shared buffer;
  - after each `__shared__` declaration, a call that fills the variable with 0xFF bytes when a
    block first reaches it (uninitialised shared memory reads as NaN).

Each test binary runs once per schedule order (--order, default forward,reverse): a result that
depends on the order between synchronisation points is a missing __syncthreads or __syncwarp.
Compiled with AddressSanitizer and UBSan unless --no-san: an out-of-bounds access to a buffer
the test allocated is reported at its line. Build files go to target/cuda-emu/.

A test containing a line `// emu-expect-fail: TEXT` passes when some run of it fails with TEXT
in its output (the emulator's own negative tests).
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KERNELS = os.path.join(ROOT, "src", "backend", "cuda", "kernels")
BUILD = os.path.join(ROOT, "target", "cuda-emu")


def rel(path):
    r = os.path.relpath(path, ROOT)
    return path if r.startswith("..") else r


# --- Source scanning -----------------------------------------------------------------------

def mask_source(s):
    """`s` with the contents of comments, string and character literals replaced by spaces
    (newlines kept), so that patterns and brackets can be found at the same offsets."""
    out = list(s)
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if s.startswith("//", i):
            j = s.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif s.startswith("/*", i):
            j = s.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if s[k] != "\n":
                    out[k] = " "
            i = j
        elif c == '"' or c == "'":
            # A raw string R"(...)" is rare in kernels: treated as a plain one.
            j = i + 1
            while j < n and s[j] != c and s[j] != "\n":
                j += 2 if s[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def match_close(m, i):
    """The index of the bracket closing the one at m[i]."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for j in range(i, len(m)):
        c = m[j]
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")]}":
            if not stack or stack.pop() != c:
                return -1
            if not stack:
                return j
    return -1


def split_top(m, s, lo, hi, sep):
    """Splits s[lo:hi] on `sep` outside brackets (positions from the mask m)."""
    parts, depth, start = [], 0, lo
    for j in range(lo, hi):
        c = m[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append((start, j))
            start = j + 1
    parts.append((start, hi))
    return parts


def scope_kinds(m):
    """For each '{' offset, whether its block is a namespace-like one (namespace, extern "C")
    rather than a function or statement body; and a function giving, for an offset, whether
    it lies at namespace scope."""
    events = []  # (offset, +1 namespace / +2 other / -1 close)
    for j, c in enumerate(m):
        if c == "{":
            before = m[max(0, j - 200):j]
            ns = re.search(r'(\bnamespace\b[\w:\s]*|\bextern\s+"?\s*"?)\s*$', before) is not None
            # extern "C" { : the mask blanked the C, leaving `extern " "`.
            events.append((j, 1 if ns else 2))
        elif c == "}":
            events.append((j, -1))

    def at_namespace_scope(off):
        stack = []
        for j, k in events:
            if j >= off:
                break
            if k > 0:
                stack.append(k)
            elif stack:
                stack.pop()
        return all(k == 1 for k in stack)

    return at_namespace_scope


ATTR = re.compile(r"__align__\s*\(\s*\w+\s*\)|alignas\s*\([^)]*\)|__attribute__\s*\(\(.*?\)\)", re.S)


def transform(s, fname, unknown_asm):
    """The emulator's source transformations (see the module doc). `fname`: for #line."""
    m = mask_source(s)
    edits = []  # (start, end, replacement)
    ns_scope = scope_kinds(m)

    # asm statements.
    for a in re.finditer(r"\b(?:asm|__asm__|__asm)\b(\s+(?:volatile|__volatile__))?\s*\(", m):
        open_ = a.end() - 1
        close = match_close(m, open_)
        if close < 0:
            continue
        secs = split_top(m, s, open_ + 1, close, ":")
        text = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', s[secs[0][0]:secs[0][1]]))
        args = []
        for si, kind in ((1, "out"), (2, "in")):
            if si >= len(secs) or not s[secs[si][0]:secs[si][1]].strip():
                continue
            for lo, hi in split_top(m, s, secs[si][0], secs[si][1], ","):
                op = s[lo:hi]
                mo = re.match(r'\s*(?:\[\w+\]\s*)?"([^"]*)"\s*\((.*)\)\s*$', op, re.S)
                if not mo:
                    continue
                expr = mo.group(2)
                args.append(f"&({expr})" if kind == "out" else f"({expr})")
        norm = " ".join(text.replace("{", " ").replace("}", " ").replace("\\n", " ")
                        .replace("\\t", " ").split()).rstrip("; ")
        if norm not in ("cvt.rn.f16.f32 %0, %1", "cvt.f32.f16 %0, %1",
                        "cvt.rn.bf16.f32 %0, %1", "cvt.f32.bf16 %0, %1"):
            unknown_asm.append(f"{fname}:{s.count(chr(10), 0, a.start()) + 1}: {text!r}")
        orig = s[a.start():close + 1]
        rep = f'emu::asm_exec("{text}"' + "".join(", " + x for x in args) + ")"
        rep = rep.replace("\n", " ") + "\n" * orig.count("\n")
        edits.append((a.start(), close + 1, rep))

    # extern __shared__ T name[];
    ext_spans = []
    for e in re.finditer(r"\bextern\s+__shared__\b([^;{}]*?)\b(\w+)\s*\[\s*\]\s*;", m):
        ty = ATTR.sub(" ", s[e.start(1):e.end(1)])
        ty = " ".join(ty.split())
        name = e.group(2)
        orig = s[e.start():e.end()]
        line = s.count("\n", 0, e.start()) + 1
        if ns_scope(e.start()):
            rep = (f"\n#define {name} (reinterpret_cast<{ty}*>(emu::dynamic_shared()))\n"
                   f'#line {line + orig.count(chr(10))} "{fname}"\n')
        else:
            rep = (f"{ty}* const {name} = reinterpret_cast<{ty}*>(emu::dynamic_shared());"
                   + "\n" * orig.count("\n"))
        edits.append((e.start(), e.end(), rep))
        ext_spans.append((e.start(), e.end()))

    # __shared__ declarations: register each declared variable after the declaration.
    for d in re.finditer(r"\b__shared__\b", m):
        if any(lo <= d.start() < hi for lo, hi in ext_spans):
            continue
        if re.search(r"#\s*define\s+__shared__\s*$", m[max(0, d.start() - 40):d.start()]):
            continue
        # The end of the declaration: the next ';' outside brackets.
        j, depth = d.end(), 0
        while j < len(m):
            c = m[j]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth < 0:
                    break
            elif c == ";" and depth == 0:
                break
            j += 1
        if j >= len(m) or m[j] != ";":
            continue
        names = []
        for lo, hi in split_top(m, s, d.end(), j, ","):
            decl = ATTR.sub(" ", m[lo:hi])
            decl = decl.split("=")[0]
            br = decl.find("[")
            head = decl if br < 0 else decl[:br]
            ids = re.findall(r"[A-Za-z_]\w*", head)
            if ids:
                names.append(ids[-1])
        # `static __shared__` would become `static static`.
        st = re.search(r"\bstatic\s+$", m[max(0, d.start() - 20):d.start()])
        if st:
            edits.append((d.start() - len(st.group(0)), d.start(), ""))
        line = s.count("\n", 0, d.start()) + 1
        if ns_scope(d.start()):
            reg = "".join(f" static bool emu_shared_{n}_{line} = emu::shared_global((void*)&{n}, "
                          f"sizeof({n}));" for n in names)
        else:
            reg = "".join(f" emu::shared_decl(&{n}, sizeof({n}));" for n in names)
        edits.append((j + 1, j + 1, reg))

    for lo, hi, rep in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        s = s[:lo] + rep + s[hi:]
    return s


# --- Assembling a test ---------------------------------------------------------------------

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+\.cuh?)"\s*(?://.*|/\*.*)?$')


def repo_of(path):
    """The checkout holding `path` (the nearest folder above it with src/backend/cuda), or
    this one."""
    d = os.path.dirname(os.path.abspath(path))
    while d != os.path.dirname(d):
        if os.path.isdir(os.path.join(d, "src", "backend", "cuda")):
            return d
        d = os.path.dirname(d)
    return ROOT


def resolve(name, test_dir):
    for base in (test_dir, repo_of(os.path.join(test_dir, "x")), ROOT):
        p = os.path.normpath(os.path.join(base, name))
        if os.path.exists(p):
            return p
    return None


def assemble(test, prelude_override, unknown_asm):
    """The translation unit for `test`: its text with the kernel sources inlined."""
    src = open(test).read()
    test_dir = os.path.dirname(os.path.abspath(test))
    out = [f'#line 1 "{rel(os.path.abspath(test))}"\n']
    state = {"prelude": False}

    def prelude_for(kernel_path):
        if prelude_override:
            return prelude_override
        here = os.path.join(os.path.dirname(kernel_path), "common.cuh")
        return here if os.path.exists(here) else os.path.join(KERNELS, "common.cuh")

    def inline_file(path):
        text = open(path).read()
        out.append(f'#line 1 "{rel(path)}"\n')
        out.append(transform(text, rel(path), unknown_asm))
        if not text.endswith("\n"):
            out.append("\n")

    trel = rel(os.path.abspath(test))
    body = transform(src, trel, unknown_asm).split("\n")
    lineno = 1  # the test's own line number of body[i]
    for line in body:
        here, lineno = lineno, lineno + 1
        ml = re.match(r'#line (\d+) "', line)
        if ml:
            lineno = int(ml.group(1))
        mo = INCLUDE.match(line)
        if not mo:
            out.append(line + "\n")
            continue
        path = resolve(mo.group(1), test_dir)
        if path is None:
            sys.exit(f"{trel}:{here}: no file {mo.group(1)} (relative to the test or "
                     f"to its checkout's root)")
        is_prelude = os.path.basename(path) == "common.cuh"
        if is_prelude or path.endswith(".cu"):
            if not state["prelude"]:
                state["prelude"] = True
                inline_file(path if is_prelude else prelude_for(path))
            if not is_prelude:
                inline_file(path)
        else:
            inline_file(path)
        out.append(f'#line {here + 1} "{trel}"\n')
    return "".join(out)


def compile_tu(tu_text, name, a):
    os.makedirs(BUILD, exist_ok=True)
    san = "nosan" if a.no_san else "san"
    cpp = os.path.join(BUILD, f"{name}.gen.cpp")
    exe = os.path.join(BUILD, f"{name}.{san}")
    with open(cpp, "w") as f:
        f.write(tu_text)
    cmd = ["g++", "-std=c++20", "-O1", "-g", "-pthread", "-ffp-contract=off",
           "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function",
           "-Wno-unused-variable", "-I", HERE, "-iquote", ROOT]
    if a.test_dir:
        cmd += ["-iquote", a.test_dir, "-iquote", repo_of(os.path.join(a.test_dir, "x"))]
    if not a.no_san:
        cmd += ["-fsanitize=address,undefined,float-cast-overflow", "-fno-sanitize-recover=all",
                "-fno-omit-frame-pointer"]
    cmd += [f"-D{d}" for d in a.define or []]
    cmd += a.cxxflag or []
    cmd += [cpp, "-o", exe]
    if a.verbose:
        print(" ".join(cmd))
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stdout + r.stderr, time.time() - t0
    return exe, r.stdout + r.stderr, time.time() - t0


def run_test(test, a):
    name = os.path.splitext(os.path.basename(test))[0]
    unknown = []
    src = open(test).read()
    expect = re.search(r"//\s*emu-expect-fail:\s*(.+?)\s*$", src, re.M)
    if expect and a.no_san and re.search(r"//\s*emu-needs-san\b", src):
        print(f"skip {rel(test)}: needs the sanitizers (without --no-san)")
        return True
    a.test_dir = os.path.dirname(os.path.abspath(test))
    tu = assemble(test, a.prelude, unknown)
    for u in unknown:
        print(f"  note: inline PTX the emulator does not know (fails if reached): {u}")
    exe, log, dt = compile_tu(tu, name, a)
    if log.strip():
        print(log.rstrip())
    if exe is None:
        print(f"FAIL {rel(test)}: does not compile")
        return False
    env = dict(os.environ)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
    results = []
    for order in a.order.split(","):
        env["EMU_ORDER"] = order
        t0 = time.time()
        try:
            r = subprocess.run([exe], env=env, capture_output=True, text=True,
                               timeout=a.timeout)
            rc, out = r.returncode, (r.stdout + r.stderr).rstrip()
        except subprocess.TimeoutExpired as e:
            rc = 124
            out = ((e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
                errors="replace") + f"\ntimed out after {a.timeout:g} s (a kernel loops?)")
        results.append((order, rc, out, time.time() - t0))
    if expect:
        want = expect.group(1)
        hit = [o for o, rc, out, _ in results if rc != 0 and want in out]
        ok = bool(hit)
        print(f"{'ok  ' if ok else 'FAIL'} {rel(test)}: expected failure "
              f"{'seen' if ok else 'NOT seen'} ({want!r}"
              f"{', order ' + ','.join(hit) if hit else ''})")
        if a.verbose or not ok:
            for o, rc, out, _ in results:
                print(f"  [{o}] exit {rc}\n" + "\n".join("    " + l for l in out.split("\n")))
        return ok
    ok = all(rc == 0 for _, rc, _, _ in results)
    notes = []
    for o, rc, out, t in results:
        notes += [l for l in out.split("\n") if l.startswith("emu: note") and l not in notes]
        if rc != 0 or a.verbose:
            print(f"  [{o}] exit {rc}, {t:.1f} s")
            print("\n".join("    " + l for l in out.split("\n")[-60:]))
    for l in notes if ok and not a.verbose else []:
        print("  " + l)
    print(f"{'ok  ' if ok else 'FAIL'} {rel(test)} (compile {dt:.1f} s; "
          + ", ".join(f"{o} {t:.1f} s" for o, _, _, t in results) + ")")
    return ok


def compile_only(kernel, a):
    """Compiles a kernel source alone (prelude + source), as a smoke test."""
    unknown = []
    kernel = os.path.abspath(kernel)
    prelude = a.prelude or (os.path.join(os.path.dirname(kernel), "common.cuh")
                            if os.path.exists(os.path.join(os.path.dirname(kernel), "common.cuh"))
                            else os.path.join(KERNELS, "common.cuh"))
    tu = '#include "emu.h"\n'
    tu += f'#line 1 "{rel(prelude)}"\n' + transform(open(prelude).read(), rel(prelude), unknown)
    if os.path.basename(kernel) != "common.cuh":
        tu += f'\n#line 1 "{rel(kernel)}"\n' + transform(open(kernel).read(), rel(kernel), unknown)
    tu += "\nint main() { return 0; }\n"
    a.test_dir = None
    name = "compile-" + os.path.splitext(os.path.basename(kernel))[0]
    exe, log, dt = compile_tu(tu, name, a)
    for u in unknown:
        print(f"  note: inline PTX the emulator does not know: {u}")
    if log.strip():
        print(log.rstrip())
    print(f"{'ok  ' if exe else 'FAIL'} {rel(kernel)} compiles under the emulator ({dt:.1f} s)")
    return exe is not None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--all", action="store_true", help="every test in tests/ and tests/negative/")
    ap.add_argument("--compile-only", action="store_true",
                    help="the files are kernel sources: compile each alone")
    ap.add_argument("--order", default="forward,reverse",
                    help="schedule orders, comma-separated: forward, reverse, random[:SEED]")
    ap.add_argument("--no-san", action="store_true", help="without ASan/UBSan (faster)")
    ap.add_argument("--prelude", help="the common.cuh to use (default: next to the kernel)")
    ap.add_argument("-D", "--define", action="append", help="a macro for g++, e.g. -D N=4")
    ap.add_argument("--cxxflag", action="append", help="an extra g++ flag")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    files = list(a.files)
    if a.all:
        files += sorted(glob.glob(os.path.join(HERE, "tests", "*_test.cpp")))
        files += sorted(glob.glob(os.path.join(HERE, "tests", "negative", "*_test.cpp")))
    if not files:
        ap.error("no test given (or --all)")
    if a.prelude:
        a.prelude = os.path.abspath(a.prelude)
    failed = 0
    for f in files:
        ok = compile_only(f, a) if a.compile_only else run_test(f, a)
        failed += not ok
    if len(files) > 1:
        print(f"{len(files) - failed} of {len(files)} passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
