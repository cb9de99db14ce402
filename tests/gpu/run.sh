#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU: every CUDA op against the CPU reference
# on the real device (tests/cuda_backend.rs), the emulated-kernel tests, and the kernel
# benchmark (benches/cuda_kernels.rs), in well under five minutes; then, when the Python
# package can be had there, tests/python/test_cuda_backend.py through `specdraft.CudaBackend`.
#
#   tests/gpu/run.sh bundle   build the three programs here (release, feature `cuda`) into
#                             target/gpu-bundle/, for a GPU machine without a toolchain or
#                             network: copy that folder along with the tree. With maturin
#                             installed it also puts the wheel (kernels included) there.
#   tests/gpu/run.sh          run them: from target/gpu-bundle/ when it is there, else build
#                             with cargo first (installing nvcc with scripts/install-nvcc.sh
#                             when it is missing). The Python step uses an installed
#                             specdraft, else the bundled wheel installed offline into a
#                             scratch venv that sees the system numpy and pytest; without
#                             either it is reported as skipped and does not fail the run.
#
# With $OUT set, writes $OUT/gpu_summary.json (status of each step, test counts, the
# benchmark figures) and the logs. Exit status: 0 only if every step passed on a GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUNDLE="${SPECDRAFT_GPU_BUNDLE:-target/gpu-bundle}"
OUT_DIR="${OUT:-target/gpu-out}"
mkdir -p "$OUT_DIR"
START=$(date +%s)

build_bundle() {
    if [ -z "${NVCC:-}" ] && ! command -v nvcc >/dev/null; then
        NVCC="$(scripts/install-nvcc.sh | tail -n 1)" || { echo "cannot install nvcc" >&2; return 1; }
        export NVCC
    fi
    mkdir -p "$BUNDLE"
    local json exe
    for spec in "cuda:--test cuda_backend" "cuda-emu:--test kernels_emulated" "cuda:--bench cuda_kernels"; do
        json=$(cargo test --release --features "${spec%%:*}" ${spec#*:} --no-run --message-format=json) || return 1
        exe=$(printf '%s\n' "$json" | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
        [ -n "$exe" ] || { echo "no executable for ${spec#*:}" >&2; return 1; }
        cp "$exe" "$BUNDLE/$(basename "${spec#*:* }")"
    done
    # Optional: the Python step on the GPU machine is skipped without it.
    if command -v maturin >/dev/null; then
        rm -f "$BUNDLE"/specdraft-*.whl
        maturin build --release --out "$BUNDLE" || return 1
    else
        echo "maturin not found: no wheel in $BUNDLE, the Python step will be skipped" >&2
    fi
    ls -la "$BUNDLE"
}

if [ "${1:-}" = "bundle" ]; then
    build_bundle
    exit $?
fi

if [ ! -x "$BUNDLE/cuda_backend" ] || [ ! -x "$BUNDLE/cuda_kernels" ] || [ ! -x "$BUNDLE/kernels_emulated" ]; then
    echo "== building (no prebuilt programs in $BUNDLE)"
    build_bundle > "$OUT_DIR/build.log" 2>&1 || { cat "$OUT_DIR/build.log"; echo "build failed" >&2; }
fi

if [ -n "$(find cuda rust tests benches build.rs -newer "$BUNDLE/cuda_backend" -type f 2>/dev/null | head -n 1)" ]; then
    echo "== note: sources are newer than $BUNDLE; run 'tests/gpu/run.sh bundle' again if they changed"
fi

GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
echo "== GPU: ${GPU:-none found by nvidia-smi}"

# run NAME TIMEOUT PROGRAM ARGS...: runs one step, records status and test counts.
declare -A STATUS PASSED FAILED
run_step() {
    local name=$1 limit=$2; shift 2
    echo "== $name"
    if [ ! -x "$1" ]; then
        STATUS[$name]="missing"; PASSED[$name]=0; FAILED[$name]=0
        return
    fi
    timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT_DIR/$name.log"
    PASSED[$name]=$(sed -n 's/^test result: .* \([0-9]*\) passed.*/\1/p' "$OUT_DIR/$name.log" | head -n 1)
    FAILED[$name]=$(sed -n 's/^test result: .* \([0-9]*\) failed.*/\1/p' "$OUT_DIR/$name.log" | head -n 1)
    # pytest's summary line: "3 failed, 9 passed, 2 skipped in 1.2s".
    if [ -z "${PASSED[$name]}" ]; then
        PASSED[$name]=$(tail -n 1 "$OUT_DIR/$name.log" | sed -n 's/.*\b\([0-9]\+\) passed.*/\1/p')
        FAILED[$name]=$(tail -n 1 "$OUT_DIR/$name.log" | sed -n 's/.*\b\([0-9]\+\) failed.*/\1/p')
    fi
    if [ $rc -eq 124 ]; then STATUS[$name]="timed out"
    elif [ $rc -ne 0 ]; then STATUS[$name]="failed"
    elif grep -q "no GPU, skipped\|\"skipped\"\|no usable CUDA GPU" "$OUT_DIR/$name.log"; then STATUS[$name]="skipped (no GPU)"
    else STATUS[$name]="passed"; fi
}

run_step cuda_backend 150 "$BUNDLE/cuda_backend" --nocapture
run_step kernels_emulated 120 "$BUNDLE/kernels_emulated"
SPECDRAFT_BENCH_JSON="$OUT_DIR/gpu_bench.json" run_step cuda_kernels 90 "$BUNDLE/cuda_kernels"

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
    run_step python_cuda 120 "$PY" -m pytest -q -rs -p no:cacheprovider tests/python/test_cuda_backend.py
else
    echo "== python_cuda: skipped (no specdraft with CudaBackend, pytest and numpy for $PY)"
    STATUS[python_cuda]="skipped (python package not installed)"; PASSED[python_cuda]=0; FAILED[python_cuda]=0
fi

BENCH="null"
[ -s "$OUT_DIR/gpu_bench.json" ] && BENCH=$(cat "$OUT_DIR/gpu_bench.json")
{
    printf '{\n  "gpu": "%s",\n  "seconds": %d,\n  "steps": {\n' "${GPU:-none}" $(( $(date +%s) - START ))
    sep=""
    for name in cuda_backend kernels_emulated cuda_kernels python_cuda; do
        printf '%s    "%s": {"status": "%s", "tests_passed": %s, "tests_failed": %s}' "$sep" "$name" \
            "${STATUS[$name]}" "${PASSED[$name]:-0}" "${FAILED[$name]:-0}"
        sep=$',\n'
    done
    printf '\n  },\n  "bench": %s\n}\n' "$BENCH"
} > "$OUT_DIR/gpu_summary.json"
cat "$OUT_DIR/gpu_summary.json"

for name in cuda_backend kernels_emulated cuda_kernels; do
    [ "${STATUS[$name]}" = "passed" ] || exit 1
done
# Optional step: only a run that happened has to pass.
case "${STATUS[python_cuda]}" in passed | "skipped (python package not installed)") ;; *) exit 1 ;; esac
exit 0
