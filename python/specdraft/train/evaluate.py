"""Greedy chain acceptance of a head on held-out text, as the engine's greedy verify counts it.

An evaluation sequence is a held-out prompt followed by the target's own greedy
continuation, so every token after the prompt is the target's choice. At a base position
``p`` (the position of the last accepted token) the head drafts ``k`` tokens, each fed back
as the next step's token, and draft ``j`` is accepted while it and all before it equal the
token at ``p + 1 + j``. Two summaries are printed:

- *by position*: over every base position in the continuation, the fraction whose first
  ``j + 1`` drafts are accepted, and the mean acceptance length ``1 + E[accepted]``
  (accepted drafts plus the target's own token);
- *engine walk*: starting at the prompt's end and jumping ``accepted + 1`` positions after
  each verify, as the engine does; its mean acceptance length and acceptance by position
  (the fraction of verify steps whose first ``j + 1`` drafts are accepted) are the
  engine's figures.

The head's KV holds target-hidden rows for every earlier position (what the engine holds
with ``mtp_kv_exact`` on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.train.cache import HiddenCache, from_bf16_bits
from specdraft.train.head import HeadDims, rows_from_window, unroll

__all__ = ["Acceptance", "accepted_counts", "evaluate", "walk"]


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
        }

    def describe(self) -> str:
        """One human-readable line."""
        pos = ", ".join(f"{x:.1%}" for x in self.by_position)
        return (
            f"acceptance by position [{pos}], mean acceptance length {self.mean_length:.3f} "
            f"({self.rows} positions), engine walk {self.engine_mean_length:.3f} "
            f"({self.verify_steps} verify steps), at {self.k} drafts"
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


def _drafts_fn(d: HeadDims, steps: int) -> Any:  # noqa: ANN401 - a jitted function
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
        )
        return jnp.stack([jnp.argmax(lg, axis=-1) for lg in logits])  # [steps, 1, W-1]

    return jax.jit(draft)


def evaluate(
    params: Any,  # noqa: ANN401 - the head's weights (a dict of arrays)
    frozen: Any,  # noqa: ANN401
    d: HeadDims,
    cache: HiddenCache,
    k: int,
) -> Acceptance:
    """Acceptance of the head over the cache's evaluation sequences (see the module docs)."""
    seqs = cache.split("eval")
    result = Acceptance(k)
    if not seqs:
        return result
    tokens_all, hiddens_all = cache.open_arrays()
    width = max(s.length for s in seqs)
    draft = _drafts_fn(d, k)
    counts: list[np.ndarray] = []
    walked: list[int] = []
    for s in seqs:
        seq = np.asarray(tokens_all[s.offset : s.offset + s.length], dtype=np.int32)
        tok = np.zeros((1, width), np.int32)
        tok[0, : s.length] = seq
        hid = np.zeros((1, width, d.hidden), np.float32)
        hid[0, : s.length] = from_bf16_bits(hiddens_all[s.offset : s.offset + s.length])
        drafts = np.asarray(draft(params, frozen, jnp.asarray(tok), jnp.asarray(hid)))[:, 0]
        c = accepted_counts(drafts, seq, s.start)
        counts.append(c)
        walked.extend(walk(c))
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
    return result
