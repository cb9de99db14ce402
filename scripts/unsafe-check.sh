#!/usr/bin/env bash
# Runs the CPU kernels' unsafe code under checkers and says what each run covered.
#
#   scripts/unsafe-check.sh [smoke|full]     smoke (the default) is CI's: a few minutes
#
# - valgrind (memcheck) on the debug test binaries: the kernels' unit tests (`backend::`), the
#   aliasing rules' (tests/kernel_aliasing.rs), the CPU attention's odd shapes
#   (tests/cpu_attention.rs); full: every CPU attention test and tests/quant_linear.rs too.
#   Valgrind's virtual CPU has AVX2, FMA and F16C but neither AVX-512 nor VNNI, so under it
#   the kernels run their portable and AVX2 builds (the first line of its report names them).
# - Miri (nightly), which stops at undefined behaviour that a run does not show: pointer
#   arithmetic out of bounds, data races, use after free, leaks. Portable builds: the kernel
#   pool (the job whose closure's lifetime it erases, its workers, its panics) and the raw
#   pointer writes of the activation quantizer and the float linear. With AVX-512 given as
#   target features, Miri also emulates the attention's 512-bit scores and weighted values;
#   not the softmax (`vmaxps`) nor the quantized kernels, whose inline assembly it cannot run.
# - full only: AddressSanitizer (nightly) on this CPU's own level (AVX-512 where it has it),
#   the kernels' unit tests and the attention and quantized linear tests (a ten-minute build).
#
# The nightly toolchain is pinned (NIGHTLY below, so that a new nightly never changes what CI
# checks) and installed through rustup with its miri and rust-src components when missing;
# where that fails the script fails, saying so: a checker that did not run is not a pass.
# Exits non-zero if any checker found an error.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-smoke}"
case "$MODE" in
smoke | full) ;;
*)
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
TARGET="${CARGO_TARGET_DIR:-target}"
HOST="$(rustc -vV | sed -n 's/^host: //p')"
AVX512_FEATURES="-Ctarget-feature=+avx2,+fma,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512vnni"
NIGHTLY=nightly-2026-10-29
failed=()
step() { printf '\n==> %s\n' "$*" >&2; }

# The debug test binaries of these cargo targets, "NAME PATH" a line.
test_binaries() {
    cargo test --quiet --no-run --message-format=json "$@" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])'
}

# valgrind LABEL BINARY [TEST ARGS...]: runs a test binary under memcheck.
valgrind_run() {
    local label=$1 bin=$2 log start=$SECONDS
    shift 2
    log="$(mktemp)"
    if valgrind --tool=memcheck --error-exitcode=99 -q "$bin" --test-threads=2 "$@" >"$log" 2>&1; then
        echo "valgrind, $label: no errors ($(grep -m1 -o '[0-9]* passed' "$log")), $((SECONDS - start)) s"
    else
        cat "$log" >&2
        echo "valgrind, $label: FAILED (its report is above)"
        failed+=("valgrind $label")
    fi
    rm -f "$log"
}

# miri LABEL TARGET_DIR RUSTFLAGS TEST_FILTERS...: the library's tests named by the filters.
miri_run() {
    local label=$1 dir=$2 flags=$3 log start=$SECONDS
    shift 3
    log="$(mktemp)"
    if RUSTFLAGS="$flags" cargo +"$NIGHTLY" miri test --quiet --target-dir "$dir" --lib -- "$@" \
        >"$log" 2>&1; then
        echo "Miri, $label: no undefined behaviour ($(grep -m1 -o '[0-9]* passed' "$log")), $((SECONDS - start)) s"
    else
        cat "$log" >&2
        echo "Miri, $label: FAILED (its report is above)"
        failed+=("Miri $label")
    fi
    rm -f "$log"
}

step "valgrind: the kernels' portable and AVX2 builds"
command -v valgrind >/dev/null || {
    echo "valgrind is not installed (apt-get install valgrind)" >&2
    exit 1
}
declare -A bin
while read -r name path; do bin[$name]=$path; done < <(test_binaries --lib \
    --test cpu_attention --test kernel_aliasing --test quant_linear)
