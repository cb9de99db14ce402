"""The training-time-test unroll, its loss and the engine's one-row draft step, for any head.

A head is one decoder layer (:mod:`specdraft.train.layer`) whose row input and logits are
its own (a :class:`~specdraft.train.layer.RowForward`: the MTP head's,
:data:`specdraft.train.mtp.MTP_ROWS`, is the default; EAGLE-3's is
:data:`specdraft.train.eagle3.EAGLE3_ROWS`). RoPE is rotate-half at the position of the
row's token. The pairing is DeepSeek-V3's: the row at position ``p`` holds the token at
``p`` and the target hidden computed at ``p - 1``, and predicts the token at ``p + 1``. A
draft after the first feeds the layer's output (before the final norm) back as the hidden,
with the previous draft as the token, at the next position.

Training unrolls ``steps`` drafts for every row of a sequence at once. Step 0's keys and
values are those of the target-hidden rows (what ``prefill_drafter`` and ``catchup`` write);
step ``j`` at base row ``i`` attends to step 0's rows ``0..=i`` and to its own chain's
rows of steps ``1..=j`` at that same base row: exactly the rows the head's KV cache holds
when it drafts its ``j``-th token after position ``i`` (EAGLE-3's training-time test).

``frozen`` holds the target's ``embed`` ``[vocab, hidden]``, its ``target_norm`` and its
LM-head rows of the draft vocabulary ``lm_head`` ``[draft_vocab, hidden]`` (the teacher's
output, and the MTP head's), and optionally ``draft_ids`` ``[draft_vocab]``: the target id
of each draft id (absent: draft id ``i`` is target id ``i``). A cached row's last
``hidden`` columns are the target's final hidden before its final norm, the teacher.

``param_shapes`` and ``init_params`` here are the MTP head's (:mod:`specdraft.train.mtp`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.layer import (
    HeadDims,
    Params,
    RowForward,
    head_dims,
    layer_output,
    project_qkv,
    rms_norm,
)
from specdraft.train.mtp import MTP_ROWS, init_params, param_shapes

__all__ = [
    "STEP_DECAY",
    "HeadDims",
    "decode_row",
    "draft_tokens",
    "head_dims",
    "init_params",
    "param_shapes",
    "rows_from_window",
    "target_log_probs",
    "target_row_kv",
    "teacher_hidden",
    "unroll",
    "unroll_loss",
]

#: The loss weight of draft step ``j`` is ``STEP_DECAY ** j`` (EAGLE-3, SpecForge).
STEP_DECAY = 0.8


def draft_tokens(frozen: Params, logits: jax.Array, dtype: jnp.dtype = jnp.int32) -> jax.Array:
    """The greedy drafts of ``logits`` over the draft vocabulary, as target ids."""
    best = jnp.argmax(logits, axis=-1)
    ids = frozen.get("draft_ids")
    return (best if ids is None else ids[best]).astype(dtype)


def teacher_hidden(d: HeadDims, rows: jax.Array) -> jax.Array:
    """The target's final hidden of cached rows: their last ``hidden`` columns."""
    return rows[..., rows.shape[-1] - d.hidden :]


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


def unroll(
    p: Params,
    frozen: Params,
    d: HeadDims,
    tokens: jax.Array,
    positions: jax.Array,
    hidden: jax.Array,
    steps: int,
    feed_drafts: bool = False,
    rows: RowForward = MTP_ROWS,
) -> list[jax.Array]:
    """Draft logits ``[B, T, draft_vocab]`` for steps ``0..steps`` at every row.

    ``tokens`` and ``positions`` are ``[steps, B, T]``: row ``i`` of step ``j`` feeds
    ``tokens[j, :, i]`` at ``positions[j, :, i]``. ``hidden`` ``[B, T, W]`` holds the cached
    rows each row's step 0 pairs with (``rows.first_hidden`` makes them its hidden). With
    ``feed_drafts`` the steps after the first feed the previous step's greedy draft instead
    of ``tokens[j]`` (as the engine does).
    """
    chain_k: list[jax.Array] = []
    chain_v: list[jax.Array] = []
    out: list[jax.Array] = []
    k0 = v0 = None
    hidden = rows.first_hidden(p, hidden)
    for j in range(steps):
        tok = tokens[j]
        if feed_drafts and j > 0:
            tok = draft_tokens(frozen, out[-1], tokens.dtype)
        x, a = rows.layer_input(p, frozen, d, tok, hidden)
        q, k, v = project_qkv(p, d, a, positions[j])
        if j == 0:
            k0, v0 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        x = layer_output(p, d, x, _attend(d, q, k0, v0, chain_k, chain_v))
        out.append(rows.logits(p, frozen, d, x))
        hidden = x
    return out


