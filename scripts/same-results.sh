#!/usr/bin/env bash
# same-results.sh: prove that a change of code changed no result.
#
# Usage:
#   scripts/same-results.sh [BASE_REV]
#   scripts/same-results.sh [--old-bin PATH] [--new-bin PATH] [--mpi] [BASE_REV]
#   scripts/same-results.sh [--old-mpi-bin PATH] [--new-mpi-bin PATH] [BASE_REV]
#
# Compares the memwall built from BASE_REV ("old") with the memwall built from the current
# working tree, uncommitted changes included ("new"), and prints one line per check,
# `same: <check>` or `DIFFERENT: <check> (<what>)`, then `N passed, M failed` (and `, K
# skipped` when checks were left out, each named on a `skipped:` line). Exits 1 when any check
# differs (or a run fails), 2 on a usage or set-up error.
#
# BASE_REV defaults to where this branch left main: `git merge-base HEAD origin/main` (or
# `main` when there is no origin/main). When that is HEAD itself (you are on main, or the
# branch has no commits of its own) and the tree is clean, or there is no main, the base is
# HEAD~1, so the last commit is the change under test; with uncommitted changes it stays HEAD.
#
# --old-bin / --new-bin take an already built memwall instead of building that side. The old
# side is built in a temporary git worktree of BASE_REV with its own target directory,
# <target>/same-results/base-target (seeded once from <target>/release so that dependencies
# are not rebuilt), and the binary is cached per commit in <target>/same-results/bin/<sha>/.
# The new side is `cargo build --release` of this tree. (Remove <target>/same-results to
# rebuild a cached base, e.g. after a toolchain update.)
#
# --mpi (or SAME_MPI=1) adds the 2-rank training checks (zero*-2ranks below), which need both
# sides built with `--features mpi` and `mpirun`: the old side is built as above with the
# feature (cached as <target>/same-results/bin/<sha>/memwall-mpi, also when --old-bin gives the
# plain one), the new side with `cargo build --release --features mpi --target-dir
# <target>/same-results/mpi-target` (a target directory of its own, seeded once from
# <target>/release, so that <target>/release/memwall stays the plain build). --old-mpi-bin /
# --new-mpi-bin take already built mpi binaries instead (and imply --mpi). Without --mpi those
# checks are not run, and a `skipped:` line says so and how to run them.
#
# Environment:
#   MEMWALL_CORPUS  text file(s) directory to tokenize (default ../shared/data/shakespeare)
#   MEMWALL_SAME_CACHE=user  use the user's cache (and its calibration) instead of a shared
#                   one made for the run (both sides then time plans with one calibration)
#   KEEP_WORK=1     keep the work directory (it is also kept when a check differs)
#   PLAN_COMPARE=whole  compare plans whole (schedule and op indices too), not by bytes
#   PLAN_COMPARE=none   do not compare plans (a change meant to move bytes, not results)
#   SAME_MPI=1      as --mpi
#   SAME_MPIRUN     the launcher of the 2-rank runs, before its `-np 2` (default `mpirun
#                   --allow-run-as-root --oversubscribe --bind-to none`, Open MPI's spelling)
#
# The models besides gpt2-tiny, made in the work directory (no network, no new fixture):
#   tiny-llama      tests/fixtures/hf-tiny-llama (Llama 3 RoPE scaling, grouped-query attention,
#                   head_dim 12), which has no tokenizer and a 97-token vocabulary, smaller than
#                   any byte-level tokenizer's 256 bytes: given one of its own, the tiny-bpe
#                   fixture's byte-level BPE cut to printable ASCII, space and newline (96 tokens,
#                   no merges) plus <|endoftext|>. Text outside that alphabet is dropped (the
#                   Shakespeare corpus has none); chat data can not use it (the fixtures are not
#                   ASCII, and such a tokenizer panics on them, src/data/tokenizer/fast.rs).
#   chat-llama      a Llama config of shapes that are whole q4_0/q8_0 blocks (C=32, ffn 64,
#                   head_dim 8, V=267, 512 positions) with the tiny-bpe tokenizer, from scratch;
#   chat-base       chat-llama after 10 steps on the chat data (by the new binary): the frozen
#                   base of the chat LoRA runs. (hf-tiny-llama's o_proj rows are 48 values, not
#                   whole blocks of 32 or 256, so no --base-quant q* is possible on it.)
#
# The checks, each run with both binaries (same arguments, same paths):
#   prepare         `memwall prepare CORPUS`: train.bin, val.bin and meta.json byte for byte
#                   (the runs below all read the new binary's data).
#   prepare-tiny-llama  the corpus with tiny-llama's tokenizer (`--tokenizer DIR`), the same way.
#   prepare-chat    `memwall prepare --tokenizer chat-llama --chat-template smollm2.jinja` of
#                   tests/fixtures/chat/conversations.jsonl (8 examples in the 5 formats, split
#                   6 / 2): every file, .idx, .mask and chat_template.jinja too, byte for byte.
#   tokenize-chat   `memwall tokenize` of the same, as text and as --json: stdout.
#   plan-*          `memwall plan --model gpt2 --batch 4 --seq 256 --json` (plain, bf16,
#                   recompute full, and one rank of 2 at --zero 0, 1, 2 and 3: plan-ranks2-zero*):
#                   the totals, bytes by category and every buffer's name,
#                   category, dtype, size and offset, but not the schedule nor the buffers'
#                   op indices and tiers (a refactor may add or split ops without moving a
#                   byte; PLAN_COMPARE=whole compares those too). Never compared:
#                   baseline_bytes and predicted_peak_rss_bytes (the plan's and each rank's
#                   in `ranks`), which hold the process's measured resident memory at
#                   start-up (machine- and moment-dependent),
#                   nor RAM's peak_bytes in `tiers` (the same sum); nor a top-level field
#                   only the new side writes (a report that grew, such as `tiers`). A base
#                   built before b81cb33 has u8 buffers where the new has ggml block types:
#                   compared by their bytes.
#   train configs   20 steps (evaluation and a checkpoint every 10 steps), each compared as
#                   below; `*resume` ones stop at step 10 and resume (--resume) to 20:
#                   - gpt2-tiny (batch 4, seq 64, 2 threads): fp32 (plain), each --recompute
#                     policy, grad-accum2, bf16, fp16, optim-state-int8/-bf16, resume, and
#                     offload-all (--offload all, --offload-dir in the work directory),
#                     offload-optimizer-grads (--offload optimizer,grads);
#                   - LoRA on tiny-llama (--init, batch 4, seq 64): lora (--lora 4),
#                     lora-targets-dropout (--lora 8 --lora-alpha 4 --lora-targets q,v,down
#                     --lora-dropout 0.1), lora-bf16-base (--base-quant bf16), lora-offload-all,
#                     lora-resume;
#                   - chat data (prepare-chat's, batch 2, seq 512): chat-pack (full training of
#                     chat-llama, examples packed: the default), chat-no-pack (--no-pack),
#                     chat-lora (--init chat-base --lora 4), chat-qlora-q4_0 and chat-qlora-q8_0
#                     (the same with --base-quant q4_0 / q8_0);
#                   - with --mpi: zero0-2ranks ... zero3-2ranks, gpt2-tiny under `mpirun -np 2`
#                     (batch 2 and 1 thread a rank) at --zero 0, 1, 2, 3: rank 0's files (the
#                     run directory is rank 0's; the other ranks' metrics.rank1.jsonl holds
#                     their own timings only and is not compared). Without --mpi, `skipped:`.
#                   Compared:
#                   - every file of every checkpoint (config.json, model.safetensors, or for
#                     LoRA adapter_config.json and adapter_model.safetensors, then
#                     optimizer.safetensors, trainer_state.json, and the tokenizer and chat
#                     template files a run carries), byte for byte; all of them are
#                     deterministic because both runs are made at the same --out path (the
#                     trainer state records the run and data paths) and hold no clock time;
#                   - metrics.jsonl, every field of every line except the timing and memory
#                     ones (tokens_per_s, step_s, rss_bytes, and any *_s, *rss*, *time*
#                     field): loss, val_loss, grad_norm, lr, loss_scale, step...; floats are
#                     printed exactly (shortest round-trip), so equal text is equal bits;
#                   - the run's plan.json, as for plan-*;
#                   - `memwall sample` from the final checkpoint (stdout; a LoRA checkpoint as
#                     `--model BASE --adapter CHECKPOINT`, the base its adapter_config.json
#                     names), by the plain binary of each side also for the 2-rank runs.
#
# Takes about 5 to 6 minutes on 2 cores once both binaries are built (the 2-rank checks add
# about 2); building a base adds about 5 (and with --mpi, once per side, about as much again).
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

