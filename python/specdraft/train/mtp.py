"""The MTP head's own weights and row forward (DeepSeek-V3's and MiMo's MTP module).

For a row with token ``t`` and hidden ``h`` (the head's ``MtpHead`` runs the same)::

    x = eh_proj(concat[enorm(embed(t)), hnorm(h)])        # embedding first; the residual
    q, k, v from input_layernorm(x)                        # then the shared decoder layer
    logits = lm_head(shared_head.norm(out))                # over the draft vocabulary

``embed`` and ``lm_head`` are the target's, frozen (``frozen["lm_head"]`` holds the target's
LM-head rows of the draft vocabulary); only the head's own weights train. A cached row is
the target's final hidden (before its final norm), which is both the hidden a chain's first
draft pairs with and the teacher.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.layer import HeadDims, Params, rms_norm

__all__ = ["MTP_ROWS", "MtpRows", "init_params", "param_shapes"]


def param_shapes(d: HeadDims) -> dict[str, tuple[int, ...]]:
    """The head's own weights: DeepSeek-V3 part names (without ``.weight``) -> shape."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    return {
        "enorm": (h,),
        "hnorm": (h,),
        "eh_proj": (h, 2 * h),
        "input_layernorm": (h,),
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "post_attention_layernorm": (h,),
        "mlp.gate_proj": (d.ffn, h),
        "mlp.up_proj": (d.ffn, h),
        "mlp.down_proj": (h, d.ffn),
        "shared_head.norm": (h,),
    }


def fresh_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Float32 weights from a fixed seed, in ``shapes``' order.

    Norms (one axis) at one, matrices normal with std ``0.02`` (Hugging Face's Llama
    initialisation).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return out


def init_params(d: HeadDims, seed: int) -> dict[str, np.ndarray]:
    """Fresh float32 weights of the MTP head from a fixed seed (see :func:`fresh_weights`)."""
    return fresh_weights(param_shapes(d), seed)


@dataclass(frozen=True)
class MtpRows:
    """The MTP head's :class:`~specdraft.train.layer.RowForward`."""

    def first_hidden(self, p: Params, row: jax.Array) -> jax.Array:
        """The cached row is the target's final hidden: paired as it is."""
        del p
        return row

    def layer_input(
        self, p: Params, frozen: Params, d: HeadDims, tokens: jax.Array, hidden: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """``eh_proj`` of the normed embedding and hidden; the attention reads it normed."""
        e = rms_norm(frozen["embed"][tokens], p["enorm"], d.eps)
        g = rms_norm(hidden, p["hnorm"], d.eps)
        x = jnp.concatenate([e, g], axis=-1) @ p["eh_proj"].T
        return x, rms_norm(x, p["input_layernorm"], d.eps)

    def logits(self, p: Params, frozen: Params, d: HeadDims, x: jax.Array) -> jax.Array:
        """The target's LM-head rows of the draft vocabulary over ``shared_head.norm(x)``."""
        return rms_norm(x, p["shared_head.norm"], d.eps) @ frozen["lm_head"].T


MTP_ROWS = MtpRows()