valgrind --tool=memcheck -q "${bin[specdraft]}" --exact --nocapture \
    backend::quant::supported::tests::proofs_exist_exactly_where_the_cpu_has_their_features \
    2>&1 | grep -m1 'instruction sets this CPU runs' | sed 's/^/under valgrind, /' || true
# The pool's two tests of many thousand calls take minutes under valgrind's one-at-a-time
# threads; Miri and the plain run cover them.
valgrind_run "kernel unit tests" "${bin[specdraft]}" backend:: \
    --skip every_task_runs_exactly_once --skip workers_that_wake_late
valgrind_run "aliasing rules" "${bin[kernel_aliasing]}"
if [[ $MODE == full ]]; then
    valgrind_run "CPU attention" "${bin[cpu_attention]}"
    valgrind_run "quantized linear" "${bin[quant_linear]}"
else
    valgrind_run "CPU attention, odd shapes" "${bin[cpu_attention]}" odd_shape
fi

step "Miri (nightly)"
if ! rustup toolchain install "$NIGHTLY" --profile minimal --component miri \
    --component rust-src >/dev/null 2>&1; then
    echo "Miri could not be installed (rustup toolchain install $NIGHTLY with miri and" \
        "rust-src failed): the Miri checks did not run" >&2
    failed+=("Miri (not installed)")
else
    cargo +"$NIGHTLY" miri setup --quiet >/dev/null 2>&1 || true
    miri_run "kernel pool and portable kernels" "$TARGET/unsafe-check/miri" "" \
        backend::quant::pool::tests::a_panic backend::quant::pool::tests::an_unwinding \
        backend::quant::pool::tests::run_returns backend::quant::activation::tests::codes_round \
        backend::quant::activation::tests::k_sums backend::quant::activation::tests::non_finite \
        backend::cpu::linear::tests::linear_is_exact backend::quant::supported
    miri_run "the attention's AVX-512 scores and weighted values" \
        "$TARGET/unsafe-check/miri-avx512" "$AVX512_FEATURES" \
        backend::cpu::attention::zmm::tests::scores backend::cpu::attention::zmm::tests::weighted \
        backend::cpu::attention::zmm::tests::a_short
fi

# asan LABEL CARGO_TEST_ARGS...: tests built with AddressSanitizer, run on this CPU.
asan_run() {
    local label=$1 log start=$SECONDS
    shift
    log="$(mktemp)"
    # --target keeps the sanitizer off build scripts; the standard library is not rebuilt
    # with it (hence the mismatch allowed), so this crate's own accesses are what it checks.
    if RUSTFLAGS="-Zsanitizer=address -Cunsafe-allow-abi-mismatch=sanitizer" \
        ASAN_OPTIONS=detect_leaks=0 cargo +"$NIGHTLY" test --quiet --target "$HOST" \
        --target-dir "$TARGET/unsafe-check/asan" "$@" >"$log" 2>&1; then
        echo "AddressSanitizer, $label: no errors ($(grep -o '[0-9]* passed' "$log" |
            awk '{n += $1} END {print n}') passed), $((SECONDS - start)) s"
    else
        cat "$log" >&2
        echo "AddressSanitizer, $label: FAILED (its report is above)"
        failed+=("AddressSanitizer $label")
    fi
    rm -f "$log"
}

if [[ $MODE == full ]]; then
    step "AddressSanitizer (nightly): this CPU's own instruction sets, AVX-512 included"
    asan_run "kernel unit tests" --lib -- backend:: --skip every_task_runs_exactly_once
    asan_run "CPU attention and quantized linear" --test cpu_attention --test quant_linear
fi

if ((${#failed[@]})); then
    printf '\nunsafe-check: failed: %s\n' "$(IFS=,; echo "${failed[*]}")"
    exit 1
fi
printf '\nunsafe-check %s: every checker ran and found nothing\n' "$MODE"