old_bin=
new_bin=
old_mpi_bin=
new_mpi_bin=
base_rev=
mpi=${SAME_MPI:-0}
while [ $# -gt 0 ]; do
    case "$1" in
    --old-bin | --new-bin | --old-mpi-bin | --new-mpi-bin)
        [ $# -ge 2 ] && [ -x "$2" ] || { echo "same-results: $1 needs an executable" >&2; exit 2; }
        case "$1" in
        --old-bin) old_bin=$(realpath "$2") ;;
        --new-bin) new_bin=$(realpath "$2") ;;
        --old-mpi-bin) old_mpi_bin=$(realpath "$2"); mpi=1 ;;
        --new-mpi-bin) new_mpi_bin=$(realpath "$2"); mpi=1 ;;
        esac
        shift 2 ;;
    --mpi) mpi=1; shift ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "same-results: unknown option $1" >&2; usage >&2; exit 2 ;;
    *)
        [ -z "$base_rev" ] || { echo "same-results: one BASE_REV at most" >&2; exit 2; }
        base_rev=$1; shift ;;
    esac
done
[ "$mpi" = 0 ] || mpi=1

root=$(git rev-parse --show-toplevel)
cd "$root"
fixtures=$root/tests/fixtures

corpus=${MEMWALL_CORPUS:-$root/../shared/data/shakespeare}
if [ ! -e "$corpus" ] || [ -z "$(find "$corpus" -type f -print -quit 2>/dev/null)" ]; then
    echo "same-results: no corpus at $corpus: set MEMWALL_CORPUS to a text file or a directory" >&2
    echo "of UTF-8 text (e.g. the Shakespeare texts, see ../shared/data/README.md)" >&2
    exit 2
