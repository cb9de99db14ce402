"""Greedy chain acceptance of a head on held-out text, as the engine's greedy verify counts it.

An evaluation sequence is a held-out prompt followed by the target's own greedy
continuation, so every token after the prompt is the target's choice. At a base position
``p`` (the position of the last accepted token) the head drafts ``k`` tokens, each fed back
as the next step's token, and draft ``j`` is accepted while it and all before it equal the
token at ``p + 1 + j``. Three summaries:

- *by position*: over every base position in the continuation, the fraction whose first
  ``j + 1`` drafts are accepted, and the mean acceptance length ``1 + E[accepted]``
  (accepted drafts plus the target's own token), with the head's KV holding target-hidden
  rows for every earlier position;
- *engine walk*: what the engine measures with its default levers. It starts at the
  prompt's end and jumps ``accepted + 1`` positions after each verify, drafting
  ``min(k, len - 2 - p)`` tokens (room for the target's own token), and the head's KV
  holds what the engine's holds: target-hidden rows for the prompt (``prefill_drafter``)
  and for each verify's base token (a propose's first row), and for each accepted draft
  the row written while drafting it, from the head's own output hidden (``after_verify``
  keeps the accepted drafts' rows and nothing rewrites them); when every draft of a verify
  is accepted, the last one has no row (nothing was fed through it). Its mean acceptance
  length and acceptance by position (the fraction of verify steps whose first ``j + 1``
  drafts are accepted) are the engine's figures;
- *exact-KV engine walk*: the same walk with ``SPECDRAFT_MTP_KV_EXACT`` on, where
  ``catchup_batch`` rewrites the accepted drafts' rows from the target's hiddens, so the
  KV holds target-hidden rows for every earlier position, as *by position* assumes.

The head is evaluated in float32 (the caller passes the weights it writes, rounded to
BF16); the engine rounds activations and its KV to BF16, so a draft picked at a near-tie of
two logits can differ between them. Any head runs here through its row forward (``rows``,
the MTP head's by default; see :mod:`specdraft.train.head`), and its drafts are compared as
target ids (``frozen["draft_ids"]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.cache import HiddenCache, from_bf16_bits
from specdraft.train.head import (
    HeadDims,
    decode_row,
    draft_tokens,
    rows_from_window,
    target_row_kv,
    unroll,
)
from specdraft.train.layer import RowForward
from specdraft.train.mtp import MTP_ROWS

__all__ = ["Acceptance", "Walk", "accepted_counts", "engine_walk", "evaluate", "walk"]

#: The engine walk's KV width is a multiple of this (one compile per width).
WALK_WIDTH_STEP = 64


@dataclass
class Acceptance:
    """Acceptance figures for ``k`` drafts (see the module docs)."""

    k: int
    by_position: list[float] = field(default_factory=list)
    mean_length: float = 0.0
    engine_mean_length: float = 0.0
    engine_by_position: list[float] = field(default_factory=list)
    rows: int = 0
    verify_steps: int = 0
    exact_kv_mean_length: float = 0.0
    exact_kv_by_position: list[float] = field(default_factory=list)
    exact_kv_verify_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "drafts": self.k,
            "acceptance_by_position": [round(x, 4) for x in self.by_position],
            "mean_acceptance_length": round(self.mean_length, 4),
            "engine_mean_acceptance_length": round(self.engine_mean_length, 4),
            "engine_acceptance_by_position": [round(x, 4) for x in self.engine_by_position],
            "base_positions": self.rows,
            "engine_verify_steps": self.verify_steps,
            "exact_kv_engine_mean_acceptance_length": round(self.exact_kv_mean_length, 4),
            "exact_kv_engine_acceptance_by_position": [
                round(x, 4) for x in self.exact_kv_by_position
            ],
            "exact_kv_engine_verify_steps": self.exact_kv_verify_steps,
        }

    def describe(self) -> str:
        """One human-readable line."""
        pos = ", ".join(f"{x:.1%}" for x in self.by_position)
        return (
            f"acceptance by position [{pos}], mean acceptance length {self.mean_length:.3f} "
            f"({self.rows} positions), engine walk {self.engine_mean_length:.3f} "
            f"({self.verify_steps} verify steps; {self.exact_kv_mean_length:.3f} with exact "
            f"KV), at {self.k} drafts"
        )


def accepted_counts(drafts: np.ndarray, seq: np.ndarray, start: int) -> np.ndarray:
    """Accepted drafts at each base position ``p`` in ``start .. len(seq) - 1``.

    ``drafts[j, p - 1]`` is draft ``j`` drafted after position ``p``; it is accepted while
    it and all drafts before it equal ``seq[p + 1 + j]``. As the engine's draft budget at
    ``max_tokens`` does, a verify leaves room for the target's own token: at most
    ``len(seq) - 2 - p`` drafts count.
    """
    k = drafts.shape[0]
    n = len(seq)
    out = []
    for p in range(start, n - 1):
        a = 0
        while a < k and p + 2 + a < n and int(drafts[a, p - 1]) == int(seq[p + 1 + a]):
            a += 1
        out.append(a)
    return np.asarray(out, dtype=np.int64)


def walk(counts: np.ndarray) -> list[int]:
    """The accepted counts the engine meets, one per verify.

    From the first base position, each verify moves ``accepted + 1`` positions on.
    """
    seen, i = [], 0
    while i < len(counts):
        seen.append(int(counts[i]))
        i += int(counts[i]) + 1
    return seen


@lru_cache(maxsize=8)
def _walk_fns(d: HeadDims, k: int, rows: RowForward) -> tuple[Any, Any]:
    """The engine walk's jitted parts: the target rows' KV, and one propose of ``k`` drafts."""

    def propose(params, frozen, keys, values, present, token, row, base):  # noqa: ANN001, ANN202
        drafts, margins = [], []
        hidden = rows.first_hidden(params, row)
        for j in range(k):
            logits, hidden, keys, values = decode_row(
                params, frozen, d, token, base + j, hidden, keys, values, present, rows
            )
            present = present.at[base + j].set(True)
            token = draft_tokens(frozen, logits)
            top = jax.lax.top_k(logits, 2)[0]
            drafts.append(token)
            margins.append(top[0] - top[1])
        return jnp.stack(drafts), jnp.stack(margins), keys, values

    def row_kv(params, frozen, tokens, hidden):  # noqa: ANN001, ANN202
        return target_row_kv(params, frozen, d, tokens, hidden, rows)

    return jax.jit(row_kv), jax.jit(propose)


class Walk(NamedTuple):
    """The verify steps of an engine walk over one sequence."""

    #: Drafts accepted at each verify step.
    accepted: list[int]
    #: At each verify step, the smallest gap between the head's two highest logits among
    #: the drafts that decided its count (those up to the first rejected one); ``inf`` where
    #: nothing was drafted. A small gap is a near-tie that rounding can decide either way.
    margins: list[float]


def engine_walk(
    params: Any,  # noqa: ANN401 - the head's weights (a dict of arrays)
    frozen: Any,  # noqa: ANN401
    d: HeadDims,
    seq: np.ndarray,
    hiddens: np.ndarray,
    start: int,
    k: int,
    exact_kv: bool = False,
    rows: RowForward = MTP_ROWS,
) -> Walk:
    """The verify steps the engine runs over one evaluation sequence, greedy, ``k`` drafts.

    ``seq`` ``[n]`` is the prompt (``start`` ids) and the target's greedy continuation,
    ``hiddens`` ``[n, row width]`` the cached rows at them. The head's KV is the default
    engine's, or with ``exact_kv`` the one ``mtp_kv_exact`` keeps (see the module docs).
    """
    n = len(seq)
    if start < 1 or n - 2 < start:
        return Walk([], [])
    width = -(-(n + k) // WALK_WIDTH_STEP) * WALK_WIDTH_STEP
    tokens = np.zeros(width, np.int32)
    tokens[:n] = seq
    hid = np.zeros((width, hiddens.shape[1]), np.float32)
    hid[:n] = hiddens
    rows_fn, propose = _walk_fns(d, k, rows)
    target_k, target_v = (np.asarray(x) for x in rows_fn(params, frozen, tokens, hid))
    keys, values = target_k.copy(), target_v.copy()
    present = np.zeros(width, bool)
    present[1:start] = True  # prefill_drafter: rows 1 .. P-1
    counts: list[int] = []
    gaps: list[float] = []
    p = start
    while p <= n - 2:
        budget = min(k, n - 2 - p)
        drafts, margins, new_k, new_v = propose(
            params, frozen, keys, values, present, np.int32(seq[p]), hid[p - 1], np.int32(p)
        )
        drafts = np.asarray(drafts)
        a = 0
        while a < budget and int(drafts[a]) == int(seq[p + 1 + a]):
            a += 1
        counts.append(a)
        deciding = np.asarray(margins)[: min(a + 1, budget)]
        gaps.append(float(deciding.min()) if len(deciding) else float("inf"))
        # after_verify keeps the base row and the accepted drafts' rows, of those written
        # (a propose of no drafts still writes its base row).
        kept = min(a + 1, max(budget, 1))
        keys[p : p + kept] = np.asarray(new_k)[p : p + kept]
        values[p : p + kept] = np.asarray(new_v)[p : p + kept]
        present[p : p + kept] = True
        if exact_kv:
            # catchup_batch: the accepted drafts' rows from the target's hiddens.
            keys[p + 1 : p + 1 + a] = target_k[p + 1 : p + 1 + a]
            values[p + 1 : p + 1 + a] = target_v[p + 1 : p + 1 + a]
            present[p + 1 : p + 1 + a] = True
        p += a + 1
    return Walk(counts, gaps)


def _drafts_fn(d: HeadDims, steps: int, rows: RowForward) -> Any:  # noqa: ANN401 - jitted
    def draft(params: Any, frozen: Any, tokens: jax.Array, hidden: jax.Array) -> jax.Array:  # noqa: ANN401
        w = tokens.shape[1]
        positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), tokens.shape)
        logits = unroll(
            params,
            frozen,
            d,
            rows_from_window(tokens, steps),
            rows_from_window(positions, steps),
            hidden[:, : w - 1],
            steps,
            feed_drafts=True,
            rows=rows,
        )
        return jnp.stack([draft_tokens(frozen, lg) for lg in logits])  # [steps, 1, W-1]

    return jax.jit(draft)


def evaluate(
    params: Any,  # noqa: ANN401 - the head's weights (a dict of arrays)
    frozen: Any,  # noqa: ANN401
    d: HeadDims,
    cache: HiddenCache,
    k: int,
    rows: RowForward = MTP_ROWS,
) -> Acceptance:
    """Acceptance of the head over the cache's evaluation sequences (see the module docs)."""
    seqs = cache.split("eval")
    result = Acceptance(k)
    if not seqs:
        return result
    tokens_all, hiddens_all = cache.open_arrays()
    width = max(s.length for s in seqs)
    draft = _drafts_fn(d, k, rows)
    counts: list[np.ndarray] = []
    walked: list[int] = []
    exact: list[int] = []
    for s in seqs:
        seq = np.asarray(tokens_all[s.offset : s.offset + s.length], dtype=np.int32)
        tok = np.zeros((1, width), np.int32)
        tok[0, : s.length] = seq
        hid = np.zeros((1, width, cache.width), np.float32)
        hid[0, : s.length] = from_bf16_bits(hiddens_all[s.offset : s.offset + s.length])
        drafts = np.asarray(draft(params, frozen, jnp.asarray(tok), jnp.asarray(hid)))[:, 0]
        c = accepted_counts(drafts, seq, s.start)
        counts.append(c)
        exact.extend(walk(c))
        one = engine_walk(params, frozen, d, seq, hid[0, : s.length], s.start, k, rows=rows)
        walked.extend(one.accepted)
    allc = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    result.rows = int(len(allc))
    if len(allc):
        result.by_position = [float(np.mean(allc >= j + 1)) for j in range(k)]
        result.mean_length = 1.0 + float(np.mean(allc))
    result.verify_steps = len(walked)
    if walked:
        steps = np.asarray(walked)
        result.engine_mean_length = 1.0 + float(np.mean(steps))
        result.engine_by_position = [float(np.mean(steps >= j + 1)) for j in range(k)]
    result.exact_kv_verify_steps = len(exact)
    if exact:
        steps = np.asarray(exact)
        result.exact_kv_mean_length = 1.0 + float(np.mean(steps))
        result.exact_kv_by_position = [float(np.mean(steps >= j + 1)) for j in range(k)]
    return result
