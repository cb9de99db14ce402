"""Draft heads shipped inside the package, loadable by name beside their target.

Each head is a folder here (``config.json``, its weights, ``README.md``, the training
``report.json``) holding only the head's own weights: loaded with :func:`load_draft_head`, it
reads the target's embedding (and, but for an EAGLE-3 head's own LM head, its final norm and
LM head) in place. Its kind, read from ``config.json``, picks the class that loads it: an MTP
head (:class:`specdraft.MtpHead`), an EAGLE-3 head (``speculators_model_type: "eagle3"``,
:class:`specdraft.Eagle3Head`) or a DFlash head (``dflash_config``,
:class:`specdraft.DFlashHead`). ``config.json``'s ``specdraft_target.file`` names the model
file the head was trained for, which is how ``--proposer mtp`` (or ``eagle3``, ``dflash``)
finds the head of that kind for the model being run.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "HEAD_KINDS",
    "best_head_for",
    "default_head_for",
    "draft_head_path",
    "head_kind",
    "load_draft_head",
    "measured_acceptance",
    "shipped_heads",
]

#: The kinds of draft head a shipped folder can hold.
HEAD_KINDS = ("mtp", "eagle3", "dflash")


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


def _config(name: str) -> dict[str, Any]:
    config = json.loads((draft_head_path(name) / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError(f"draft head {name!r}: config.json is not a JSON object")
    return config


def _kind_of(config: dict[str, Any]) -> str:
    if config.get("speculators_model_type") == "eagle3":
        return "eagle3"
    if "dflash_config" in config:
        return "dflash"
    return "mtp"


def head_kind(name: str) -> str:
    """The kind of the shipped head ``name``: ``"mtp"``, ``"eagle3"`` or ``"dflash"``."""
    return _kind_of(_config(name))


def default_head_for(model_file: str | Path, kind: str = "mtp") -> str:
    """The shipped head of ``kind`` trained for the model file ``model_file`` (by its name)."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"no draft head kind {kind!r}; kinds: {', '.join(HEAD_KINDS)}")
    wanted = Path(model_file).name
    for name, config in _heads_for(wanted).items():
        if _kind_of(config) == kind:
            return name
    raise ValueError(
        f"no shipped {kind} draft head was trained for {wanted}; shipped: "
        + ", ".join(f"{n} ({head_kind(n)}, for {_target_file(n)})" for n in shipped_heads())
        + f"; train one with specdraft train --method {kind} and load it from its folder"
    )


def measured_acceptance(name: str) -> float | None:
    """The mean acceptance length the shipped head ``name`` measured when it was trained.

    It is ``report.json``'s ``acceptance.engine_mean_acceptance_length``, counted through the
    engine; None when the head's folder holds no such figure.
    """
    try:
        report = json.loads((draft_head_path(name) / "report.json").read_text())
        value = report["acceptance"]["engine_mean_acceptance_length"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def best_head_for(model_file: str | Path) -> str:
    """The shipped head, of any kind, that drafts best for the model file ``model_file``.

    That is the highest mean acceptance length its training report measured through the
    engine (:func:`measured_acceptance`); heads without one come last, and a tie goes to the
    kind listed first in :data:`HEAD_KINDS`.
    """
    wanted = Path(model_file).name
    found = _heads_for(wanted)
    if not found:
        raise ValueError(
            f"no shipped draft head was trained for {wanted}; shipped: "
            + (", ".join(f"{n} (for {_target_file(n)})" for n in shipped_heads()) or "none")
        )

    def rank(name: str) -> tuple[float, int]:
        acceptance = measured_acceptance(name)
        kind = _kind_of(found[name])
        return (-1.0 if acceptance is None else acceptance, -HEAD_KINDS.index(kind))

    return max(found, key=rank)


def _heads_for(model_file_name: str) -> dict[str, dict[str, Any]]:
    """The shipped heads trained for the model file named ``model_file_name``.

    Each maps to its ``config.json``, in name order.
    """
    heads = {name: _config(name) for name in shipped_heads()}
    return {
        name: config
        for name, config in heads.items()
        if config.get("specdraft_target", {}).get("file") == model_file_name
    }


def _target_file(name: str) -> str:
    config = _config(name)
    return str(config.get("specdraft_target", {}).get("file", "an unnamed target"))


def load_draft_head(name: str, model: Any, **options: Any) -> Any:  # noqa: ANN401
    """The shipped draft head ``name`` (e.g. ``"smollm2-mtp"``), ready to draft for ``model``.

    ``model`` is a :class:`specdraft.TargetModel`; the head runs on its backend and shares
    its embedding (and, but for an EAGLE-3 head's own, its final norm and LM head) without a
    copy. The class is the head's kind (:func:`head_kind`): :class:`specdraft.MtpHead`,
    :class:`specdraft.Eagle3Head` or :class:`specdraft.DFlashHead`, and ``options`` go to its
    ``from_checkpoint`` (for an MTP head ``quant``, ``mtp_vocab_size``, ``max_seq_len``,
    ``main_kv_blocks``, ``levers``); the drafter's KV pool is sized to the model's (its
    ``max_seq_len`` and KV blocks) unless they say otherwise.

    ``quant`` defaults to ``"q8_0"`` on the CPU backend: the head's BF16 projections (and an
    EAGLE-3 head's own LM head) are quantized at load to Q8_0 blocks and run on the kernels
    the target's quantized weights use, which about halves the bytes a draft step reads
    (``benches/mtp.rs``, ``eagle3.rs`` and ``dflash.rs`` measure it against the target's
    step). On
    other backends it defaults to ``"bf16"``, the weights as shipped. A DFlash head drafts
    over the ``draft_vocab_size`` its ``config.json`` names unless ``draft_vocab`` says
    otherwise.
    """
    import specdraft

    folder = draft_head_path(name)
    config = _config(name)
    kind = _kind_of(config)
    options.setdefault("max_seq_len", model.max_seq_len)
    options.setdefault("main_kv_blocks", model.kv_blocks[0])
    options.setdefault("quant", "q8_0" if isinstance(model.gpu, specdraft.CpuBackend) else "bf16")
    if kind == "eagle3":
        return specdraft.Eagle3Head.from_checkpoint(folder, model.gpu, target=model, **options)
    if kind == "dflash":
        vocab = config.get("draft_vocab_size")
        if isinstance(vocab, int):
            options.setdefault("draft_vocab", vocab)
        return specdraft.DFlashHead.from_checkpoint(folder, model.gpu, target=model, **options)
    return specdraft.MtpHead.from_checkpoint(folder, model.gpu, target=model, **options)