fi

# The 2-rank launcher, checked before anything is built.
launch=()
if [ "$mpi" = 1 ]; then
    read -ra mpirun <<<"${SAME_MPIRUN:-mpirun --allow-run-as-root --oversubscribe --bind-to none}"
    command -v "${mpirun[0]}" >/dev/null || {
        echo "same-results: --mpi needs ${mpirun[0]} (Open MPI: apt-get install openmpi-bin libopenmpi-dev libclang-dev)" >&2
        exit 2
    }
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/same-results.XXXXXX")
base_src=
keep=${KEEP_WORK:-0}
cleanup() {
    if [ -n "$base_src" ]; then git worktree remove --force "$base_src" 2>/dev/null || true; fi
    if [ "$keep" = 1 ]; then echo "work directory kept: $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

target_dir=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

# seed DIR: a new target directory DIR starts from a copy of <target>/release, so that the
# dependencies are not rebuilt.
seed() {
    if [ ! -d "$1/release" ] && [ -d "$target_dir/release/deps" ]; then
        mkdir -p "$1"
        cp -a "$target_dir/release" "$1/release"
    fi
}

# The new side: this working tree.
if [ -z "$new_bin" ]; then
    echo "building the working tree (release)"
    cargo build --release --quiet
    new_bin=$target_dir/release/memwall
fi
cp "$new_bin" "$work/memwall-new"
new_bin=$work/memwall-new
if [ "$mpi" = 1 ] && [ -z "$new_mpi_bin" ]; then
    echo "building the working tree (release, --features mpi)"
    seed "$target_dir/same-results/mpi-target"
    cargo build --release --quiet --features mpi --target-dir "$target_dir/same-results/mpi-target"
    new_mpi_bin=$target_dir/same-results/mpi-target/release/memwall
fi

# The old side: BASE_REV in a worktree of its own.
sha=
resolve_base() { # sets sha from BASE_REV (or its default), once
    [ -z "$sha" ] || return 0
    if [ -z "$base_rev" ]; then
        for main in origin/main main; do
            base_rev=$(git merge-base HEAD "$main" 2>/dev/null) && break
        done
        if [ -z "$base_rev" ] ||
            { [ "$base_rev" = "$(git rev-parse HEAD)" ] && [ -z "$(git status --porcelain --untracked-files=no)" ]; }; then
            base_rev=HEAD~1
        fi
    fi
    sha=$(git rev-parse --verify "$base_rev^{commit}")
    echo "base: $(git log -1 --format='%h %s' "$sha")"
}
built=
build_base() { # features ("" or "mpi"): sets built to BASE_REV's memwall with them, cached
    local features=$1 cached base_target
    resolve_base
    cached=$target_dir/same-results/bin/$sha/memwall${features:+-$features}
    if [ ! -x "$cached" ]; then
        base_target=$target_dir/same-results/base-target
        seed "$base_target"
        base_src=$target_dir/same-results/src.$$
        git worktree add --quiet --detach "$base_src" "$sha"
        echo "building $base_rev (release${features:+, --features $features}) in $base_src"
        cargo build --release --quiet ${features:+--features "$features"} \
            --manifest-path "$base_src/Cargo.toml" --target-dir "$base_target"
        mkdir -p "$(dirname "$cached")"
        cp "$base_target/release/memwall" "$cached.tmp"
        mv "$cached.tmp" "$cached"
        git worktree remove --force "$base_src"
        base_src=
    fi
    built=$cached
}
if [ -z "$old_bin" ]; then
    build_base ""
    old_bin=$built
fi
cp "$old_bin" "$work/memwall-old"
old_bin=$work/memwall-old
if cmp -s "$old_bin" "$new_bin"; then echo "note: the two binaries are byte-identical"; fi
if [ "$mpi" = 1 ]; then
    if [ -z "$old_mpi_bin" ]; then
        build_base mpi
        old_mpi_bin=$built
    fi
    cp "$old_mpi_bin" "$work/memwall-mpi-old"
    cp "$new_mpi_bin" "$work/memwall-mpi-new"
    for side in old new; do
        # A build without the feature refuses --zero at once; say so before any run.
        if command -v ldd >/dev/null && [[ "$(ldd "$work/memwall-mpi-$side" 2>&1)" != *libmpi* ]]; then
            echo "same-results: the $side mpi binary is not built with --features mpi (links no libmpi)" >&2
            exit 2
        fi
    done
    if cmp -s "$work/memwall-mpi-old" "$work/memwall-mpi-new"; then
        echo "note: the two mpi binaries are byte-identical"
    fi
    launch=("${mpirun[@]}" -np 2)
fi

# One calibration for both sides, in a user cache of the work directory: without one, each
# run measures the machine's FMA peak itself and plan.json's predicted times differ between
# any two runs (a busy machine measured 276 and 549 GFLOP/s back to back). Made by the new
# binary (`calibrate --quick`), for the thread counts the checks use: 2, the default (all
# cores), and with --mpi 1 (each rank's). MEMWALL_SAME_CACHE=user keeps the user's own cache
# instead.
if [ "${MEMWALL_SAME_CACHE:-}" != user ]; then
    export XDG_CACHE_HOME=$work/cache
    for t in $(printf "%s\n" 2 "$(nproc)" $([ "$mpi" = 0 ] || echo 1) | sort -u); do
        "$new_bin" calibrate --quick --threads "$t" >/dev/null 2>"$work/calibrate.log" || {
            echo "same-results: \`memwall calibrate --quick --threads $t\` failed:" >&2
            cat "$work/calibrate.log" >&2
            exit 2
        }
    done
fi

# The models besides gpt2-tiny (see the header).
models=$work/models
mkdir -p "$models/tiny-llama" "$models/chat-llama"
cp "$fixtures"/hf-tiny-llama/{config.json,model.safetensors,generation_config.json} "$models/tiny-llama/"
echo '{"eos_token": "<|endoftext|>"}' >"$models/tiny-llama/tokenizer_config.json"
python3 - "$fixtures/tiny-bpe/tokenizer.json" "$models/tiny-llama" <<'EOF'
import json, sys
tok = json.load(open(sys.argv[1]))
# Byte-level BPE maps printable ASCII to itself, space to Ġ and newline to Ċ.
vocab = {chr(c): c - 33 for c in range(33, 127)}
vocab["Ġ"], vocab["Ċ"] = len(vocab), len(vocab) + 1
tok["model"]["vocab"], tok["model"]["merges"] = vocab, []
eot = [t for t in tok["added_tokens"] if t["content"] == "<|endoftext|>"][0]
tok["added_tokens"] = [dict(eot, id=len(vocab))]
want = json.load(open(sys.argv[2] + "/config.json"))["vocab_size"]
assert len(vocab) + 1 == want, f"{len(vocab) + 1} tokens for a vocab_size of {want}"
json.dump(tok, open(sys.argv[2] + "/tokenizer.json", "w"), ensure_ascii=False)
EOF
cp "$fixtures/tiny-bpe/tokenizer.json" "$models/chat-llama/"
cat >"$models/chat-llama/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 267,
 "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
 "rope_theta": 10000.0, "tie_word_embeddings": false, "bos_token_id": 266, "eos_token_id": 266}
