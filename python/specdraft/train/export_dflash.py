"""Writing a trained DFlash head in z-lab's layout, and reading one back.

The folder holds ``model.safetensors``, ``config.json``, a model card ``README.md`` (and the
pipeline's ``report.json``):

- weights, BF16: per draft layer ``i`` ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.{i}.self_attn.{q,k}_norm.weight`` ``[head_dim]``,
  ``layers.{i}.{input_layernorm,post_attention_layernorm}.weight`` and
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``; then ``fc.weight`` ``[hidden, taps *
  hidden]``, ``hidden_norm.weight`` and ``norm.weight``. The target's embedding and LM head
  are not written: the head is loaded beside its target, which it shares them with.
- ``config.json``: a Qwen3 config of the draft layers (``num_hidden_layers`` is theirs, the
  other sizes the target's, ``vocab_size`` the target's), ``num_target_layers``,
  ``block_size``, ``dflash_config`` (``target_layer_ids``: the target layers whose outputs
  ``fc`` fuses; ``mask_token_id``), ``draft_vocab_size`` (the head learned to draft over the
  target's first that many ids) and ``specdraft_target`` (which target it belongs to), as the
  other heads' configs have it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.quantize import read_safetensors, to_float32, write_safetensors
from specdraft.train.cache import bf16_bits
from specdraft.train.dflash import DFlashShape, param_shapes
from specdraft.train.layer import HeadDims
from specdraft.train.targets import TargetShape

__all__ = ["WEIGHTS_FILE", "dflash_config", "read_dflash", "read_dflash_config", "write_dflash"]

WEIGHTS_FILE = "model.safetensors"


def dflash_config(
    shape: TargetShape,
    d: HeadDims,
    s: DFlashShape,
    draft_vocab: int,
    target: dict[str, Any],
) -> dict[str, Any]:
    """The ``config.json`` of a head for ``shape``'s target."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": shape.hidden,
        "intermediate_size": d.ffn,
        "num_hidden_layers": s.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * s.layers,
        "torch_dtype": "bfloat16",
        "num_target_layers": shape.num_hidden_layers,
        "block_size": s.block_size,
        "dflash_config": {
            "target_layer_ids": list(s.target_layer_ids),
            "mask_token_id": s.mask_token_id,
        },
        "draft_vocab_size": draft_vocab,
        "specdraft_target": target,
    }


def write_dflash(
    folder: Path, params: dict[str, np.ndarray], config: dict[str, Any], card: str
) -> Path:
    """Write ``model.safetensors``, ``config.json`` and ``README.md`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for part, value in params.items():
        arr = np.asarray(value, dtype=np.float32)
        tensors[f"{part}.weight"] = (
            "BF16",
            list(arr.shape),
            bf16_bits(arr).astype("<u2").tobytes(),
        )
    write_safetensors(folder / WEIGHTS_FILE, tensors)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "README.md").write_text(card)
    return folder / WEIGHTS_FILE


def _folder(path: Path) -> Path:
    path = Path(path)
    return path if path.is_dir() else path.parent


def read_dflash_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` beside a head's weights (``path``: its folder or its weights).

    Raises ``ValueError`` where there is none or it is not a DFlash config.
    """
    file = _folder(path) / "config.json"
    if not file.exists():
        raise ValueError(f"{file} does not exist: a DFlash head's folder holds its config")
    config = json.loads(file.read_text())
    if not isinstance(config, dict) or not isinstance(config.get("dflash_config"), dict):
        raise ValueError(f"{file} has no dflash_config: not a DFlash head")
    return config


def read_dflash(path: Path, d: HeadDims, s: DFlashShape) -> dict[str, np.ndarray]:
    """The float32 weights of a head written by :func:`write_dflash`.

    ``path`` is the head's folder or its ``model.safetensors``; its config must describe the
    head ``s`` (layers, block size, mask token and target layers: weights trained for
    others would draft from other inputs), its weights the shapes of ``d`` and ``s``.

    Raises ``ValueError`` naming the first difference, or the weight that is missing or of
    another shape.
    """
    config = read_dflash_config(path)
    theirs = {
        "num_hidden_layers": config.get("num_hidden_layers"),
        "block_size": config.get("block_size"),
        "mask_token_id": config["dflash_config"].get("mask_token_id"),
        "target_layer_ids": tuple(config["dflash_config"].get("target_layer_ids") or ()),
    }
    ours = {
        "num_hidden_layers": s.layers,
        "block_size": s.block_size,
        "mask_token_id": s.mask_token_id,
        "target_layer_ids": s.target_layer_ids,
    }
    option = {
        "num_hidden_layers": "--draft-layers",
        "block_size": "--block-size",
        "mask_token_id": "--mask-token",
        "target_layer_ids": "--aux-layers",
    }
    for key, want in ours.items():
        if theirs[key] != want:
            raise ValueError(
                f"{_folder(path)} is a DFlash head of {key} {theirs[key]}, not this run's "
                f"{want}; pass {option[key]} to match it"
            )
    path = Path(path)
    file = path / WEIGHTS_FILE if path.is_dir() else path
    raw = read_safetensors(file)
    out = {}
    for part, want_shape in param_shapes(d, s).items():
        name = f"{part}.weight"
        if name not in raw:
            raise ValueError(f"{file} has no {name}: not a DFlash head for this target")
        dtype, dims, data = raw[name]
        if tuple(dims) != want_shape:
            raise ValueError(f"{file}: {name} has shape {tuple(dims)}, expected {want_shape}")
        out[part] = to_float32(dtype, dims, data)
    return out