def target_row_kv(
    p: Params,
    frozen: Params,
    d: HeadDims,
    tokens: jax.Array,
    hidden: jax.Array,
    rows: RowForward = MTP_ROWS,
) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[S, kv_heads, head_dim]`` of the target-hidden rows of a sequence.

    Row ``q`` pairs token ``q`` with cached row ``q - 1`` at position ``q`` (what
    ``prefill_drafter``, a propose's first row and ``catchup`` write); row 0 has no hidden
    before it and is zeros. ``tokens`` ``[S]``, ``hidden`` ``[S, W]`` cached rows.
    """
    s = tokens.shape[0]
    prev = jnp.concatenate([jnp.zeros_like(hidden[:1]), hidden[:-1]])
    x, a = rows.layer_input(p, frozen, d, tokens[None], rows.first_hidden(p, prev[None]))
    _, k, v = project_qkv(p, d, a, jnp.arange(s, dtype=jnp.int32)[None])
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
    rows: RowForward = MTP_ROWS,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One row of the head as a draft step of the engine runs it, over a KV cache.

    The cache is indexed by position: ``keys`` and ``values`` ``[S, kv_heads, head_dim]``
    hold the row at position ``q`` in slot ``q``, and ``present`` ``[S]`` marks the slots
    that hold a row. The row pairs ``token`` with ``hidden`` ``[hidden]`` (already the
    head's hidden: ``rows.first_hidden`` of a cached row, or a previous step's output) at
    ``position`` (scalars), writes its key and value into slot ``position``, and attends to
    the present rows before it and to itself. Returns the draft-vocabulary logits, the
    layer's output hidden (the next draft step's hidden) and the updated keys and values.
    """
    x, a = rows.layer_input(p, frozen, d, token[None, None], hidden[None, None])
    q, k, v = project_qkv(p, d, a, position[None, None])
    keys = keys.at[position].set(k[0, 0])
    values = values.at[position].set(v[0, 0])
    slots = jnp.arange(keys.shape[0])
    seen = (present | (slots == position)) & (slots <= position)
    scale = 1.0 / float(np.sqrt(d.head_dim))
    scores = jnp.einsum("kgd,skd->kgs", q[0, 0], keys) * scale
    probs = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
    attn = jnp.einsum("kgs,skd->kgd", probs, values).reshape(1, 1, d.heads * d.head_dim)
    x = layer_output(p, d, x, attn)
    return rows.logits(p, frozen, d, x)[0, 0], x[0, 0], keys, values


def target_log_probs(frozen: Params, d: HeadDims, hidden: jax.Array) -> jax.Array:
    """The target's log-distribution over the draft vocabulary, from its final hiddens.

    Through its frozen final norm and LM head, renormalised over the draft vocabulary.
    """
    logits = rms_norm(hidden, frozen["target_norm"], d.eps) @ frozen["lm_head"].T
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
    rows: RowForward = MTP_ROWS,
) -> tuple[jax.Array, jax.Array]:
    """Forward KL from the target to the head, summed over steps with weight ``0.8 ** j``.

    A batch is ``B`` windows of ``W`` consecutive tokens from the start of a sequence:
    ``tokens`` ``[B, W]``, the cached rows at them ``[B, W, row width]``, ``valid``
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
    teacher = teacher_hidden(d, hidden[:, 1:])
    tgt = jax.lax.stop_gradient(target_log_probs(frozen, d, teacher))  # [B, W-1, V]
    tgt = jnp.concatenate([tgt, jnp.zeros_like(tgt[:, :steps])], axis=1)
    logits = unroll(
        p,
        frozen,
        d,
        rows_from_window(tokens, steps),
        rows_from_window(positions, steps),
        hidden[:, : w - 1],
        steps,
        rows=rows,
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