EOF
chat_template=$fixtures/chat/templates/smollm2.jinja
conversations=$fixtures/chat/conversations.jsonl

# compare.py KIND A B: prints what differs (nothing when the same); exit 1 when different.
cat >"$work/compare.py" <<'EOF'
import json, os, re, sys

# Fields that hold measured time or memory: they differ between any two runs.
PLAN_MEASURED = {"baseline_bytes", "predicted_peak_rss_bytes"}
METRIC_MEASURED = re.compile(r"(_s$|rss|time|elapsed)")

def first_diff(a, b, path=""):
    if type(a) is not type(b):
        return f"{path or '/'}: {a!r} vs {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}/{k}: only in {'new' if k in b else 'old'}"
            d = first_diff(a[k], b[k], f"{path}/{k}")
            if d:
                return d
    elif isinstance(a, list):
        if len(a) != len(b):
            return f"{path or '/'}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_diff(x, y, f"{path}[{i}]")
            if d:
                return d
    elif a != b:
        return f"{path or '/'}: {a!r} vs {b!r}"
    return None

def plan(path):
    d = json.load(open(path))
    for k in PLAN_MEASURED:
        d.pop(k, None)
    # Each rank's peak (`ranks`) counts the measured baseline too.
    for r in d.get("ranks", []):
        for k in PLAN_MEASURED:
            r.pop(k, None)
    # RAM's peak counts the measured baseline, as predicted_peak_rss_bytes does.
    for t in d.get("tiers", []):
        if t.get("tier") == "host":
            t.pop("peak_bytes", None)
    if os.environ.get("PLAN_COMPARE", "bytes") == "none":
        return {}
    if os.environ.get("PLAN_COMPARE", "bytes") == "bytes":
        # Where every byte is, not how the schedule is cut into ops: a refactor may split or
        # add ops (op indices move) without moving a byte.
        d.pop("schedule", None)
        for b in d.get("buffers", []):
            for k in ("first_op", "last_op", "tier"):
                b.pop(k, None)
    return d

