"""The MTP head's forward and its training loss, in JAX.

The module is DeepSeek-V3's (and MiMo's) multi-token-prediction layer, the one specdraft's
``MtpHead`` runs: for a row with token ``t`` and hidden ``h``

    x = eh_proj(concat[enorm(embed(t)), hnorm(h)])        # embedding first
    x = x + o_proj(attention(rope(q), rope(k), v))        # pre-norm, input_layernorm
    x = x + down(silu(gate(n)) * up(n)),  n = post_attention_layernorm(x)
    logits = lm_head(shared_head.norm(x))                 # over the draft vocabulary

``embed`` and ``lm_head`` are the target's, frozen; only the head's own weights train.
RoPE is rotate-half (the head's q/k are stored in Hugging Face order) at the position of
the row's token. The pairing is DeepSeek-V3's: the row at position ``p`` holds the token at
``p`` and the target hidden computed at ``p - 1``, and predicts the token at ``p + 1``.
A draft after the first feeds the layer's output ``x`` (before the final norm) back as the
hidden, with the previous draft as the token, at the next position.

Training unrolls ``steps`` drafts for every row of a sequence at once. Step 0's keys and
values are those of the target-hidden rows (what ``prefill_drafter`` and ``catchup`` write);
step ``j`` at base row ``i`` attends to step 0's rows ``0..=i`` and to its own chain's
rows of steps ``1..=j`` at that same base row: exactly the rows the head's KV cache holds
when it drafts its ``j``-th token after position ``i`` (EAGLE-3's training-time test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.targets import TargetShape

__all__ = [
    "HeadDims",
    "decode_row",
    "head_dims",
    "init_params",
    "param_shapes",
    "rows_from_window",
    "target_log_probs",
    "target_row_kv",
    "unroll",
    "unroll_loss",
]

Params = dict[str, Any]

#: The loss weight of draft step ``j`` is ``STEP_DECAY ** j`` (EAGLE-3, SpecForge).
STEP_DECAY = 0.8


@dataclass(frozen=True)
class HeadDims:
    """The static sizes of the head's forward (hashable, so jit can specialise on it)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    rope_theta: float


def head_dims(shape: TargetShape, ffn: int | None = None) -> HeadDims:
    """The head's sizes for a target: one decoder layer of the target's shape."""
    return HeadDims(
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        ffn or shape.ffn,
        shape.rms_norm_eps,
        shape.rope_theta,
    )


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


