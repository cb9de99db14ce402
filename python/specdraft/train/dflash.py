"""The DFlash block drafter's weights, its block forward and its training loss.

As published (Chen, Liang and Liu, arXiv 2602.06036) and as z-lab's ``dflash/model.py`` runs
it. The context feature of a committed position ``q`` is

    ctx[q] = hidden_norm(fc(c[q]))     c[q]: the target's hiddens at q, captured at the
                                       layers ``target_layer_ids`` (their outputs), side by side

and a block anchored at position ``a`` is the token at ``a`` followed by ``block_size - 1``
mask tokens, at positions ``a .. a + block_size - 1``, embedded with the target's (frozen)
embedding. Each of the ``layers`` draft decoder layers (the target's shape, with Qwen3's
per-head RMSNorm of queries and keys)::

    h = input_layernorm(x)                                   x: the block's rows
    q = rope(q_norm(q_proj(h)))                              queries: the block's rows only
    k = [rope(k_norm(k_proj(ctx[0..a-1]))) ; rope(k_norm(k_proj(h)))]   same ctx every layer,
    v = [v_proj(ctx[0..a-1]) ; v_proj(h)]                               no layernorm on it
    x = x + o_proj(attention(q, k, v))       the context before the anchor, the whole block
    x = x + mlp(post_attention_layernorm(x))                            (not causal inside it)

then ``norm`` and the target's LM head (frozen, shared). Block row ``j`` (``1 .. block_size -
1``) drafts the token at ``a + j``; row 0 holds the anchor, which is known.

Training (the paper's recipe, as SpecForge implements it): several blocks per sequence in
one forward, anchored at random reply positions, each seeing only the context before its
anchor and its own block; cross-entropy on the target's greedy token at ``a + j`` (from its
final hidden at ``a + j - 1``, the cache row's last ``hidden`` columns, through its frozen
final norm and LM head, over the draft vocabulary), row ``j`` weighted ``exp(-(j - 1) /
decay)`` (an early error voids every later draft of the block).

Invariants: the weights are a flat dict named as the checkpoint names them, without
``.weight`` (``layers.{i}.self_attn.q_proj``, ``fc``, ...); every function is pure JAX over
float32; the draft vocabulary is the target's first ids (``frozen["lm_head"]`` holds those
rows), so a draft id is its target id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.layer import HeadDims, Params, _rope, rms_norm
from specdraft.train.mtp import fresh_weights

__all__ = [
    "DFlashShape",
    "LAYER_PARTS",
    "block_hidden",
    "block_logits",
    "block_mask_keys",
    "context_features",
    "default_loss_decay",
    "dflash_loss",
    "draft_blocks",
    "init_params",
    "param_shapes",
    "sample_anchors",
    "target_layer_ids",
]

#: A draft decoder layer's weights, stored as ``layers.{i}.{part}.weight``.
LAYER_PARTS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

#: The paper's loss decay for its block sizes (16: 7, 10: 5, 8: 4); other sizes take half
#: the block size.
_PAPER_DECAY = {16: 7.0, 10: 5.0, 8: 4.0}

#: Salt of the anchors' random stream (see :func:`sample_anchors`).
_ANCHOR_SALT = 0x0DF1A54


@dataclass(frozen=True)
class DFlashShape:
    """What a DFlash head is beyond one decoder layer's sizes (hashable, for jit)."""

    #: The target layers whose outputs ``fc`` fuses (z-lab's ``target_layer_ids``).
    target_layer_ids: tuple[int, ...]
    #: Draft decoder layers.
    layers: int
    #: Rows of a block: the anchor and ``block_size - 1`` drafts.
    block_size: int
    #: The token id of a block's rows after the anchor.
    mask_token_id: int
    #: Row ``j``'s loss weight is ``exp(-(j - 1) / loss_decay)``.
    loss_decay: float

    @property
    def taps(self) -> int:
        """How many target layers a context feature fuses."""
        return len(self.target_layer_ids)

    @property
    def drafts(self) -> int:
        """Tokens a block drafts."""
        return self.block_size - 1


def default_loss_decay(block_size: int) -> float:
    """The paper's decay for ``block_size`` (half the block for sizes it does not give)."""
    return _PAPER_DECAY.get(block_size, block_size / 2.0)


