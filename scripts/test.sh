#!/usr/bin/env bash
# Installs everything the tests need and runs every test: lints, Rust unit and integration
# tests, the CUDA build and its kernels under CPU emulation, the real SmolLM2 checks, the
# examples, and the Python suite against the installed package. Exits non-zero on the
# first failure. This is what CI runs.
#
# Environment: PYTHON (default python3) is the interpreter to install into.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
export PYO3_PYTHON="$PY"
step() { printf '\n==> %s\n' "$*" >&2; }

step "toolchain"
cargo --version
"$PY" --version
command -v cargo-clippy >/dev/null 2>&1 || rustup component add clippy rustfmt >/dev/null 2>&1 || true

step "CUDA compiler from Python wheels (no GPU needed)"
NVCC="$(bash scripts/install-nvcc.sh | tail -n 1)"
export NVCC
echo "nvcc: $NVCC"

step "Python package with its test dependencies"
"$PY" -m pip install --quiet --disable-pip-version-check '.[test]'

step "format and lints"
cargo fmt --check
cargo clippy --all-targets --all-features -- -D warnings
"$PY" -m ruff check python tests examples benches
"$PY" -m ruff format --check python tests examples benches

step "Rust tests (CPU backend)"
cargo test

step "CUDA backend: builds and fails cleanly without a GPU; kernels checked under CPU emulation"
cargo test --features cuda --test cuda_backend --test model_cuda
cargo test --features cuda-emu --test kernels_emulated --test model_emulated
cargo test --features cuda-emu --lib backend::cuda

step "SmolLM2 (the real default model) against an independent numpy reference"
SPECDRAFT_SMOLLM2_GGUF="$("$PY" -c 'from specdraft.models import fetch_default_model; print(fetch_default_model())')"
export SPECDRAFT_SMOLLM2_GGUF
cargo test --release --test model_smollm2 -- --ignored

step "examples"
cargo run --quiet --example 01_rust_proposer
cargo run --quiet --example 02_spec_engine
"$PY" examples/03_python_proposer.py

step "fuzz smoke: every loader fuzz target, a few hundred inputs each from a fixed seed"
PYTHON="$PY" bash scripts/fuzz.sh smoke

step "Python tests"
"$PY" -m pytest -q tests/python
