#!/usr/bin/env bash
# Installs everything the tests need and runs every test: Rust (unit, integration, examples,
# emulated CUDA kernels), the CUDA build, lints, and the Python suite against the installed
# wheel. Exits non-zero on the first failure. This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
export PYO3_PYTHON="$PY"
step() { printf '\n==> %s\n' "$*" >&2; }

step "toolchain"
cargo --version
"$PY" --version

step "CUDA compiler (from Python wheels; no GPU needed)"
NVCC="$(bash scripts/install-nvcc.sh)"
export NVCC
echo "nvcc: $NVCC"

step "format and lints"
cargo fmt --check
if cargo clippy --version >/dev/null 2>&1; then
    cargo clippy --all-targets --features cuda -- -D warnings
fi

step "Rust tests (CPU backend)"
cargo test --all-targets

step "CUDA backend builds without a GPU; kernels checked under CPU emulation"
cargo build --features cuda
cargo test --features cuda-emu --test kernels_emulated

step "Rust examples"
cargo run --quiet --example 01_rust_proposer

step "Python package and tests"
"$PY" -m pip install --quiet --disable-pip-version-check '.[test]'
"$PY" -m ruff check python tests examples
"$PY" -m pytest -q tests/python