def target_layer_ids(
    num_hidden_layers: int, draft_layers: int, given: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The target layers a DFlash head fuses: their outputs (z-lab's convention).

    ``given`` as stated; else EAGLE-3's captured layers ``(1, L // 2 - 1, L - 4)`` (the
    outputs feeding vLLM's default aux layers), so that the two heads share one cache; else,
    where those are not distinct, z-lab's ``build_target_layer_ids`` (``draft_layers`` taps
    spread over ``1 .. L - 3``). Each id must be in ``0 .. L - 2`` (the last layer's output
    is the final hidden, cached as the teacher) and the ids distinct.

    Raises ``ValueError`` naming the ids and the target's layer count.
    """
    n = num_hidden_layers
    if given is not None:
        ids = tuple(given)
        source = "--aux-layers"
    else:
        ids = (1, n // 2 - 1, n - 4)
        source = "the default (1, L // 2 - 1, L - 4)"
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > n - 2:
            ids = _zlab_layer_ids(n, draft_layers)
            source = "z-lab's default spread over 1..L-3"
    if not ids:
        raise ValueError("the DFlash target layers are empty: name at least one layer")
    bad = [k for k in ids if not 0 <= k <= n - 2]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"DFlash target layers {list(ids)} ({source}) for a target of {n} layers: each "
            f"must be in 0..{n - 2} (the output of that layer; the last layer's is the final "
            "hidden) and none twice"
        )
    return ids


def _zlab_layer_ids(n: int, draft_layers: int) -> tuple[int, ...]:
    if draft_layers == 1:
        return (n // 2,)
    span = (n - 3) - 1
    return tuple(int(round(1 + i * span / (draft_layers - 1))) for i in range(draft_layers))


def param_shapes(d: HeadDims, s: DFlashShape) -> dict[str, tuple[int, ...]]:
    """The head's weights: checkpoint names (without ``.weight``) -> shape."""
    h, q, kv = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim
    layer = {
        "input_layernorm": (h,),
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "self_attn.q_norm": (d.head_dim,),
        "self_attn.k_norm": (d.head_dim,),
        "post_attention_layernorm": (h,),
        "mlp.gate_proj": (d.ffn, h),
        "mlp.up_proj": (d.ffn, h),
        "mlp.down_proj": (h, d.ffn),
    }
    out = {f"layers.{i}.{part}": shape for i in range(s.layers) for part, shape in layer.items()}
    out.update({"fc": (h, s.taps * h), "hidden_norm": (h,), "norm": (h,)})
    return out


def init_params(d: HeadDims, s: DFlashShape, seed: int) -> dict[str, np.ndarray]:
    """Fresh float32 weights from a fixed seed (norms at one, matrices normal, std 0.02)."""
    return fresh_weights(param_shapes(d, s), seed)


def context_features(p: Params, d: HeadDims, rows: jax.Array, taps: int) -> jax.Array:
    """``hidden_norm(fc(c))`` of cached rows ``[..., W]`` (their first ``taps`` hiddens)."""
    fused = rows[..., : taps * d.hidden] @ p["fc"].T
    return rms_norm(fused, p["hidden_norm"], d.eps)


def block_mask_keys(anchors: jax.Array, context: int) -> jax.Array:
    """Which context positions each block sees: ``[B, N, S]``, position ``< anchor``."""
    return jnp.arange(context)[None, None, :] < anchors[:, :, None]


def _keys(
    p: Params, pre: str, d: HeadDims, x: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Keys (normed per head, rotated) and values ``[B, T, kv_heads, head_dim]`` of ``x``."""
    shape = (*x.shape[:-1], d.kv_heads, d.head_dim)
    k = rms_norm(
        (x @ p[pre + "self_attn.k_proj"].T).reshape(shape), p[pre + "self_attn.k_norm"], d.eps
    )
    v = (x @ p[pre + "self_attn.v_proj"].T).reshape(shape)
    return _rope(k, positions, d), v


def _layer(
    p: Params,
    i: int,
    d: HeadDims,
    x: jax.Array,
    ctx: jax.Array,
    ctx_pos: jax.Array,
    blk_pos: jax.Array,
    seen: jax.Array,
) -> jax.Array:
    """Draft layer ``i`` over the blocks ``x`` ``[B, N, G, H]`` and the context ``ctx``.

    ``seen`` ``[B, N, S]`` marks the context positions each block attends to; every row of
    a block attends to every row of it.
    """
    pre = f"layers.{i}."
    b, n, g, _ = x.shape
    group = d.heads // d.kv_heads
    h = rms_norm(x, p[pre + "input_layernorm"], d.eps).reshape(b, n * g, -1)
    pos = blk_pos.reshape(b, n * g)
    q = (h @ p[pre + "self_attn.q_proj"].T).reshape(b, n * g, d.heads, d.head_dim)
    q = _rope(rms_norm(q, p[pre + "self_attn.q_norm"], d.eps), pos, d)
    q = q.reshape(b, n, g, d.kv_heads, group, d.head_dim)  # query head h reads KV h // group
    kb, vb = (y.reshape(b, n, g, d.kv_heads, d.head_dim) for y in _keys(p, pre, d, h, pos))
    # The context's keys and values: its features as they are, no input_layernorm.
    kc, vc = _keys(p, pre, d, ctx, ctx_pos)  # [B, S, kv_heads, head_dim]
    scale = 1.0 / math.sqrt(d.head_dim)
    s_ctx = jnp.einsum("bnikgd,bskd->bnkgis", q, kc) * scale
    s_ctx = jnp.where(seen[:, :, None, None, None, :], s_ctx, -jnp.inf)
    s_blk = jnp.einsum("bnikgd,bnjkd->bnkgij", q, kb) * scale
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    s = ctx.shape[1]
    out = jnp.einsum("bnkgis,bskd->bnikgd", probs[..., :s], vc)
    out = out + jnp.einsum("bnkgij,bnjkd->bnikgd", probs[..., s:], vb)
    x = x + out.reshape(b, n, g, d.heads * d.head_dim) @ p[pre + "self_attn.o_proj"].T
    m = rms_norm(x, p[pre + "post_attention_layernorm"], d.eps)
    mlp = jax.nn.silu(m @ p[pre + "mlp.gate_proj"].T) * (m @ p[pre + "mlp.up_proj"].T)
    return x + mlp @ p[pre + "mlp.down_proj"].T


def block_hidden(
    p: Params,
    frozen: Params,
    d: HeadDims,
    s: DFlashShape,
    tokens: jax.Array,
    rows: jax.Array,
    anchors: jax.Array,
) -> jax.Array:
    """The normed output ``[B, N, G, H]`` of blocks anchored at ``anchors`` ``[B, N]``.

    ``tokens`` ``[B, S]`` and the cached rows at them ``[B, S, W]`` are the sequences; block
    ``n`` of row ``b`` is ``tokens[b, anchors[b, n]]`` and mask tokens, at positions
    ``anchors[b, n] ..``, and sees the context at positions ``0 .. anchors[b, n] - 1``.
    """
    b, length = tokens.shape
    ctx = context_features(p, d, rows, s.taps)
    ctx_pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    offsets = jnp.arange(s.block_size, dtype=jnp.int32)
    blk_pos = anchors[:, :, None].astype(jnp.int32) + offsets
    first = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, length - 1), axis=1)
    blk_tok = jnp.where(offsets == 0, first[:, :, None], s.mask_token_id)
    x = frozen["embed"][blk_tok]
    seen = block_mask_keys(anchors, length)
    for i in range(s.layers):
        x = _layer(p, i, d, x, ctx, ctx_pos, blk_pos, seen)
    return rms_norm(x, p["norm"], d.eps)


def block_logits(frozen: Params, hidden: jax.Array) -> jax.Array:
    """Draft-vocabulary logits of the drafting rows (``1 ..``) of blocks' outputs."""
    return hidden[..., 1:, :] @ frozen["lm_head"].T


def sample_anchors(
    tokens: jax.Array, valid: jax.Array, start: jax.Array, blocks: int
) -> tuple[jax.Array, jax.Array]:
    """``blocks`` distinct anchors a row, drawn uniformly from its reply: ``[B, N]`` and keep.

    An anchor ``a`` is a position from the row's reply start (at least 1: the engine drafts
    from the reply's first token, with the prompt as context) whose next position is valid,
    so its block drafts at least one token. A row with fewer such positions than ``blocks``
    keeps them all (``keep`` marks the anchors drawn; the rest are 0).

    The draw is a function of the batch's tokens: the loss has no step or key, and a batch is
    a function of the seed and the step, so a resumed run draws the anchors the
    uninterrupted one drew, and a sequence met in another epoch (in another batch) gets
    others.
    """
    b, length = tokens.shape
    pos = jnp.arange(length, dtype=jnp.int32)
    nxt = jnp.concatenate([valid[:, 1:], jnp.zeros_like(valid[:, :1])], axis=1) > 0
    ok = (pos[None, :] >= jnp.maximum(start, 1)[:, None]) & nxt
    weights = pos.astype(jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    digest = jnp.sum(tokens.astype(jnp.uint32) * weights[None, :], dtype=jnp.uint32)
    key = jax.random.fold_in(jax.random.PRNGKey(_ANCHOR_SALT), digest)
    draw = jnp.where(ok, jax.random.uniform(key, (b, length)), 2.0)
    n = min(blocks, length)
    neg, idx = jax.lax.top_k(-draw, n)
    keep = -neg < 2.0
    return jnp.where(keep, idx, 0).astype(jnp.int32), keep


def _target_choices(frozen: Params, d: HeadDims, final: jax.Array) -> jax.Array:
    """The target's greedy draft-vocabulary id after each final hidden."""
    logits = rms_norm(final, frozen["target_norm"], d.eps) @ frozen["lm_head"].T
    return jnp.argmax(logits, axis=-1)


def dflash_loss(
    p: Params,
    frozen: Params,
    d: HeadDims,
    s: DFlashShape,
    tokens: jax.Array,
    rows: jax.Array,
    valid: jax.Array,
    start: jax.Array,
    blocks: int | None = None,
    anchors: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Weighted cross-entropy of a batch's blocks; returns it and the mean per block row.

    A batch is as :func:`specdraft.train.head.unroll_loss` takes it: ``tokens`` ``[B, S]``,
    the cached rows ``[B, S, W]`` (captured layers, then the final hidden), ``valid``
    ``[B, S]`` and each row's reply ``start`` ``[B]``. ``blocks`` anchors a row are drawn
    (:func:`sample_anchors`; default one block per ``block_size`` positions) unless
    ``anchors`` (and their keep mask) are given. Row ``j`` of a block at ``a`` learns the
    target's greedy choice at ``a + j`` where that position is valid; the loss is the mean
    over those terms, each weighted ``exp(-(j - 1) / loss_decay)``. The second value is the
    plain mean cross-entropy of each drafting row ``[block_size - 1]``.
    """
    length = tokens.shape[1]
    if anchors is None:
        n = blocks if blocks is not None else max(length // s.block_size, 1)
        anchors = sample_anchors(tokens, valid, start, n)
    at, keep = anchors
    hidden = block_hidden(p, frozen, d, s, tokens, rows, at)
    logp = jax.nn.log_softmax(block_logits(frozen, hidden), axis=-1)  # [B, N, G-1, V]
    j = jnp.arange(1, s.block_size, dtype=jnp.int32)
    label_pos = at[:, :, None] + j  # [B, N, G-1]
    inside = label_pos < length
    safe = jnp.clip(label_pos, 0, length - 1)
    final = rows[..., rows.shape[-1] - d.hidden :]
    # The target's choice at a + j comes from its final hidden at a + j - 1 (>= a >= 0).
    teacher = jax.vmap(lambda f, ix: f[ix])(final, safe - 1)  # [B, N, G-1, H]
    labels = jax.lax.stop_gradient(_target_choices(frozen, d, teacher))
    there = jax.vmap(lambda v, ix: v[ix])(valid, safe) > 0
    counted = (keep[:, :, None] & inside & there).astype(jnp.float32)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    weight = jnp.exp(-(j - 1).astype(jnp.float32) / s.loss_decay)
    per_row = jnp.sum(ce * counted, axis=(0, 1)) / jnp.maximum(jnp.sum(counted, axis=(0, 1)), 1.0)
    w = counted * weight
    loss = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-6)
    return loss, per_row


def draft_blocks(
    p: Params,
    frozen: Params,
    d: HeadDims,
    s: DFlashShape,
    tokens: jax.Array,
    rows: jax.Array,
    anchors: jax.Array,
) -> jax.Array:
    """The greedy drafts ``[B, N, block_size - 1]`` of blocks anchored at ``anchors``."""
    return jnp.argmax(
        block_logits(frozen, block_hidden(p, frozen, d, s, tokens, rows, anchors)), axis=-1
    )
