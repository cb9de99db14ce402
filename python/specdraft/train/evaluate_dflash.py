"""Greedy acceptance of a DFlash head on held-out text, as the engine's greedy verify counts it.

An evaluation sequence is a held-out prompt followed by the target's greedy continuation
(see :mod:`specdraft.train.evaluate`). At a base position ``p`` (the last committed token,
which the target picked) the head drafts ``block_size - 1`` tokens in one forward: the
block is the token at ``p`` and mask tokens, and its context every committed position
``0 .. p - 1``, each the target's own captured rows. Draft ``j`` is accepted while it and
every draft before it equal the token at ``p + 1 + j``, and a verify leaves room for the
target's own token (at most ``len - 2 - p`` drafts count), as
:func:`specdraft.train.evaluate.accepted_counts` counts.

Unlike a chain head, a block drafter keeps no rows of its own drafts: what it drafts at
``p`` depends on ``p`` alone, never on the verify steps before it. So the engine walk (from
the prompt's end, ``accepted + 1`` positions a verify) meets exactly the counts drafted at
the positions it lands on, and its exact-KV figures are the same walk.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jax
import numpy as np

from specdraft.train.cache import HiddenCache, from_bf16_bits
from specdraft.train.dflash import DFlashShape, draft_blocks
from specdraft.train.evaluate import WALK_WIDTH_STEP, Acceptance, accepted_counts, walk
from specdraft.train.layer import HeadDims

__all__ = ["acceptance_of", "drafts_at", "evaluate_dflash"]


@lru_cache(maxsize=4)
def _drafter(d: HeadDims, s: DFlashShape) -> Any:  # noqa: ANN401 - a jitted function
    def run(params, frozen, tokens, rows, anchors):  # noqa: ANN001, ANN202
        return draft_blocks(params, frozen, d, s, tokens, rows, anchors)

    return jax.jit(run)


def drafts_at(
    params: Any,  # noqa: ANN401 - the head's weights (a dict of arrays)
    frozen: Any,  # noqa: ANN401
    d: HeadDims,
    s: DFlashShape,
    seq: np.ndarray,
    rows: np.ndarray,
) -> np.ndarray:
    """The head's drafts after every position of one sequence: ``[block_size - 1, n - 1]``.

    Column ``p - 1`` holds the block drafted after base position ``p`` (as
    :func:`~specdraft.train.evaluate.accepted_counts` reads it). ``seq`` ``[n]`` and its
    cached rows ``[n, row width]``.
    """
    n = len(seq)
    width = -(-n // WALK_WIDTH_STEP) * WALK_WIDTH_STEP
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :n] = seq
    hid = np.zeros((1, width, rows.shape[1]), np.float32)
    hid[0, :n] = rows
    anchors = np.arange(width, dtype=np.int32)[None]
    drafts = np.asarray(_drafter(d, s)(params, frozen, tokens, hid, anchors))[0]  # [W, G-1]
    ids = frozen.get("draft_ids")
    if ids is not None:
        drafts = np.asarray(ids)[drafts]
    return drafts[1:n].T


def acceptance_of(counts: list[np.ndarray], k: int) -> Acceptance:
    """The figures of per-sequence accepted counts at each base position (module docs)."""
    result = Acceptance(k)
    allc = np.concatenate(counts) if counts else np.zeros(0, np.int64)
    result.rows = int(len(allc))
    if len(allc):
        result.by_position = [float(np.mean(allc >= j + 1)) for j in range(k)]
        result.mean_length = 1.0 + float(np.mean(allc))
    walked = [a for c in counts for a in walk(c)]
    result.verify_steps = result.exact_kv_verify_steps = len(walked)
    if walked:
        steps = np.asarray(walked)
        result.engine_mean_length = 1.0 + float(np.mean(steps))
        result.engine_by_position = [float(np.mean(steps >= j + 1)) for j in range(k)]
        result.exact_kv_mean_length = result.engine_mean_length
        result.exact_kv_by_position = list(result.engine_by_position)
    return result


def evaluate_dflash(
    params: Any,  # noqa: ANN401 - the head's weights (a dict of arrays)
    frozen: Any,  # noqa: ANN401
    d: HeadDims,
    s: DFlashShape,
    cache: HiddenCache,
) -> Acceptance:
    """Acceptance of the head over the cache's evaluation sequences (see the module docs)."""
    tokens_all, rows_all = cache.open_arrays()
    counts = []
    for seq_info in cache.split("eval"):
        lo, hi = seq_info.offset, seq_info.offset + seq_info.length
        seq = np.asarray(tokens_all[lo:hi], dtype=np.int32)
        rows = from_bf16_bits(rows_all[lo:hi])
        drafts = drafts_at(params, frozen, d, s, seq, rows)
        counts.append(accepted_counts(drafts, seq, seq_info.start))
    return acceptance_of(counts, s.drafts)