def init_params(d: HeadDims, seed: int) -> dict[str, np.ndarray]:
    """Fresh float32 weights from a fixed seed.

    Norms at one, projections normal with std ``0.02`` (Hugging Face's Llama initialisation).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(d).items():
        if len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return out


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(d: HeadDims) -> jax.Array:
    # As the head computes it: in float64, then rounded to float32.
    i = np.arange(d.head_dim // 2, dtype=np.float64)
    return jnp.asarray((1.0 / d.rope_theta ** (2.0 * i / d.head_dim)).astype(np.float32))


def _rope(x: jax.Array, positions: jax.Array, d: HeadDims) -> jax.Array:
    """Rotate-half RoPE of ``x`` ``[B, T, heads, head_dim]`` at ``positions`` ``[B, T]``."""
    half = d.head_dim // 2
    ang = positions.astype(jnp.float32)[..., None] * _inv_freq(d)
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _layer_input(
    p: Params, embed: jax.Array, d: HeadDims, tokens: jax.Array, hidden: jax.Array
) -> jax.Array:
    e = _rms_norm(embed[tokens], p["enorm"], d.eps)
    g = _rms_norm(hidden, p["hnorm"], d.eps)
    return jnp.concatenate([e, g], axis=-1) @ p["eh_proj"].T


def _qkv(
    p: Params, d: HeadDims, x: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, t, _ = x.shape
    group = d.heads // d.kv_heads
    n = _rms_norm(x, p["input_layernorm"], d.eps)
    q = _rope((n @ p["self_attn.q_proj"].T).reshape(b, t, d.heads, d.head_dim), positions, d)
    k = _rope((n @ p["self_attn.k_proj"].T).reshape(b, t, d.kv_heads, d.head_dim), positions, d)
    v = (n @ p["self_attn.v_proj"].T).reshape(b, t, d.kv_heads, d.head_dim)
    # Query head h reads KV head h // group.
    return q.reshape(b, t, d.kv_heads, group, d.head_dim), k, v


def _attend(
    d: HeadDims,
    q: jax.Array,
    k0: jax.Array,
    v0: jax.Array,
    chain_k: list[jax.Array],
    chain_v: list[jax.Array],
) -> jax.Array:
    """Attention of ``q`` over step 0's rows ``0..=i`` plus the chain's rows at row ``i``."""
    b, t = q.shape[:2]
    scale = 1.0 / float(np.sqrt(d.head_dim))
    s0 = jnp.einsum("btkgd,bskd->bkgts", q, k0) * scale
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    s0 = jnp.where(causal, s0, -jnp.inf)
    parts = [s0]
    if chain_k:
        ck = jnp.stack(chain_k, axis=-2)  # [B, T, kvh, J, hd]
        parts.append(jnp.einsum("btkgd,btkjd->bkgtj", q, ck) * scale)
    probs = jax.nn.softmax(jnp.concatenate(parts, axis=-1), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0)
    if chain_v:
        cv = jnp.stack(chain_v, axis=-2)
        out = out + jnp.einsum("bkgtj,btkjd->btkgd", probs[..., t:], cv)
    return out.reshape(b, t, d.heads * d.head_dim)


def _layer_output(p: Params, d: HeadDims, x: jax.Array, attn: jax.Array) -> jax.Array:
    x = x + attn @ p["self_attn.o_proj"].T
    n = _rms_norm(x, p["post_attention_layernorm"], d.eps)
    mlp = jax.nn.silu(n @ p["mlp.gate_proj"].T) * (n @ p["mlp.up_proj"].T)
    return x + mlp @ p["mlp.down_proj"].T


def unroll(
    p: Params,
    frozen: Params,
    d: HeadDims,
    tokens: jax.Array,
    positions: jax.Array,
    hidden: jax.Array,
    steps: int,
    feed_drafts: bool = False,
) -> list[jax.Array]:
    """Draft logits ``[B, T, draft_vocab]`` for steps ``0..steps`` at every row.

    ``tokens`` and ``positions`` are ``[steps, B, T]``: row ``i`` of step ``j`` feeds
    ``tokens[j, :, i]`` at ``positions[j, :, i]``. ``hidden`` ``[B, T, hidden]`` is the
    target hidden each row's step 0 pairs with. With ``feed_drafts`` the steps after the
    first feed the previous step's greedy draft instead of ``tokens[j]`` (as the engine does).
    ``frozen`` holds the target's ``embed`` ``[vocab, hidden]`` and ``lm_head`` rows
    ``[draft_vocab, hidden]``.
    """
    chain_k: list[jax.Array] = []
    chain_v: list[jax.Array] = []
    out: list[jax.Array] = []
    k0 = v0 = None
    for j in range(steps):
        tok = tokens[j]
        if feed_drafts and j > 0:
            tok = jnp.argmax(out[-1], axis=-1).astype(tokens.dtype)
        x = _layer_input(p, frozen["embed"], d, tok, hidden)
        q, k, v = _qkv(p, d, x, positions[j])
        if j == 0:
            k0, v0 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        x = _layer_output(p, d, x, _attend(d, q, k0, v0, chain_k, chain_v))
        out.append(_rms_norm(x, p["shared_head.norm"], d.eps) @ frozen["lm_head"].T)
        hidden = x
    return out


def target_row_kv(
    p: Params, frozen: Params, d: HeadDims, tokens: jax.Array, hidden: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[S, kv_heads, head_dim]`` of the target-hidden rows of a sequence.

    Row ``q`` pairs token ``q`` with hidden ``q - 1`` at position ``q`` (what
    ``prefill_drafter``, a propose's first row and ``catchup`` write); row 0 has no hidden
    before it and is zeros. ``tokens`` ``[S]``, ``hidden`` ``[S, hidden]``.
    """
    s = tokens.shape[0]
    prev = jnp.concatenate([jnp.zeros_like(hidden[:1]), hidden[:-1]])
    x = _layer_input(p, frozen["embed"], d, tokens[None], prev[None])
    _, k, v = _qkv(p, d, x, jnp.arange(s, dtype=jnp.int32)[None])
    first = (jnp.arange(s) > 0)[:, None, None]
    return jnp.where(first, k[0], 0.0), jnp.where(first, v[0], 0.0)