def metrics(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    # The step-0 record (validation loss before the first update, no training figures) is
    # newer than some builds compared: the trajectory is compared from step 1 on.
    rows = [r for r in rows if not (r.get("step") == 0 and "loss" not in r)]
    if not rows or any("loss" not in r for r in rows):
        sys.exit(f"{path}: no loss in some line")
    return [{k: v for k, v in r.items() if not METRIC_MEASURED.search(k)} for r in rows]

def metrics_diff(a, b):
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} lines"
    for x, y in zip(a, b):
        # loss and val_loss first: the difference that matters most is named.
        for k in ["loss", "val_loss"] + sorted(set(x) | set(y)):
            if k in x or k in y:
                d = first_diff(x.get(k), y.get(k), k)
                if d:
                    return f"step {x.get('step')} {d}"
    return None

kind, a, b = sys.argv[1:]
if kind == "plan":
    old, new = plan(a), plan(b)
    # A field only the new side writes is a report that grew, not a result that changed
    # (e.g. `tiers`); one the old side wrote must still be there.
    for k in set(new) - set(old):
        new.pop(k)
    # Before DType::Ggml (b81cb33) a quantized LoRA base's buffers were u8, elems = bytes;
    # now their dtype is the block type (q8_0, bf16, ...) and elems counts values. Such a
    # buffer is the same when its bytes are (its offset and name are compared as ever).
    for x, y in zip(old.get("buffers", []), new.get("buffers", [])):
        if x.get("dtype") == "u8" != y.get("dtype") and x.get("elems") == x.get("bytes") == y.get("bytes"):
            y["dtype"], y["elems"] = x["dtype"], x["elems"]
    d = first_diff(old, new)
