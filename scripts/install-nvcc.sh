#!/usr/bin/env bash
# Installs the CUDA compiler from Python wheels (no GPU and no system toolkit needed) and
# prints the path of nvcc. Safe to run again: it installs only what is missing.
#
# Why two wheels: `nvidia-cuda-nvcc` brings nvcc, nvvm, the crt headers and the runtime
# headers, but `cuda_bf16.h` includes `nv/target`, which only `nvidia-cuda-cccl` ships.
# Why exact versions, for nvcc's own dependencies too: a driver refuses PTX written by a
# newer toolkit than it knows (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), and 13.0 matches the
# oldest driver we run on (580). The nvcc wheel does not pin nvvm, crt and the runtime
# headers, so pip would pair nvcc 13.0 with the newest nvvm, whose PTX the 13.0 ptxas
# rejects ("Unsupported .version").
#
# Environment: PYTHON (default: $PYO3_PYTHON, else python3) picks the interpreter whose
# site-packages receive the wheels; build.rs looks in the same place.
set -euo pipefail

# package==version, all from the CUDA 13.0 release.
PINS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
)
PY="${PYTHON:-${PYO3_PYTHON:-python3}}"

site_nvcc() {
    # The same search as build.rs: the import system first, then site-packages.
    "$PY" - <<'PY'
import os, sysconfig
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
roots += [os.path.join(sysconfig.get_paths()[k], "nvidia") for k in ("purelib", "platlib")]
for root in roots:
    p = os.path.join(root, "cu13", "bin", "nvcc")
    if os.path.isfile(p):
        print(p)
        break
PY
}

installed_version() {
    "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'
}

need=()
for pin in "${PINS[@]}"; do
    [ "$(installed_version "${pin%%==*}")" = "${pin##*==}" ] || need+=("$pin")
done
if [ "${#need[@]}" -gt 0 ]; then
    echo "installing ${need[*]}" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check "${need[@]}" >&2
fi

nvcc="$(site_nvcc)"
if [ -z "$nvcc" ]; then
    echo "nvcc was installed but not found under $("$PY" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')/nvidia/cu13/bin" >&2
    exit 1
fi
"$nvcc" --version | tail -n 2 >&2
echo "$nvcc"
