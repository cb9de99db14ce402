"""The training loop: AdamW over the cached target hiddens, with resumable checkpoints.

Everything that decides the result is a function of the seed: the initial weights, and the
order of the training sequences in each epoch (a permutation drawn from ``seed`` and the
epoch number). A checkpoint holds the weights, the optimizer state, the step count and the
training time spent so far, so a run resumed from one takes exactly the batches and updates
the uninterrupted run would, and reports the time of all its parts.

Why JAX (measured on this project's 2-core CPU, one training step of the SmolLM2-sized
head: hidden 576, 9/3 heads, FFN 1536, draft vocabulary 8192, 4 sequences of 512 tokens,
3 unrolled drafts, AdamW): ``jax``+``jaxlib`` download 89 MB (plus scipy, ml_dtypes and
opt_einsum, 124 MB in all), while ``torch`` from the package index pulls the CUDA
libraries on Linux, 2.8 GB in all (539 MB for torch itself). The same step, written in
both and run back to back on the shared machine: JAX 127 s, torch 2.15 195 s (1.53x
slower); at 1 sequence of 128 tokens JAX 4.9 s, torch 16.7 s. JAX compiles the step once
per shape (seconds to a minute on a busy machine), so a batch's width is rounded up to a
multiple of ``width_step`` tokens (``WIDTH_STEP`` by default): a handful of shapes, each
compiled once, and little padding (a batch of short conversations is not padded to
``seq_len``). AdamW is ``optax``'s.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specdraft.train.cache import HiddenCache, Sequence, from_bf16_bits
from specdraft.train.head import HeadDims, unroll_loss

__all__ = [
    "WIDTH_STEP",
    "Batch",
    "Batches",
    "LossFn",
    "TrainState",
    "Trainer",
    "TrainSettings",
]

#: The default ``width_step``: a batch's width is its longest sequence rounded up to a
#: multiple of it (at most ``seq_len``), and the step compiles once per width.
WIDTH_STEP = 64

#: A head's loss on a batch: ``(params, frozen, tokens, hiddens, valid, start) -> (weighted
#: loss, per-step KL)`` (see :func:`specdraft.train.head.unroll_loss`); traced by ``jax.jit``.
LossFn = Callable[..., tuple[jax.Array, jax.Array]]


@dataclass(frozen=True)
class TrainSettings:
    """What a training run does (the CLI's options)."""

    epochs: int = 1
    steps: int = 3
    lr: float = 3e-4
    batch: int = 4
    seq_len: int = 512
    seed: int = 0
    weight_decay: float = 0.01
    warmup: int = 20
    clip: float = 1.0
    checkpoint_every: int = 50
    #: Batch widths are multiples of this (larger: fewer compiles, more padding).
    width_step: int = WIDTH_STEP


class Batch(NamedTuple):
    """One training batch of ``B`` windows of ``W`` tokens (see ``unroll_loss``)."""

    #: int32 ``[B, W]``: each sequence from its first token (prompt and reply).
    tokens: np.ndarray
    #: float32 ``[B, W, row width]``: the cache's rows at those tokens.
    hiddens: np.ndarray
    #: float32 ``[B, W]``: 1 on the sequences' positions, 0 on padding.
    valid: np.ndarray
    #: int32 ``[B]``: each sequence's reply start, the first base position learned from.
    start: np.ndarray


class Batches:
    """The training sequences as batches ``[batch, width]``.

    In the seed's order for each epoch. ``width`` is the batch's longest sequence rounded up
    to a multiple of ``settings.width_step`` (at most ``seq_len``); shorter sequences, and the empty
    rows of a short last batch, are padded with ``valid = 0``. Each row carries its
    sequence's reply start, so that the loss learns on the reply only.
    """

    def __init__(self, cache: HiddenCache, settings: TrainSettings) -> None:
        self.cache = cache
        self.settings = settings
        self.sequences: list[Sequence] = cache.split("train")
        self.per_epoch = math.ceil(len(self.sequences) / settings.batch)
        self.tokens, self.hiddens = cache.open_arrays()

    def order(self, epoch: int) -> np.ndarray:
        """The order of the training sequences in ``epoch``."""
        rng = np.random.default_rng([self.settings.seed, epoch])
        return rng.permutation(len(self.sequences))

    def tokens_in(self, steps: int) -> int:
        """The sequences' own tokens (no padding) in the batches of steps ``0 .. steps``."""
        s = self.settings
        total = 0
        for step in range(steps):
            epoch, i = divmod(step, self.per_epoch)
            for idx in self.order(epoch)[i * s.batch : (i + 1) * s.batch]:
                total += min(self.sequences[int(idx)].length, s.seq_len)
        return total

    def batch(self, step: int) -> Batch:
        """The batch of global step ``step``."""
        s = self.settings
        epoch, i = divmod(step, self.per_epoch)
        picks = self.order(epoch)[i * s.batch : (i + 1) * s.batch]
        longest = max((min(self.sequences[int(i)].length, s.seq_len) for i in picks), default=1)
        step = max(s.width_step, 1)
        w, h = min(s.seq_len, -(-longest // step) * step), self.cache.width
        tok = np.zeros((s.batch, w), np.int32)
        hid = np.zeros((s.batch, w, h), np.float32)
        valid = np.zeros((s.batch, w), np.float32)
        start = np.zeros(s.batch, np.int32)
        for r, idx in enumerate(picks):
            seq = self.sequences[int(idx)]
            n = min(seq.length, w)
            tok[r, :n] = self.tokens[seq.offset : seq.offset + n]
            hid[r, :n] = from_bf16_bits(self.hiddens[seq.offset : seq.offset + n])
            valid[r, :n] = 1.0
            start[r] = seq.start
        return Batch(tok, hid, valid, start)


@dataclass
class TrainState:
    """Weights, optimizer state, the number of steps taken and the time they took."""

    params: dict[str, Any]
    opt_state: Any
    step: int
    #: Wall seconds spent in training steps to reach this state, over every resumed part.
    seconds: float = 0.0


class Trainer:
    """Trains a head's weights.

    ``frozen`` holds the target's ``embed``, draft-vocabulary ``lm_head`` rows and
    ``target_norm`` (see :mod:`specdraft.train.head`). ``loss`` is the head's loss (its
    method's); by default the MTP head's training-time-test unroll of ``settings.steps``.
    """

    def __init__(
        self,
        d: HeadDims,
        frozen: dict[str, Any],
        settings: TrainSettings,
        total_steps: int,
        loss: LossFn | None = None,
    ) -> None:
        self.d = d
        self.frozen = frozen
        self.settings = settings
        self.total_steps = max(total_steps, 1)
        warmup = min(settings.warmup, max(self.total_steps // 10, 1))
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=settings.lr,
            warmup_steps=warmup,
            # optax needs the decay to outlast the warm-up, even for a one-step run.
            decay_steps=max(self.total_steps, warmup + 1),
            end_value=settings.lr * 0.1,
        )
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(settings.clip),
            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=settings.weight_decay),
        )
        steps = settings.steps
        optimizer = self.optimizer
        if loss is None:

            def loss(params, frozen, tok, hid, valid, start):  # noqa: ANN001, ANN202
                return unroll_loss(params, frozen, d, tok, hid, valid, start, steps)

        head_loss = loss

        def step_fn(params, opt_state, frozen, tok, hid, valid, start):  # noqa: ANN001, ANN202
            def of(p):  # noqa: ANN001, ANN202
                return head_loss(p, frozen, tok, hid, valid, start)

            (value, kls), grads = jax.value_and_grad(of, has_aux=True)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value, kls

        self._step = jax.jit(step_fn)
        self._loss = jax.jit(head_loss)

    def init_state(self, params: dict[str, np.ndarray]) -> TrainState:
        """A fresh state from initial weights."""
        p = {k: jnp.asarray(v) for k, v in params.items()}
        return TrainState(p, self.optimizer.init(p), 0)

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, float, np.ndarray]:
        """One AdamW step; returns the new state, the weighted loss and per-step KL."""
        tok, hid, valid, start = (jnp.asarray(x) for x in batch)
        params, opt_state, loss, kls = self._step(
            state.params, state.opt_state, self.frozen, tok, hid, valid, start
        )
        new = TrainState(params, opt_state, state.step + 1, state.seconds)
        return new, float(loss), np.asarray(kls)

    def loss(self, params: dict[str, Any], batch: Batch) -> tuple[float, np.ndarray]:
        """The weighted loss and per-step KL of ``params`` on a batch (no update)."""
        tok, hid, valid, start = (jnp.asarray(x) for x in batch)
        value, kls = self._loss(params, self.frozen, tok, hid, valid, start)
        return float(value), np.asarray(kls)

    def save(self, state: TrainState, path: Path) -> None:
        """Write a checkpoint (atomically: a partial file never replaces a good one)."""
        leaves = jax.tree_util.tree_leaves((state.params, state.opt_state))
        arrays = {f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)}
        arrays["step"] = np.asarray(state.step, np.int64)
        arrays["seconds"] = np.asarray(state.seconds, np.float64)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)

    def load_params(self, template: TrainState, path: Path) -> TrainState:
        """A fresh state (step 0, new optimizer) starting from the weights of a checkpoint.

        Continues training a head with its own schedule; the checkpoint must be of a head
        of the same shape (its optimizer state and step count are not used).
        """
        params = self.load(template, path).params
        return TrainState(params, self.optimizer.init(params), 0)

    def load(self, template: TrainState, path: Path) -> TrainState:
        """Read a checkpoint written by :meth:`save` for a state shaped like ``template``."""
        with np.load(path) as data:
            leaves, treedef = jax.tree_util.tree_flatten((template.params, template.opt_state))
            if f"leaf{len(leaves) - 1}" not in data or f"leaf{len(leaves)}" in data:
                raise ValueError(f"{path} is a checkpoint of a different head or optimizer")
            restored = []
            for i, like in enumerate(leaves):
                arr = data[f"leaf{i}"]
                if arr.shape != np.shape(like):
                    raise ValueError(
                        f"{path}: leaf {i} has shape {arr.shape}, expected {np.shape(like)}"
                    )
                restored.append(jnp.asarray(arr, dtype=jnp.asarray(like).dtype))
            params, opt_state = jax.tree_util.tree_unflatten(treedef, restored)
            # Checkpoints written before the time was kept start it at zero.
            seconds = float(data["seconds"]) if "seconds" in data else 0.0
            return TrainState(params, opt_state, int(data["step"]), seconds)

    def run(
        self,
        state: TrainState,
        batches: Batches,
        checkpoint: Path | None,
        stop_at: int | None = None,
        on_step: Callable[[TrainState, float, np.ndarray], None] | None = None,
        deadline: float | None = None,
    ) -> TrainState:
        """Step from ``state.step`` to the end of training (or to ``stop_at``).

        Stops early, before the next step, once ``time.monotonic()`` has reached
        ``deadline``. Writes a checkpoint every ``checkpoint_every`` steps and where it stops.
        """
        end = self.total_steps if stop_at is None else min(stop_at, self.total_steps)
        while state.step < end:
            if deadline is not None and time.monotonic() >= deadline:
                if checkpoint is not None:
                    self.save(state, checkpoint)
                break
            t = time.monotonic()
            state, loss, kls = self.step(state, batches.batch(state.step))
            state.seconds += time.monotonic() - t
            if on_step is not None:
                on_step(state, loss, kls)
            if checkpoint is not None and (
                state.step % self.settings.checkpoint_every == 0 or state.step == end
            ):
                self.save(state, checkpoint)
        return state