def decode_row(
    p: Params,
    frozen: Params,
    d: HeadDims,
    token: jax.Array,
    position: jax.Array,
    hidden: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    present: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One row of the head as a draft step of the engine runs it, over a KV cache.

    The cache is indexed by position: ``keys`` and ``values`` ``[S, kv_heads, head_dim]``
    hold the row at position ``q`` in slot ``q``, and ``present`` ``[S]`` marks the slots
    that hold a row. The row pairs ``token`` with ``hidden`` ``[hidden]`` at ``position``
    (scalars), writes its key and value into slot ``position``, and attends to the present
    rows before it and to itself. Returns the draft-vocabulary logits, the layer's output
    hidden (the next draft step's hidden) and the updated keys and values.
    """
    x = _layer_input(p, frozen["embed"], d, token[None, None], hidden[None, None])
    q, k, v = _qkv(p, d, x, position[None, None])
    keys = keys.at[position].set(k[0, 0])
    values = values.at[position].set(v[0, 0])
    slots = jnp.arange(keys.shape[0])
    seen = (present | (slots == position)) & (slots <= position)
    scale = 1.0 / float(np.sqrt(d.head_dim))
    scores = jnp.einsum("kgd,skd->kgs", q[0, 0], keys) * scale
    probs = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
    attn = jnp.einsum("kgs,skd->kgd", probs, values).reshape(1, 1, d.heads * d.head_dim)
    x = _layer_output(p, d, x, attn)
    logits = _rms_norm(x, p["shared_head.norm"], d.eps) @ frozen["lm_head"].T
    return logits[0, 0], x[0, 0], keys, values


def target_log_probs(frozen: Params, d: HeadDims, hidden: jax.Array) -> jax.Array:
    """The target's log-distribution over the draft vocabulary, from its hidden states.

    Through its frozen final norm and LM head, renormalised over the draft vocabulary.
    """
    logits = _rms_norm(hidden, frozen["target_norm"], d.eps) @ frozen["lm_head"].T
    return jax.nn.log_softmax(logits, axis=-1)


def rows_from_window(tokens: jax.Array, steps: int) -> jax.Array:
    """A ``[B, W]`` array as the rows of each draft step, ``[steps, B, W - 1]``.

    Step ``j`` of row ``i`` reads element ``i + 1 + j`` (zero past the end).
    """
    w = tokens.shape[1]
    padded = jnp.concatenate([tokens, jnp.zeros_like(tokens[:, : steps + 1])], axis=1)
    return jnp.stack([padded[:, 1 + j : w + j] for j in range(steps)])


def unroll_loss(
    p: Params,
    frozen: Params,
    d: HeadDims,
    tokens: jax.Array,
    hidden: jax.Array,
    valid: jax.Array,
    start: jax.Array,
    steps: int,
) -> tuple[jax.Array, jax.Array]:
    """Forward KL from the target to the head, summed over steps with weight ``0.8 ** j``.

    A batch is ``B`` windows of ``W`` consecutive tokens from the start of a sequence:
    ``tokens`` ``[B, W]``, the target hiddens at them ``[B, W, hidden]``, ``valid``
    ``[B, W]`` (0 on padding) and ``start`` ``[B]``, each sequence's reply start (the
    position of the reply's first token).

    Row ``i`` is the chain the engine drafts from base position ``p = i + 1`` (the last
    verified token): step 0 pairs token ``p`` with hidden ``p - 1``, and step ``j`` learns
    the target's distribution at ``p + j``, its prediction of the token at ``p + 1 + j``.
    The term of step ``j`` at row ``i`` counts where ``p >= start`` and position ``p + j``
    is valid. So the head learns on the reply only, and only chains the engine runs: it
    drafts from the reply's first token on (the target itself produces that token), so every
    token a counted chain predicts, ``p + 1 .. p + steps``, is a reply token. Rows still
    attend to the prompt's rows, as the head does in use; the prompt's own terms (chains
    based in the prompt) are left out. Returns the weighted loss and the per-step mean KL
    ``[steps]`` over the counted terms.
    """
    w = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), tokens.shape)
    tgt = jax.lax.stop_gradient(target_log_probs(frozen, d, hidden[:, 1:]))  # [B, W-1, V]
    tgt = jnp.concatenate([tgt, jnp.zeros_like(tgt[:, :steps])], axis=1)
    logits = unroll(
        p,
        frozen,
        d,
        rows_from_window(tokens, steps),
        rows_from_window(positions, steps),
        hidden[:, : w - 1],
        steps,
    )
    base = jnp.arange(1, w, dtype=jnp.int32)[None, :] >= start.astype(jnp.int32)[:, None]
    mask = rows_from_window(valid.astype(jnp.float32), steps) * base.astype(jnp.float32)
    per_step = []
    for j, lg in enumerate(logits):
        t = tgt[:, j : j + w - 1]
        kl = jnp.sum(jnp.exp(t) * (t - jax.nn.log_softmax(lg, axis=-1)), axis=-1)
        per_step.append(jnp.sum(kl * mask[j]) / jnp.maximum(jnp.sum(mask[j]), 1.0))
    kls = jnp.stack(per_step)
    weights = jnp.asarray([STEP_DECAY**j for j in range(steps)], jnp.float32)
    return jnp.sum(weights * kls), kls
