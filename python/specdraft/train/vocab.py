"""Choosing the draft vocabulary, and how often the target's choice falls inside it.

The MTP head drafts over the first ``mtp_vocab_size`` ids only (the LM head's first rows);
byte-level BPE vocabularies are ordered roughly by merge frequency, which is what makes a
prefix work. The EAGLE-3 head drafts over any set of ids (its ``d2t`` maps each draft id to
a target id), and takes the ids the target chooses most often (:func:`top_choices`). A
position whose target choice lies outside the draft vocabulary can never be accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.cache import HiddenCache, from_bf16_bits

__all__ = ["coverage_of", "heldout_choices", "target_choices", "top_choices", "vocab_coverage"]


@jax.jit
def _argmax_rows(hidden: jax.Array, norm: jax.Array, lm_head: jax.Array, eps: float) -> jax.Array:
    x = hidden * jax.lax.rsqrt(jnp.mean(hidden * hidden, axis=-1, keepdims=True) + eps) * norm
    return jnp.argmax(x @ lm_head.T, axis=-1)


def target_choices(
    cache: HiddenCache,
    frozen_full: Any,  # noqa: ANN401 - dict with "target_norm" and the full "lm_head"
    eps: float,
    limit: int,
    chunk: int = 256,
    replies_only: bool = False,
) -> np.ndarray:
    """The target's greedy choice after each of the first ``limit`` training positions.

    Over the whole vocabulary, from the cached final hiddens. With ``replies_only`` only
    the positions a reply's drafts learn from count: each sequence's ``start .. length - 1``
    (the target's choices there are the tokens its drafts predict).
    """
    seqs = cache.split("train")
    _, hiddens = cache.open_arrays()
    first = (lambda s: s.offset + s.start) if replies_only else (lambda s: s.offset)
    rows = np.concatenate(
        [np.arange(first(s), s.offset + s.length) for s in seqs] or [np.zeros(0, np.int64)]
    )[:limit]
    out = []
    for i in range(0, len(rows), chunk):
        h = from_bf16_bits(hiddens[rows[i : i + chunk], cache.width - cache.hidden :])
        out.append(
            np.asarray(_argmax_rows(h, frozen_full["target_norm"], frozen_full["lm_head"], eps))
        )
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def heldout_choices(cache: HiddenCache) -> np.ndarray:
    """The target's greedy choices on the held-out text.

    They are each evaluation sequence's tokens after its prompt (its greedy continuation),
    so no LM head is run.
    """
    tokens, _ = cache.open_arrays()
    seqs = cache.split("eval")
    parts = [np.asarray(tokens[s.offset + s.start : s.offset + s.length]) for s in seqs]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def top_choices(choices: np.ndarray, n: int, vocab: int) -> np.ndarray:
    """The ``n`` ids ``choices`` holds most often, sorted ascending (int64).

    Ties, the ids never chosen among them, go to the lower id (the BPE order), so a sample
    too small to rank ``n`` ids fills the rest with the first ids.
    """
    if not 1 <= n <= vocab:
        raise ValueError(f"a draft vocabulary of {n} ids from a vocabulary of {vocab}")
    counts = np.bincount(np.asarray(choices, np.int64), minlength=vocab)[:vocab]
    order = np.lexsort((np.arange(vocab), -counts))
    return np.sort(order[:n]).astype(np.int64)


def coverage_of(choices: np.ndarray, ids: np.ndarray) -> float:
    """The fraction of ``choices`` that are among ``ids``."""
    if len(choices) == 0:
        return 0.0
    return float(np.mean(np.isin(choices, ids)))


def vocab_coverage(choices: np.ndarray, sizes: Sequence[int]) -> dict[int, float]:
    """For each ``N``, the fraction of ``choices`` below ``N``."""
    if len(choices) == 0:
        return {int(n): 0.0 for n in sizes}
    return {int(n): float(np.mean(choices < n)) for n in sizes}