else:
    d = metrics_diff(metrics(a), metrics(b))
if d:
    print(f"{kind} {d}")
    sys.exit(1)
EOF

passed=0
failed=0
skipped=0
report() { # name, differences (empty: same)
    if [ -z "$2" ]; then
        echo "same: $1"
        passed=$((passed + 1))
    else
        echo "DIFFERENT: $1 ($2)"
        failed=$((failed + 1))
        keep=1
    fi
}
# cmp_tree A B: the files under A and B, names and bytes; prints what differs.
cmp_tree() {
    local names_a names_b f
    names_a=$(cd "$1" && find . ! -type d | sort)
    names_b=$(cd "$2" && find . ! -type d | sort)
    if [ "$names_a" != "$names_b" ]; then
        echo "files: $(diff <(echo "$names_a") <(echo "$names_b") | grep '^[<>]' | tr '\n' ' ')"
        return
    fi
    for f in $names_a; do
        cmp -s "$1/$f" "$2/$f" || echo "${f#./}"
    done
}
join() { paste -sd';' - | sed 's/;/; /g'; }

# prepare_check NAME OUT ARGS...: `memwall prepare ARGS --out $work/OUT` (the new side; the old
# side writes OUT-old), every file compared.
prepare_check() {
    local name=$1 out=$work/$2 why= side dir
    shift 2
    for side in old new; do
        dir=$out
        [ "$side" = new ] || dir=$out-old
        "$work/memwall-$side" prepare "$@" --out "$dir" >"$work/$name.$side.log" 2>&1 ||
            why="$why${why:+; }$side exited $? (see $work/$name.$side.log)"
    done
    [ -n "$why" ] || why=$(cmp_tree "$out-old" "$out" | join)
    report "$name" "$why"
}

prepare_check prepare data "$corpus"
prepare_check prepare-tiny-llama data-tiny-llama "$corpus" --tokenizer "$models/tiny-llama"
prepare_check prepare-chat data-chat "$conversations" --tokenizer "$models/chat-llama" \
    --chat-template "$chat_template" --val-fraction 0.25

