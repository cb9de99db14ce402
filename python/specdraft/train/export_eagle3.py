"""Writing a trained EAGLE-3 head as a ``speculators`` checkpoint, and reading one back.

The folder holds ``model.safetensors``, ``config.json``, a model card ``README.md`` (and the
pipeline's ``report.json``):

- weights, BF16: ``fc.weight`` ``[hidden, aux * hidden]``, the decoder layer as
  ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (q/k/v over ``2 * hidden`` columns),
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``norm.weight`` and ``lm_head.weight``
  ``[draft_vocab, hidden]``; ``d2t`` int64 ``[draft_vocab]`` (draft id ``i`` is target id
  ``i + d2t[i]``) and ``t2d`` bool ``[vocab]`` (which target ids are drafted). The target's
  embedding is not written: the head is loaded beside its target.
- ``config.json``: ``speculators_model_type: "eagle3"``, ``architectures``, the layer's
  Llama config under ``transformer_layer_config`` (its ``vocab_size`` is the target's),
  ``draft_vocab_size``, ``norm_before_residual: false``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` (vLLM's convention: the hidden entering each layer),
  ``speculators_config`` (algorithm, greedy proposal of the trained draft count, verifier)
  and ``specdraft_target`` (which target it belongs to), as the MTP head's config has it.

Invariant: the draft ids' target ids are sorted ascending and distinct, so ``d2t`` is
non-decreasing and ``t2d`` marks exactly ``draft_vocab`` ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.quantize import read_safetensors, to_float32, write_safetensors
from specdraft.train.cache import bf16_bits
from specdraft.train.eagle3 import layer_part, param_shapes
from specdraft.train.layer import HeadDims
from specdraft.train.targets import TargetShape

__all__ = ["WEIGHTS_FILE", "eagle3_config", "read_eagle3", "tensor_name", "write_eagle3"]

WEIGHTS_FILE = "model.safetensors"

#: Hugging Face architecture names of the targets specdraft loads, for the verifier entry.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mimo": "MiMoForCausalLM",
}


def tensor_name(part: str) -> str:
    """The checkpoint name of one of the head's weights."""
    return f"layers.0.{part}.weight" if layer_part(part) else f"{part}.weight"


def eagle3_config(
    shape: TargetShape,
    d: HeadDims,
    draft_vocab: int,
    aux_ids: tuple[int, ...],
    drafts: int,
    target: dict[str, Any],
) -> dict[str, Any]:
    """The ``config.json`` of a head for ``shape``'s target.

    The head fuses the hiddens entering the layers ``aux_ids`` and was trained for
    ``drafts`` drafts.
    """
    arch = _ARCHITECTURES.get(shape.model_type)
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": shape.hidden,
            "intermediate_size": d.ffn,
            "num_hidden_layers": 1,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": shape.rms_norm_eps,
            "rope_theta": shape.rope_theta,
            "vocab_size": shape.vocab,
            "max_position_embeddings": shape.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        },
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,
        "target_hidden_size": shape.hidden,
        "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts}],
            "verifier": {
                "name_or_path": target.get("name"),
                "architectures": [arch] if arch else [],
            },
        },
        "specdraft_target": target,
    }


def _check_draft_ids(draft_ids: np.ndarray, vocab: int) -> np.ndarray:
    ids = np.asarray(draft_ids, np.int64)
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError(f"draft ids of shape {ids.shape}: expected a non-empty list")
    if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= vocab:
        raise ValueError(
            f"draft ids must be distinct target ids in 0..{vocab - 1}, sorted ascending"
        )
    return ids


def write_eagle3(
    folder: Path,
    params: dict[str, np.ndarray],
    draft_ids: np.ndarray,
    config: dict[str, Any],
    card: str,
) -> Path:
    """Write ``model.safetensors``, ``config.json`` and ``README.md`` into ``folder``.

    ``draft_ids`` are the target ids of the draft vocabulary, sorted ascending.
    """
    vocab = int(config["transformer_layer_config"]["vocab_size"])
    ids = _check_draft_ids(draft_ids, vocab)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for part, value in params.items():
        arr = np.asarray(value, dtype=np.float32)
        bits = bf16_bits(arr).astype("<u2").tobytes()
        tensors[tensor_name(part)] = ("BF16", list(arr.shape), bits)
    d2t = ids - np.arange(len(ids), dtype=np.int64)
    tensors["d2t"] = ("I64", [len(ids)], d2t.astype("<i8").tobytes())
    t2d = np.zeros(vocab, np.uint8)
    t2d[ids] = 1
    tensors["t2d"] = ("BOOL", [vocab], t2d.tobytes())
    write_safetensors(folder / WEIGHTS_FILE, tensors)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "README.md").write_text(card)
    return folder / WEIGHTS_FILE


def read_eagle3(path: Path, d: HeadDims, aux: int, draft_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The float32 weights of a head written by :func:`write_eagle3`.

    ``path`` is the head's folder or its ``model.safetensors``; the weights are checked
    against the head ``d`` fusing ``aux`` layers, and its ``d2t`` against this run's draft
    vocabulary ``draft_ids`` (a head over other ids would start from rows of other tokens).

    Raises ``ValueError`` naming the first weight that is missing or of another shape, or
    the draft vocabulary's difference.
    """
    path = Path(path)
    file = path / WEIGHTS_FILE if path.is_dir() else path
    raw = read_safetensors(file)
    ids = np.asarray(draft_ids, np.int64)
    out = {}
    for part, want in param_shapes(d, aux, len(ids)).items():
        name = tensor_name(part)
        if name not in raw:
            raise ValueError(f"{file} has no {name}: not an EAGLE-3 head for this target")
        dtype, dims, data = raw[name]
        if tuple(dims) != want:
            raise ValueError(f"{file}: {name} has shape {tuple(dims)}, expected {want}")
        out[part] = to_float32(dtype, dims, data)
    if "d2t" not in raw or raw["d2t"][0] != "I64" or raw["d2t"][1] != [len(ids)]:
        raise ValueError(f"{file}: no int64 d2t of {len(ids)} draft ids")
    theirs = np.frombuffer(raw["d2t"][2], "<i8") + np.arange(len(ids))
    if not np.array_equal(theirs, ids):
        differ = int(np.sum(theirs != ids))
        raise ValueError(
            f"{file}: its draft vocabulary differs from this run's in {differ} of {len(ids)} "
            "ids; start from a head chosen on the same data, or train afresh"
        )
    return out
