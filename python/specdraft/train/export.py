"""Writing a trained head, and reading one back as the start of further training.

A head is BF16 safetensors of its own weights, a config and a model card.

Tensor names are DeepSeek-V3's MTP layout, ``model.layers.{num_hidden_layers}.{part}.weight``
with the parts of :func:`specdraft.train.head.param_shapes` (what specdraft's MTP loader
looks for). The target's embedding, final norm and LM head are not written: a head file
shares them with its target. ``config.json`` is the target's Hugging Face config with
``num_nextn_predict_layers = 1``, plus ``mtp_vocab_size`` (the draft vocabulary: the first
``mtp_vocab_size`` token ids) and ``specdraft_target`` (which target it belongs to).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.quantize import read_safetensors, to_float32, write_safetensors
from specdraft.train.cache import bf16_bits
from specdraft.train.head import HeadDims, param_shapes
from specdraft.train.targets import TargetShape

__all__ = ["WEIGHTS_FILE", "head_config", "read_head", "start_weights", "tensor_name", "write_head"]

WEIGHTS_FILE = "mtp.safetensors"


def tensor_name(num_hidden_layers: int, part: str) -> str:
    """The checkpoint name of one of the head's weights."""
    return f"model.layers.{num_hidden_layers}.{part}.weight"


def head_config(
    shape: TargetShape, d: HeadDims, draft_vocab: int, target: dict[str, Any]
) -> dict[str, Any]:
    """The ``config.json`` of a head for ``shape``'s target."""
    return {
        "model_type": shape.model_type,
        "hidden_size": shape.hidden,
        "intermediate_size": d.ffn,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "num_nextn_predict_layers": 1,
        "mtp_layout": "deepseek_v3",
        "mtp_vocab_size": draft_vocab,
        "specdraft_target": target,
    }


def write_head(
    folder: Path,
    params: dict[str, np.ndarray],
    shape: TargetShape,
    d: HeadDims,
    draft_vocab: int,
    target: dict[str, Any],
    card: str,
) -> Path:
    """Write ``mtp.safetensors``, ``config.json`` and ``README.md`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for part, value in params.items():
        arr = np.asarray(value, dtype=np.float32)
        bits = bf16_bits(arr).astype("<u2")
        name = tensor_name(shape.num_hidden_layers, part)
        tensors[name] = ("BF16", list(arr.shape), bits.tobytes())
    write_safetensors(folder / WEIGHTS_FILE, tensors)
    config = head_config(shape, d, draft_vocab, target)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "README.md").write_text(card)
    return folder / WEIGHTS_FILE


def read_head(path: Path, shape: TargetShape, d: HeadDims) -> dict[str, np.ndarray]:
    """The float32 weights of a head written by :func:`write_head`.

    ``path`` is the head's folder or its ``mtp.safetensors``; the weights are checked against
    the head ``d`` of ``shape``'s target.

    Raises ``ValueError`` naming the first weight that is missing or of another shape.
    """
    path = Path(path)
    file = path / WEIGHTS_FILE if path.is_dir() else path
    raw = read_safetensors(file)
    out = {}
    for part, want in param_shapes(d).items():
        name = tensor_name(shape.num_hidden_layers, part)
        if name not in raw:
            raise ValueError(f"{file} has no {name}: not a head for this target")
        dtype, dims, data = raw[name]
        if tuple(dims) != want:
            raise ValueError(f"{file}: {name} has shape {tuple(dims)}, expected {want}")
        out[part] = to_float32(dtype, dims, data)
    return out


def start_weights(init_from: str | Path) -> Path:
    """Where ``train-mtp --init-from`` reads its weights.

    That is ``init_from`` itself where it exists (a ``state.npz`` checkpoint, a head folder
    or its ``mtp.safetensors``), else the shipped head of that name (``smollm2-mtp``).

    Raises ``FileNotFoundError`` naming ``init_from`` and the shipped heads.
    """
    from specdraft.heads import draft_head_path, shipped_heads

    path = Path(init_from)
    if path.exists():
        return path
    if str(init_from) in shipped_heads():
        return draft_head_path(str(init_from))
    raise FileNotFoundError(
        f"--init-from {str(init_from)!r}: no such file or folder, and no shipped head of that "
        f"name (shipped: {', '.join(shipped_heads()) or 'none'})"
    )