# tokenize
why=
for side in old new; do
    { "$work/memwall-$side" tokenize --tokenizer "$models/chat-llama" --chat-template "$chat_template" \
        --chat "$conversations" &&
        "$work/memwall-$side" tokenize --tokenizer "$models/chat-llama" --chat-template "$chat_template" \
            --chat "$conversations" --json; } >"$work/tokenize-chat.$side.out" 2>"$work/tokenize-chat.$side.err" ||
        why="$why${why:+; }$side exited $? ($(tail -1 "$work/tokenize-chat.$side.err"))"
done
[ -n "$why" ] || cmp -s "$work/tokenize-chat.old.out" "$work/tokenize-chat.new.out" || why="stdout"
report tokenize-chat "$why"

# plan
plan_check() { # name, extra plan args...
    local name=$1 side bin why=
    shift
    for side in old new; do
        bin=$work/memwall-$side
        "$bin" plan --model gpt2 --batch 4 --seq 256 --json "$@" >"$work/$name.$side.json" 2>"$work/$name.$side.err" ||
            why="$why${why:+; }$side exited $? ($(tail -1 "$work/$name.$side.err"))"
    done
    # compare.py exits 1 with the difference on stdout; anything else (a crash) is reported too.
    [ -n "$why" ] || why=$(python3 "$work/compare.py" plan "$work/$name.old.json" "$work/$name.new.json" 2>&1 | join) || true
    report "$name" "$why"
}
plan_check plan-fp32
plan_check plan-bf16 --precision bf16
plan_check plan-recompute-full --recompute full
for z in 0 1 2 3; do
    plan_check plan-ranks2-zero$z --ranks 2 --zero $z
done

# train
# train_check NAME ARGS...: `train --out RUN --steps 20 ${train_args[@]} ARGS` with each side's
# $work/$train_bin-SIDE, under ${launch[@]} (mpirun, or nothing); NAME resume or *-resume: 10
# steps, then `train --resume RUN --steps 20`.
train_bin=memwall
train_check() {
    local name=$1 side bin run=$work/run out why= ck base
    local -a model
    shift
    for side in old new; do
        bin=$work/$train_bin-$side
        rm -rf "$run"
        case "$name" in
        resume | *-resume)
            "${launch[@]}" "$bin" train --out "$run" --steps 10 "${train_args[@]}" "$@" >"$work/$name.$side.log" 2>&1 &&
                "${launch[@]}" "$bin" train --resume "$run" --steps 20 --threads 2 >>"$work/$name.$side.log" 2>&1 ;;
        *)
            "${launch[@]}" "$bin" train --out "$run" --steps 20 "${train_args[@]}" "$@" >"$work/$name.$side.log" 2>&1 ;;
        esac || why="$why${why:+; }$side exited $? (see $work/$name.$side.log)"
        [ -d "$run" ] && mv "$run" "$work/$name.$side"
    done
    if [ -z "$why" ]; then
        out=$work/$name
        why=$(cmp_tree "$out.old/checkpoints" "$out.new/checkpoints")
        why+=$'\n'$(python3 "$work/compare.py" metrics "$out.old/metrics.jsonl" "$out.new/metrics.jsonl" 2>&1 || true)
        why+=$'\n'$(python3 "$work/compare.py" plan "$out.old/plan.json" "$out.new/plan.json" 2>&1 || true)
        for side in old new; do
            # A LoRA checkpoint is an adapter: sampled on the base its adapter_config.json names.
            ck=$out.$side/checkpoints/step-000020
            if [ -f "$ck/adapter_config.json" ]; then
                base=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["base_model_name_or_path"])' \
                    "$ck/adapter_config.json" 2>&1) || base="?"
                model=(--model "$base" --adapter "$ck")
            else
                model=(--model "$ck")
            fi
            "$work/memwall-$side" sample "${model[@]}" --tokens 16 --threads 2 \
                >"$out.$side.sample" 2>"$out.$side.sample.err" || echo "sample exited $?" >>"$out.$side.sample"
        done
        cmp -s "$out.old.sample" "$out.new.sample" || why+=$'\nsample text'
        why=$(echo "$why" | sed '/^$/d' | join)
    fi
    report "$name" "$why"
    [ -n "$why" ] || rm -rf "$work/$name.old" "$work/$name.new"
}

