#!/usr/bin/env bash
# Installs everything the tests need and runs every test: lints, the API docs' links, Rust unit
# and integration tests, the CUDA build and its kernels under CPU emulation, the real SmolLM2
# checks, the unsafe kernels under valgrind and Miri (a pinned nightly toolchain, installed
# through rustup), the examples, and the Python suite against the installed package. Exits
# non-zero on the first failure. This is what CI runs.
#
# Environment: PYTHON (default python3) is the interpreter to install into.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
export PYO3_PYTHON="$PY" PYTHON="$PY"
step() { printf '\n==> %s\n' "$*" >&2; }

step "toolchain"
cargo --version
"$PY" --version
command -v cargo-clippy >/dev/null 2>&1 || rustup component add clippy rustfmt >/dev/null 2>&1 || true

step "CUDA compiler from Python wheels (no GPU needed)"
NVCC="$(bash scripts/install-nvcc.sh | tail -n 1)"
export NVCC
echo "nvcc: $NVCC"

step "Python package with its test, training and MPI dependencies"
"$PY" -m pip install --quiet --disable-pip-version-check '.[test,train,distributed]'

step "format and lints"
cargo fmt --check
cargo clippy --all-targets --all-features -- -D warnings
"$PY" -m ruff check python tests examples benches scripts
"$PY" -m ruff format --check python tests examples benches scripts

step "API docs: every intra-doc link resolves, with every feature and with none"
RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps --document-private-items --all-features
RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps

step "type stub: signatures and docstrings against the built module"
# Run outside the source tree so the installed package (with its compiled _core) is imported.
allowlist="$PWD/scripts/stubtest_allowlist.txt"
(cd /tmp && "$PY" -m mypy.stubtest specdraft._core --allowlist "$allowlist")
"$PY" scripts/stub_docs.py --check

step "Rust tests (CPU backend)"
cargo test

step "CUDA backend: builds and fails cleanly without a GPU; kernels checked under CPU emulation"
# The GPU tests in these files are ignored here (they need a device; tests/gpu/run.sh runs them).
cargo test --features cuda --test cuda_backend --test model_cuda --test engine_cuda --test nccl_comm
cargo test --features cuda-emu --test kernels_emulated --test model_emulated --test mtp_emulated
cargo test --features cuda-emu --lib backend::cuda

step "GPU check bundle builds (the test profile compiled above; run on a GPU by tests/gpu/run.sh)"
bash tests/gpu/run.sh bundle --dev
for t in cuda_backend model_cuda engine_cuda nccl_comm; do
    n=$(target/gpu-bundle-dev/$t --ignored --list | grep -c ': test$')
    [ "$n" -gt 0 ] || { echo "$t: no GPU tests in the bundle" >&2; exit 1; }
done

step "SmolLM2 (the real default model) against an independent numpy reference"
SPECDRAFT_SMOLLM2_GGUF="$("$PY" -c 'from specdraft.models import fetch_default_model; print(fetch_default_model())')"
export SPECDRAFT_SMOLLM2_GGUF
cargo test --release --test model_smollm2 -- --ignored

step "examples"
cargo run --quiet --example 01_rust_proposer
cargo run --quiet --example 02_spec_engine
cargo run --quiet --example 05_wrapping_proposer
"$PY" examples/03_python_proposer.py
# mpiexec comes with the distributed extra's MPICH wheel, beside the interpreter.
MPIEXEC="$("$PY" -c 'import pathlib, shutil, sys; p = pathlib.Path(sys.executable).parent / "mpiexec"; print(p if p.exists() else shutil.which("mpiexec") or "mpiexec")')"
"$MPIEXEC" -n 2 "$PY" examples/04_two_ranks.py

step "unsafe code under checkers: valgrind on the portable and AVX2 kernels, Miri on the pool and the AVX-512 attention"
bash scripts/unsafe-check.sh smoke

step "fuzz smoke: every loader fuzz target, a few hundred inputs each from a fixed seed"
PYTHON="$PY" bash scripts/fuzz.sh smoke

step "Python tests"
# The two-rank tests run under the extra's mpiexec: here they fail rather than skip without it.
export SPECDRAFT_REQUIRE_MPI=1
"$PY" -m pytest -q -rs tests/python
