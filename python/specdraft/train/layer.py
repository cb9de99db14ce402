"""The decoder layer the trained heads share, and what a head's own row forward must provide.

Both heads (:mod:`specdraft.train.mtp`, :mod:`specdraft.train.eagle3`) run one Llama decoder
layer of the target's shape: q/k/v projections of an attention input, rotate-half RoPE at
the row's token position, grouped-query attention, ``o_proj`` added to a residual, then
``post_attention_layernorm`` and a SwiGLU MLP with its own residual. They differ only in
how a row's input is built (the attention input and the residual, from the token and a
hidden) and in how logits are read from the layer's output; a :class:`RowForward` is that
difference, and :mod:`specdraft.train.head`'s training-time-test unroll, loss and engine
walk run any head given one.

Invariants: every function here is pure JAX over float32 arrays; a ``RowForward`` is a
hashable value (``jax.jit`` and ``functools.lru_cache`` key on it), and the hidden it
takes and returns is ``hidden`` wide, except :meth:`RowForward.first_hidden`'s input, a
cached row (whatever the head's cache holds per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.targets import TargetShape

__all__ = [
    "HeadDims",
    "Params",
    "RowForward",
    "head_dims",
    "layer_output",
    "project_qkv",
    "rms_norm",
]

Params = dict[str, Any]


@dataclass(frozen=True)
class HeadDims:
    """The static sizes of a head's forward (hashable, so jit can specialise on it)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    rope_theta: float


def head_dims(shape: TargetShape, ffn: int | None = None) -> HeadDims:
    """A head's sizes for a target: one decoder layer of the target's shape."""
    return HeadDims(
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        ffn or shape.ffn,
        shape.rms_norm_eps,
        shape.rope_theta,
    )


class RowForward(Protocol):
    """One head's own part of the row forward (see the module docs)."""

    def first_hidden(self, p: Params, row: jax.Array) -> jax.Array:
        """The hidden a chain's first draft step pairs with, from a cached row ``[..., W]``."""
        ...

    def layer_input(
        self, p: Params, frozen: Params, d: HeadDims, tokens: jax.Array, hidden: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """``(residual [..., hidden], attention input)`` of rows of ``tokens`` and ``hidden``."""
        ...

    def logits(self, p: Params, frozen: Params, d: HeadDims, x: jax.Array) -> jax.Array:
        """Draft-vocabulary logits from the layer's output ``x`` (before any final norm)."""
        ...


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(d: HeadDims) -> jax.Array:
    # As the Rust heads compute it: in float64, then rounded to float32.
    i = np.arange(d.head_dim // 2, dtype=np.float64)
    return jnp.asarray((1.0 / d.rope_theta ** (2.0 * i / d.head_dim)).astype(np.float32))


def _rope(x: jax.Array, positions: jax.Array, d: HeadDims) -> jax.Array:
    """Rotate-half RoPE of ``x`` ``[B, T, heads, head_dim]`` at ``positions`` ``[B, T]``."""
    half = d.head_dim // 2
    ang = positions.astype(jnp.float32)[..., None] * _inv_freq(d)
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def project_qkv(
    p: Params, d: HeadDims, a: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values of the attention input ``a`` ``[B, T, in]``.

    Queries are ``[B, T, kv_heads, group, head_dim]``, keys and values ``[B, T, kv_heads,
    head_dim]``; queries and keys are rotated at ``positions``.
    """
    b, t, _ = a.shape
    group = d.heads // d.kv_heads
    q = _rope((a @ p["self_attn.q_proj"].T).reshape(b, t, d.heads, d.head_dim), positions, d)
    k = _rope((a @ p["self_attn.k_proj"].T).reshape(b, t, d.kv_heads, d.head_dim), positions, d)
    v = (a @ p["self_attn.v_proj"].T).reshape(b, t, d.kv_heads, d.head_dim)
    # Query head h reads KV head h // group.
    return q.reshape(b, t, d.kv_heads, group, d.head_dim), k, v


def layer_output(p: Params, d: HeadDims, x: jax.Array, attn: jax.Array) -> jax.Array:
    """The layer's output from its residual ``x`` and attention output ``attn``."""
    x = x + attn @ p["self_attn.o_proj"].T
    n = rms_norm(x, p["post_attention_layernorm"], d.eps)
    mlp = jax.nn.silu(n @ p["mlp.gate_proj"].T) * (n @ p["mlp.up_proj"].T)
    return x + mlp @ p["mlp.down_proj"].T
