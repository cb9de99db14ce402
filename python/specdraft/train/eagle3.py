"""The EAGLE-3 head's own weights and row forward.

As published (Li et al., arXiv 2503.01840) and as vLLM's ``llama_eagle3.py`` and the
``speculators`` library's ``eagle3`` model run it. For the row of token ``t`` whose
hidden is ``h``::

    first draft:  h = fc(c)                   c: the target's hiddens at the captured layers,
                                              side by side (low | mid | high), [3 * hidden]
    later drafts: h = the previous step's output (before ``norm``), fed back without ``fc``
    a = concat[input_layernorm(embed(t)), hidden_norm(h)]    # 2 * hidden, embedding first
    q, k, v from a;  residual = h                             # then the shared decoder layer
    logits = lm_head(norm(out))                                # the head's own, draft vocabulary

Draft id ``i`` is target id ``draft_ids[i]`` (sorted ascending; ``d2t[i] = draft_ids[i] -
i``); the embedding is the target's, frozen and not stored with the head. The pairing is the
MTP head's (DESIGN.md "MTP pairing"): the row at position ``p`` holds the token at ``p`` and
the captured hiddens computed at ``p - 1``, and predicts the token at ``p + 1``.

A cached row is ``[c | final]``: the captured layers' hiddens and then the target's final
hidden before its final norm (the teacher), ``(aux + 1) * hidden`` wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.layer import HeadDims, Params, rms_norm
from specdraft.train.mtp import fresh_weights

__all__ = [
    "EAGLE3_ROWS",
    "Eagle3Rows",
    "aux_layer_ids",
    "capture_layers",
    "init_params",
    "layer_part",
    "param_shapes",
]

#: The decoder layer's parts, stored as ``layers.0.{part}.weight``; the other weights are
#: stored as ``{part}.weight``.
LAYER_PARTS = (
    "input_layernorm",
    "hidden_norm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def aux_layer_ids(num_hidden_layers: int, given: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """EAGLE-3's aux layer ids (vLLM's convention: the hidden *entering* layer ``k``).

    ``given`` as stated, else vLLM's default ``(2, L // 2, L - 3)``. Each id must be in
    ``1 .. L - 1`` (0 is the embedding, which the target does not capture) and the ids
    distinct.

    Raises ``ValueError`` naming the ids and the target's layer count.
    """
    n = num_hidden_layers
    ids = tuple(given) if given is not None else (2, n // 2, n - 3)
    if not ids:
        raise ValueError("the EAGLE-3 aux layers are empty: name at least one layer")
    bad = [k for k in ids if not 1 <= k <= n - 1]
    if bad or len(set(ids)) != len(ids):
        source = "--aux-layers" if given is not None else "the default (2, L // 2, L - 3)"
        raise ValueError(
            f"EAGLE-3 aux layers {list(ids)} ({source}) for a target of {n} layers: each must "
            f"be in 1..{n - 1} (the hidden entering that layer) and none twice"
        )
    return ids


def capture_layers(aux_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The decoder layers whose outputs hold the aux hiddens.

    The hidden entering layer ``k`` is the output of layer ``k - 1``.
    """
    return tuple(k - 1 for k in aux_ids)


def layer_part(part: str) -> bool:
    """Whether ``part`` is one of the decoder layer's weights (``layers.0.*``)."""
    return part in LAYER_PARTS


def param_shapes(d: HeadDims, aux: int, draft_vocab: int) -> dict[str, tuple[int, ...]]:
    """The head's own weights for ``aux`` captured layers: part names -> shape."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    return {
        "fc": (h, aux * h),
        "input_layernorm": (h,),
        "hidden_norm": (h,),
        "self_attn.q_proj": (q, 2 * h),
        "self_attn.k_proj": (kv, 2 * h),
        "self_attn.v_proj": (kv, 2 * h),
        "self_attn.o_proj": (h, q),
        "post_attention_layernorm": (h,),
        "mlp.gate_proj": (d.ffn, h),
        "mlp.up_proj": (d.ffn, h),
        "mlp.down_proj": (h, d.ffn),
        "norm": (h,),
        "lm_head": (draft_vocab, h),
    }


def init_params(
    d: HeadDims, aux: int, lm_head_rows: np.ndarray, seed: int
) -> dict[str, np.ndarray]:
    """Fresh float32 weights from a fixed seed.

    Norms at one and projections normal with std ``0.02``; the head's own LM head starts as
    the target's LM-head rows of the draft vocabulary (``lm_head_rows`` ``[draft_vocab,
    hidden]``), as ``speculators`` starts it, so a fresh head reads its hidden as the target
    reads its own.
    """
    out = fresh_weights(param_shapes(d, aux, lm_head_rows.shape[0]), seed)
    out["lm_head"] = np.array(lm_head_rows, dtype=np.float32)
    return out


@dataclass(frozen=True)
class Eagle3Rows:
    """The EAGLE-3 head's :class:`~specdraft.train.layer.RowForward`."""

    def first_hidden(self, p: Params, row: jax.Array) -> jax.Array:
        """``fc`` over the captured layers' part of a cached row.

        The final hidden after that part is the teacher, not an input.
        """
        fused = p["fc"].shape[1]
        return row[..., :fused] @ p["fc"].T

    def layer_input(
        self, p: Params, frozen: Params, d: HeadDims, tokens: jax.Array, hidden: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """The residual is the hidden itself; the attention reads both halves normed."""
        e = rms_norm(frozen["embed"][tokens], p["input_layernorm"], d.eps)
        g = rms_norm(hidden, p["hidden_norm"], d.eps)
        return hidden, jnp.concatenate([e, g], axis=-1)

    def logits(self, p: Params, frozen: Params, d: HeadDims, x: jax.Array) -> jax.Array:
        """The head's own LM head over ``norm(x)``."""
        del frozen
        return rms_norm(x, p["norm"], d.eps) @ p["lm_head"].T


EAGLE3_ROWS = Eagle3Rows()
