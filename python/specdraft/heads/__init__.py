"""Draft heads shipped inside the package, loadable by name beside their target.

Each head is a folder here (``config.json``, ``mtp.safetensors``, ``README.md``, the
training ``report.json``) holding only the head's own weights: loaded with
:func:`load_draft_head`, it reads the target's embedding, final norm and LM head in place.
``config.json``'s ``specdraft_target.file`` names the model file the head was trained for,
which is how ``--proposer mtp`` finds the head of the model being run.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["default_head_for", "draft_head_path", "load_draft_head", "shipped_heads"]


def _root() -> Path:
    return Path(str(resources.files(__name__)))


def shipped_heads() -> list[str]:
    """The names of the heads shipped with this package."""
    return sorted(p.name for p in _root().iterdir() if (p / "config.json").is_file())


def draft_head_path(name: str) -> Path:
    """The folder of the shipped head ``name``; an error lists the shipped ones."""
    folder = _root() / name
    if not name or "/" in name or "\\" in name or not (folder / "config.json").is_file():
        raise ValueError(
            f"no shipped draft head {name!r}; shipped: {', '.join(shipped_heads()) or 'none'}"
        )
    return folder


def default_head_for(model_file: str | Path) -> str:
    """The shipped head trained for the model file ``model_file`` (matched by file name)."""
    wanted = Path(model_file).name
    for name in shipped_heads():
        config = json.loads((draft_head_path(name) / "config.json").read_text())
        if config.get("specdraft_target", {}).get("file") == wanted:
            return name
    raise ValueError(
        f"no shipped draft head was trained for {wanted}; shipped: "
        + ", ".join(f"{n} (for {_target_file(n)})" for n in shipped_heads())
        + "; train one with specdraft train-mtp and load it with MtpHead.from_checkpoint"
    )


def _target_file(name: str) -> str:
    config = json.loads((draft_head_path(name) / "config.json").read_text())
    return str(config.get("specdraft_target", {}).get("file", "an unnamed target"))


def load_draft_head(name: str, model: Any, **options: Any) -> Any:  # noqa: ANN401
    """The shipped draft head ``name`` (e.g. ``"smollm2-mtp"``), ready to draft for ``model``.

    ``model`` is a :class:`specdraft.TargetModel`; the head runs on its backend and shares
    its embedding, final norm and LM head (no copy). ``options`` go to
    :meth:`specdraft.MtpHead.from_checkpoint` (``quant``, ``mtp_vocab_size``,
    ``max_seq_len``, ``main_kv_blocks``, ``levers``); the drafter's KV pool is sized to the
    model's (its ``max_seq_len`` and KV blocks) unless they say otherwise.

    ``quant`` defaults to ``"q8_0"`` on the CPU backend: the head's BF16 projections are
    quantized at load to Q8_0 blocks and run on the kernels the target's quantized weights
    use, which about halves the bytes a draft step reads (``benches/mtp.rs`` measures the
    step against the target's). On other backends it defaults to ``"bf16"``, the weights as
    shipped.
    """
    import specdraft

    folder = draft_head_path(name)
    options.setdefault("quant", "q8_0" if isinstance(model.gpu, specdraft.CpuBackend) else "bf16")
    options.setdefault("max_seq_len", model.max_seq_len)
    options.setdefault("main_kv_blocks", model.kv_blocks[0])
    return specdraft.MtpHead.from_checkpoint(folder, model.gpu, target=model, **options)
