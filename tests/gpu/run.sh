#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU and no network, in under eight minutes:
#   cuda_backend   every CUDA op against the CPU reference, copies and the ledger
#   model_cuda     the target model's logits against the CPU's (SmolLM2 too when
#                  $SPECDRAFT_SMOLLM2_GGUF names its file; otherwise that test is not run)
#   engine_cuda    greedy speculative == plain on CUDA with PromptLookup (target model) and
#                  with MtpHead (dense and MoE), MtpHead's logits and drafts against the
#                  CPU's, and the ledger at zero after each
#   nccl_comm      the NCCL communicator: every collective against numpy's sums through a
#                  communicator of one rank and through two ranks (two processes; on one
#                  GPU both on it, each rank its own host to NCCL, which otherwise refuses
#                  two ranks on one GPU), and a rank that never joins timing out; libnccl
#                  from $SPECDRAFT_NCCL_LIB (the file or its folder), the system, or the
#                  nvidia-nccl-cu12 wheel of python3 there
#   cuda_kernels   the kernel benchmark
#   model_decode   decode speed of a random model with SmolLM2's shape, on the CPU (the
#                  baseline, same command) and on the GPU
#   python_cuda    tests/python/test_cuda_backend.py through `specdraft.CudaBackend`, when
#                  the Python package can be had there (optional)
# The GPU tests are ignored in a plain `cargo test`; here they run with --ignored, where a
# missing device is a failure, and a step in which no test ran counts as failed.
#
#   tests/gpu/run.sh bundle [--dev]
#        builds the programs (release; with --dev the test profile CI already compiles,
#        to check that the bundle builds) into target/gpu-bundle/ (target/gpu-bundle-dev/),
#        for a GPU machine without a toolchain or network: copy that folder along with the
#        tree. In release, with maturin installed, it also puts the wheel there.
#   tests/gpu/run.sh
#        runs them: from target/gpu-bundle/ when it is there, else it builds first.
#
# Writes $OUT/gpu_summary.json (each step's status and test counts, the benchmark figures)
# and the logs ($OUT defaults to target/gpu-out). Exit status 0 only if every step passed
# on a GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
PROGRAMS="cuda_backend model_cuda engine_cuda nccl_comm cuda_kernels model_decode"
OUT_DIR="${OUT:-target/gpu-out}"
BUDGET_S=470

