#!/usr/bin/env bash
# Fuzzes the loaders of untrusted model files and reports, per target: executions, failing
# inputs (crashes, hangs, allocations past the cap) and the slowest input.
#
#   scripts/fuzz.sh TARGET SECONDS [SEED]   run one target (or "all") for SECONDS each
#   scripts/fuzz.sh smoke                   every target, a few hundred inputs, seed 1 (CI)
#
# Targets: gguf, safetensors, config_json, checkpoint (Rust, libFuzzer on stable Rust: the
# fuzz/ crate built with sanitizer-coverage flags) and tokenizer_gguf (Python, atheris when
# installed, else fuzz/tokenizer_gguf.py's structured mutator). Each starts from seeds made
# from the tests' tiny checkpoints and the default model's header (fuzz/out/seeds/), with a
# fresh corpus, so a run is repeatable from its seed. The smoke needs no libFuzzer build:
# the Rust targets run under the seeded structured mutator of tests/fuzz_regressions.rs.
# Failing inputs land in fuzz/out/artifacts/TARGET/; minimize each, add it under
# tests/fuzz_inputs/TARGET/ and its expected outcome to the test that replays it
# (tests/fuzz_regressions.rs, or tests/python/test_tokenizer_files.py for tokenizer_gguf).
# Environment: FUZZ_RUNS=N also stops each target after N inputs; PYTHON (default python3).
# Exits non-zero if any target found a failing input.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
RUST_TARGETS=(gguf safetensors config_json checkpoint)
ALL_TARGETS=("${RUST_TARGETS[@]}" tokenizer_gguf)
OUT="$PWD/fuzz/out"
SMOKE_PY_RUNS=500

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

seeds() {
    if [[ -f "$OUT/seeds/.done" ]]; then return; fi
    rm -rf "$OUT/seeds" && mkdir -p "$OUT/seeds"
    echo "fuzz: writing seeds into $OUT/seeds" >&2
    SPECDRAFT_FUZZ_SEEDS="$OUT/seeds" cargo test --quiet --test fuzz_regressions seeds >&2
    "$PY" fuzz/python_seeds.py "$OUT/seeds" >&2
    touch "$OUT/seeds/.done"
}

build() {
    local host
    host="$(rustc -vV | sed -n 's/^host: //p')"
    # cargo-fuzz's instrumentation, on stable: the flags need no nightly feature. --target
    # keeps them off build scripts and proc macros.
    RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks" \
        cargo build --quiet --release --manifest-path fuzz/Cargo.toml --target "$host" \
        --bins >&2
    BIN="$PWD/fuzz/target/$host/release"
}

# run TARGET SECONDS SEED RUNS: fuzzes one target and prints its summary line.
run() {
    local target=$1 seconds=$2 seed=$3 runs=$4
    local corpus="$OUT/corpus/$target" artifacts="$OUT/artifacts/$target" log="$OUT/$target.log"
    rm -rf "$corpus" && mkdir -p "$corpus" "$artifacts" "$OUT/slowest"
    rm -f "$OUT/slowest/$target".*
    # Failing inputs of earlier runs stay; only this run's are counted.
    local started="$OUT/$target.started"
    touch "$started"
    local limits=()
    [[ "$seconds" -gt 0 ]] && limits+=("-max_total_time=$seconds")
    [[ "$runs" -gt 0 ]] && limits+=("-runs=$runs")
    local status=0
    if [[ "$target" == tokenizer_gguf ]]; then
        local py_limits=(--seed "$seed")
        [[ "$seconds" -gt 0 ]] && py_limits+=(--seconds "$seconds")
        [[ "$runs" -gt 0 ]] && py_limits+=(--runs "$runs")
        [[ -n "${FUZZ_BUILTIN:-}" ]] && py_limits+=(--builtin)
        SPECDRAFT_FUZZ_SLOWEST="$OUT/slowest" "$PY" fuzz/tokenizer_gguf.py \
            "$OUT/seeds/$target" "$artifacts" "${py_limits[@]}" >"$log" 2>&1 || status=$?
    else
        # -timeout is wall time: a hang detector, generous because a shared machine can
        # stall a process for seconds (inputs take milliseconds of CPU).
        SPECDRAFT_FUZZ_SLOWEST="$OUT/slowest" "$BIN/$target" -seed="$seed" -timeout=10 \
            -rss_limit_mb=4096 -max_len=262144 -print_final_stats=1 \
            -artifact_prefix="$artifacts/" "${limits[@]}" "$corpus" "$OUT/seeds/$target" \
            >"$log" 2>&1 || status=$?
    fi
    local execs crashes slowest
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
    crashes="$(find "$artifacts" -type f -newer "$started" \( -name 'crash-*' -o -name 'timeout-*' \
        -o -name 'oom-*' -o -name 'leak-*' \) | wc -l)"
    slowest="$(cat "$OUT/slowest/$target.txt" 2>/dev/null || echo "none")"
    printf '%-15s executions=%s failing_inputs=%s slowest=%s (%s)\n' "$target" \
        "${execs:-?}" "$crashes" "${slowest%$'\n'}" "$OUT/slowest/$target.bin"
    if [[ "$crashes" -gt 0 || "$status" -ne 0 ]]; then
        echo "  $target: exit $status; see $log and $artifacts" >&2
        return 1
    fi
}

smoke() {
    seeds
    local failed=0
    cargo test --quiet --test fuzz_regressions -- --nocapture >"$OUT/smoke.log" 2>&1 || failed=1
    sed -n 's/.*fuzz smoke: //p' "$OUT/smoke.log" | while read -r target rest; do
        printf '%-15s %s\n' "$target" "$rest"
    done
    [[ $failed -eq 0 ]] || echo "  the Rust smoke failed; see $OUT/smoke.log" >&2
    FUZZ_BUILTIN=1 run tokenizer_gguf 0 1 "$SMOKE_PY_RUNS" || failed=1
    return $failed
}

main() {
    [[ $# -ge 1 ]] || usage
    if [[ "$1" == smoke ]]; then
        smoke
        return
    fi
    [[ $# -ge 2 ]] || usage
    local targets seconds=$2 seed=${3:-1} runs=${FUZZ_RUNS:-0}
    if [[ "$1" == all ]]; then targets=("${ALL_TARGETS[@]}"); else targets=("$1"); fi
    for t in "${targets[@]}"; do
        [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || { echo "unknown target $t" >&2; usage; }
    done
    seeds
    build
    local failed=0
    for t in "${targets[@]}"; do
        run "$t" "$seconds" "$seed" "$runs" || failed=1
    done
    return $failed
}

main "$@"