# gpt2-tiny on the corpus.
train_args=(--data "$work/data" --model gpt2-tiny --batch 4 --seq 64 --threads 2 --warmup 5 --eval-every 10 --eval-batches 4 --save-every 10)
train_check fp32
train_check recompute-none --recompute none
train_check recompute-selective --recompute selective
train_check recompute-full --recompute full
train_check recompute-every2 --recompute every:2
train_check grad-accum2 --grad-accum 2
train_check bf16 --precision bf16
train_check fp16 --precision fp16
train_check optim-state-int8 --optim-state int8
train_check optim-state-bf16 --optim-state bf16
train_check resume
train_check offload-all --offload all --offload-dir "$work/offload"
train_check offload-optimizer-grads --offload optimizer,grads

# LoRA on tiny-llama (hf-tiny-llama's weights), on the corpus in its tokens.
train_args=(--data "$work/data-tiny-llama" --init "$models/tiny-llama" --batch 4 --seq 64 --threads 2 --warmup 5 --eval-every 10 --eval-batches 4 --save-every 10 --lr 3e-3)
train_check lora --lora 4
train_check lora-targets-dropout --lora 8 --lora-alpha 4 --lora-targets q,v,down --lora-dropout 0.1
train_check lora-bf16-base --lora 4 --base-quant bf16
train_check lora-offload-all --lora 4 --offload all --offload-dir "$work/offload"
train_check lora-resume --lora 4

# Chat data: chat-llama from scratch, packed and not; LoRA and QLoRA on chat-base.
train_args=(--data "$work/data-chat" --batch 2 --seq 512 --threads 2 --warmup 5 --eval-every 10 --eval-batches 4 --save-every 10 --lr 3e-3)
train_check chat-pack --model "$models/chat-llama"
train_check chat-no-pack --model "$models/chat-llama" --no-pack
"$new_bin" train --out "$work/chat-base-run" --model "$models/chat-llama" --steps 10 "${train_args[@]}" \
    >"$work/chat-base.log" 2>&1 || echo "same-results: the chat base run failed (see $work/chat-base.log)"
cp -r "$work/chat-base-run/checkpoints/step-000010" "$models/chat-base" 2>/dev/null || true
train_check chat-lora --init "$models/chat-base" --lora 4
train_check chat-qlora-q4_0 --init "$models/chat-base" --lora 4 --base-quant q4_0
train_check chat-qlora-q8_0 --init "$models/chat-base" --lora 4 --base-quant q8_0

# 2 ranks (mpirun), rank 0's run directory.
zero_checks="zero0-2ranks zero1-2ranks zero2-2ranks zero3-2ranks"
if [ "$mpi" = 1 ]; then
    train_bin=memwall-mpi
    train_args=(--data "$work/data" --model gpt2-tiny --batch 2 --seq 64 --threads 1 --warmup 5 --eval-every 10 --eval-batches 4 --save-every 10)
    for z in 0 1 2 3; do
        train_check zero$z-2ranks --zero $z
    done
    train_bin=memwall
    launch=()
else
    echo "skipped: $zero_checks (2-rank training needs both sides built with --features mpi and mpirun: run again with --mpi or SAME_MPI=1)"
    skipped=$((skipped + 4))
fi

echo "$passed passed, $failed failed$([ "$skipped" = 0 ] || echo ", $skipped skipped")"
[ "$failed" -eq 0 ]
