"""Choosing the draft vocabulary: how often the target's choice is among the first ``N`` ids.

A head drafts over the first ``mtp_vocab_size`` ids only (the LM head's first rows), so a
position whose target choice lies beyond them can never be accepted. Byte-level BPE
vocabularies are ordered roughly by merge frequency, which is what makes a prefix work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.cache import HiddenCache, from_bf16_bits

__all__ = ["target_choices", "vocab_coverage"]


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
) -> np.ndarray:
    """The target's greedy choice after each of the first ``limit`` training tokens.

    Over the whole vocabulary, from the cached hiddens.
    """
    seqs = cache.split("train")
    _, hiddens = cache.open_arrays()
    rows = np.concatenate(
        [np.arange(s.offset, s.offset + s.length) for s in seqs] or [np.zeros(0, np.int64)]
    )[:limit]
    out = []
    for i in range(0, len(rows), chunk):
        h = from_bf16_bits(hiddens[rows[i : i + chunk]])
        out.append(
            np.asarray(_argmax_rows(h, frozen_full["target_norm"], frozen_full["lm_head"], eps))
        )
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def vocab_coverage(choices: np.ndarray, sizes: Sequence[int]) -> dict[int, float]:
    """For each ``N``, the fraction of ``choices`` below ``N``."""
    if len(choices) == 0:
        return {int(n): 0.0 for n in sizes}
    return {int(n): float(np.mean(choices < n)) for n in sizes}