build_bundle() {
    local profile=(--release) bundle="${SPECDRAFT_GPU_BUNDLE:-target/gpu-bundle}"
    if [ "${1:-}" = "--dev" ]; then
        profile=()
        bundle="${SPECDRAFT_GPU_BUNDLE:-target/gpu-bundle-dev}"
    fi
    if [ -z "${NVCC:-}" ] && ! command -v nvcc >/dev/null; then
        NVCC="$(scripts/install-nvcc.sh | tail -n 1)" || { echo "cannot install nvcc" >&2; return 1; }
        export NVCC
    fi
    mkdir -p "$bundle"
    local json
    json=$(cargo test "${profile[@]}" --features cuda --test cuda_backend --test model_cuda \
        --test engine_cuda --test nccl_comm --bench cuda_kernels --bench model_decode --no-run \
        --message-format=json) || return 1
    # One executable per target: copy each under its target's name.
    printf '%s\n' "$json" | python3 -c '
import json, shutil, sys
want, dest = sys.argv[1].split(), sys.argv[2]
found = {}
for line in sys.stdin:
    m = json.loads(line) if line.startswith("{") else {}
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        found[m["target"]["name"]] = m["executable"]
missing = [n for n in want if n not in found]
if missing:
    sys.exit("no executable for " + ", ".join(missing))
for n in want:
    shutil.copy2(found[n], f"{dest}/{n}")
' "$PROGRAMS" "$bundle" || return 1
    # Symbols make the programs several times larger; the copy to the GPU machine is small.
    if [ ${#profile[@]} -gt 0 ] && command -v strip >/dev/null; then
        for p in $PROGRAMS; do strip "$bundle/$p"; done
    fi
    if [ ${#profile[@]} -gt 0 ] && command -v maturin >/dev/null; then
        rm -f "$bundle"/specdraft-*.whl
        maturin build --release --out "$bundle" || return 1
    elif [ ${#profile[@]} -gt 0 ]; then
        echo "maturin not found: no wheel in $bundle, the Python step will be skipped" >&2
    fi
    ls -la "$bundle"
}

if [ "${1:-}" = "bundle" ]; then
    build_bundle "${2:-}"
    exit $?
fi

BUNDLE="${SPECDRAFT_GPU_BUNDLE:-target/gpu-bundle}"
mkdir -p "$OUT_DIR"
START=$(date +%s)
for p in $PROGRAMS; do
    if [ ! -x "$BUNDLE/$p" ]; then
        echo "== building (no prebuilt $p in $BUNDLE)"
        build_bundle > "$OUT_DIR/build.log" 2>&1 || { tail -n 30 "$OUT_DIR/build.log"; echo "build failed" >&2; }
        break
    fi
done
if [ -n "$(find cuda rust tests benches build.rs -newer "$BUNDLE/cuda_backend" -type f 2>/dev/null | head -n 1)" ]; then
    echo "== note: sources are newer than $BUNDLE; run 'tests/gpu/run.sh bundle' again if they changed"
fi

GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
echo "== GPU: ${GPU:-none found by nvidia-smi}"

declare -A STATUS PASSED FAILED IGNORED
STEPS=""
# run_step NAME LIMIT_S PROGRAM ARGS...: runs one step within what is left of the budget
# and records its status and test counts (cargo's or pytest's summary line).
run_step() {
    local name=$1 limit=$2; shift 2
    STEPS="$STEPS $name"
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s)"
    PASSED[$name]=0; FAILED[$name]=0; IGNORED[$name]=0
    if [ ! -x "$1" ] && ! command -v "$1" >/dev/null; then STATUS[$name]="missing"; return; fi
    if [ "$limit" -le 5 ]; then STATUS[$name]="not run (out of time)"; return; fi
    timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT_DIR/$name.log"
    local line
    line=$(grep -E '^test result: ' "$OUT_DIR/$name.log" | tail -n 1)
    [ -z "$line" ] && line=$(grep -E '[0-9]+ (passed|failed)' "$OUT_DIR/$name.log" | tail -n 1)
    PASSED[$name]=$(printf '%s' "$line" | grep -oE '[0-9]+ passed' | grep -oE '[0-9]+' || echo 0)
    # pytest counts errors (a failed fixture) apart from failures: both are failures here.
    local n failed=0
    for n in $(printf '%s' "$line" | grep -oE '[0-9]+ (failed|errors?)' | grep -oE '^[0-9]+'); do
        failed=$((failed + n))
    done
    FAILED[$name]=$failed
    IGNORED[$name]=$(printf '%s' "$line" | grep -oE '[0-9]+ (ignored|skipped)' | grep -oE '[0-9]+' || echo 0)
    if [ $rc -eq 124 ]; then STATUS[$name]="timed out"
    elif [ $rc -ne 0 ]; then STATUS[$name]="failed"
    # A benchmark that finds no GPU says so in its JSON and exits 0.
    elif grep -q '"skipped"' "$OUT_DIR/$name.log" "${SPECDRAFT_BENCH_JSON:-/dev/null}" 2>/dev/null; then
        STATUS[$name]="failed (skipped: no GPU)"
    elif [ -n "$line" ] && [ "${PASSED[$name]:-0}" -eq 0 ]; then STATUS[$name]="failed (no test ran)"
    else STATUS[$name]="passed"; fi
}

run_step cuda_backend 90 "$BUNDLE/cuda_backend" --include-ignored
if [ -n "${SPECDRAFT_SMOLLM2_GGUF:-}" ]; then
    run_step model_cuda 90 "$BUNDLE/model_cuda" --ignored
else
    echo "== model_cuda: SPECDRAFT_SMOLLM2_GGUF not set, the SmolLM2 test is not run"
    run_step model_cuda 90 "$BUNDLE/model_cuda" --ignored --skip smollm2
fi
run_step engine_cuda 150 "$BUNDLE/engine_cuda" --ignored --test-threads 1

# NCCL: cudarc loads it as libnccl.so, the wheel names it libnccl.so.2: a link bridges them.
nccl_lib() {
    local f=""
    if [ -n "${SPECDRAFT_NCCL_LIB:-}" ]; then
        f="$SPECDRAFT_NCCL_LIB"; [ -d "$f" ] && f="$f/libnccl.so.2"
    elif ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
        echo system; return
    else
        f=$(python3 -c 'import importlib.util as u, pathlib as p
s = u.find_spec("nvidia.nccl")
print(next((str(q) for r in (s.submodule_search_locations if s else []) for q in [p.Path(r) / "lib" / "libnccl.so.2"] if q.is_file()), ""))' 2>/dev/null)
    fi
    [ -n "$f" ] && [ -f "$f" ] && echo "$f"
}
NCCL_LIB=$(nccl_lib)
if [ -z "$NCCL_LIB" ]; then
    echo "== nccl_comm: no libnccl (pip install nvidia-nccl-cu12 there, or set SPECDRAFT_NCCL_LIB)"
    STEPS="$STEPS nccl_comm"
    STATUS[nccl_comm]="skipped (no libnccl)"; PASSED[nccl_comm]=0; FAILED[nccl_comm]=0; IGNORED[nccl_comm]=0
else
    NCCL_ENV=()
    if [ "$NCCL_LIB" != system ]; then
        mkdir -p "$OUT_DIR/nccl-lib" && ln -sf "$(readlink -f "$NCCL_LIB")" "$OUT_DIR/nccl-lib/libnccl.so"
        NCCL_ENV=(env "LD_LIBRARY_PATH=$OUT_DIR/nccl-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    fi
    # The child test is each rank of the two-rank test, which starts it.
    run_step nccl_comm 90 "${NCCL_ENV[@]}" "$BUNDLE/nccl_comm" --include-ignored --test-threads 1 \
        --skip gpu_two_ranks_child
fi
SPECDRAFT_BENCH_JSON="$OUT_DIR/cuda_kernels.json" run_step cuda_kernels 60 "$BUNDLE/cuda_kernels"

# Decode: a random model of SmolLM2's shape (no network here), CPU baseline then GPU.
MODEL_DIR="$OUT_DIR/decode-model"
if python3 tests/gpu/write_decode_model.py "$MODEL_DIR" > "$OUT_DIR/decode_model_write.log" 2>&1; then
    run_step decode_cpu 90 "$BUNDLE/model_decode" --bench "$MODEL_DIR"
    run_step decode_cuda 60 "$BUNDLE/model_decode" --bench "$MODEL_DIR" --cuda
else
    cat "$OUT_DIR/decode_model_write.log"
    STEPS="$STEPS decode_cpu decode_cuda"
    for s in decode_cpu decode_cuda; do STATUS[$s]="failed (no model)"; PASSED[$s]=0; FAILED[$s]=0; IGNORED[$s]=0; done
fi
rm -rf "$MODEL_DIR"

# The Python package: an installed specdraft that has CudaBackend, else the bundled wheel.
PY="${PYTHON:-python3}"
if ! "$PY" -c "import specdraft, pytest; specdraft.CudaBackend" >/dev/null 2>&1; then
    WHEEL=$(ls "$BUNDLE"/specdraft-*.whl 2>/dev/null | head -n 1)
    if [ -n "$WHEEL" ] && "$PY" -c "import numpy, pytest" >/dev/null 2>&1 \
        && "$PY" -m venv --system-site-packages "$OUT_DIR/pyenv" \
        && "$OUT_DIR/pyenv/bin/pip" install --quiet --no-index --no-deps "$WHEEL" >&2; then
        PY="$OUT_DIR/pyenv/bin/python"
    fi
fi
if "$PY" -c "import specdraft, pytest; specdraft.CudaBackend" >/dev/null 2>&1; then
    # A GPU test skipped for want of a GPU is a failure here.
    SPECDRAFT_REQUIRE_GPU=1 run_step python_cuda 60 "$PY" -m pytest -q -rs -p no:cacheprovider \
        tests/python/test_cuda_backend.py
else
    echo "== python_cuda: skipped (no specdraft with CudaBackend, pytest and numpy for $PY)"
    STEPS="$STEPS python_cuda"
    STATUS[python_cuda]="skipped (python package not installed)"; PASSED[python_cuda]=0; FAILED[python_cuda]=0; IGNORED[python_cuda]=0
fi

# The last JSON line a program printed, or null.
json_of() { local j; j=$(grep -E '^\{' "$1" 2>/dev/null | tail -n 1); printf '%s' "${j:-null}"; }
KERNELS="null"
[ -s "$OUT_DIR/cuda_kernels.json" ] && KERNELS=$(cat "$OUT_DIR/cuda_kernels.json")
DECODE_CPU=$(json_of "$OUT_DIR/decode_cpu.log")
DECODE_CUDA=$(json_of "$OUT_DIR/decode_cuda.log")
# The GPU's decode speed as a multiple of the CPU's, both measured above on the same model.
SPEEDUP=$(python3 -c 'import json, sys
a, b = (json.loads(x) for x in sys.argv[1:])
print(round(b["decode_tokens_per_s"] / a["decode_tokens_per_s"], 2))' "$DECODE_CPU" "$DECODE_CUDA" 2>/dev/null || echo null)
{
    printf '{\n  "gpu": "%s",\n  "seconds": %d,\n  "steps": {\n' "${GPU:-none}" $(( $(date +%s) - START ))
    sep=""
    for name in $STEPS; do
        printf '%s    "%s": {"status": "%s", "tests_passed": %s, "tests_failed": %s, "tests_ignored": %s}' \
            "$sep" "$name" "${STATUS[$name]}" "${PASSED[$name]:-0}" "${FAILED[$name]:-0}" "${IGNORED[$name]:-0}"
        sep=$',\n'
    done
    printf '\n  },\n  "bench": {\n    "cuda_kernels": %s,\n    "decode_cpu": %s,\n    "decode_cuda": %s,\n    "decode_speedup_cuda_over_cpu": %s\n  }\n}\n' \
        "$KERNELS" "$DECODE_CPU" "$DECODE_CUDA" "$SPEEDUP"
} > "$OUT_DIR/gpu_summary.json"
cat "$OUT_DIR/gpu_summary.json"

for name in $STEPS; do
    case "$name:${STATUS[$name]}" in
        *:passed | "python_cuda:skipped (python package not installed)" | "nccl_comm:skipped (no libnccl)") ;;
        *) exit 1 ;;
    esac
done
exit 0
