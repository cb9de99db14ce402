"""The heads ``specdraft train --method`` trains, and what the pipeline asks of each.

A method is one module holding a class that fulfils :class:`TrainMethod`, listed in
:data:`METHODS` by name. The pipeline (:mod:`specdraft.train.pipeline`) is the same for
every method: the corpus and split, the cache of target rows (the method names the layers
a row holds), the draft vocabulary (the method picks its ids), AdamW with checkpoints over
the method's loss, the held-out evaluation and the files (the method writes its own
format). MTP and EAGLE-3 share the training-time-test unroll (:mod:`specdraft.train.head`)
and differ in their row forward; a head trained otherwise (DFlash's block drafter) brings its
own loss and evaluation through the same two methods, and its own lines of the model card.

This module imports nothing heavy, so the command line can list the methods without JAX.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from specdraft.train.cache import HiddenCache
    from specdraft.train.evaluate import Acceptance
    from specdraft.train.layer import HeadDims
    from specdraft.train.targets import TargetShape
    from specdraft.train.trainer import LossFn, TrainSettings

__all__ = ["METHODS", "TrainMethod", "load_method"]

#: Method name -> the module whose ``make(shape, aux_layers)`` returns its :class:`TrainMethod`.
METHODS: dict[str, str] = {
    "mtp": "specdraft.train.method_mtp",
    "eagle3": "specdraft.train.method_eagle3",
    "dflash": "specdraft.train.method_dflash",
}


class TrainMethod(Protocol):
    """What the pipeline needs from a head's method."""

    #: The ``--method`` name.
    name: str
    #: The decoder layers a cache row holds (empty: the target's final hidden only).
    cache_layers: tuple[int, ...]
    #: Whether the draft vocabulary's figures count the training replies' positions only
    #: (else every training position).
    choices_on_replies: bool

    def bind(self, cache: HiddenCache, tokenizer: Any) -> TrainMethod:  # noqa: ANN401
        """The method with what it chooses from the cached text fixed.

        DFlash chooses its mask token; the others return themselves.
        """
        ...

    def init_params(
        self, d: HeadDims, seed: int, lm_head_rows: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Fresh float32 weights.

        ``lm_head_rows`` are the target's LM-head rows of the draft vocabulary.
        """
        ...

    def choose_draft_ids(self, choices: np.ndarray, n: int, vocab: int) -> np.ndarray:
        """The draft vocabulary's ``n`` target ids, sorted ascending.

        ``choices`` are the target's greedy choices on the training text.
        """
        ...

    def start_draft_ids(self, start: Path) -> np.ndarray | None:
        """The draft vocabulary of a head a run starts from, where it fixes one."""
        ...

    def loss_fn(self, d: HeadDims, steps: int) -> LossFn:
        """The training loss (see :data:`specdraft.train.trainer.LossFn`)."""
        ...

    def evaluate(
        self, params: Any, frozen: Any, d: HeadDims, cache: HiddenCache, k: int
    ) -> Acceptance:
        """Held-out acceptance at ``k`` drafts, as the engine counts it."""
        ...

    def read_head(
        self, path: Path, shape: TargetShape, d: HeadDims, draft_ids: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The weights of a head written by :meth:`write_head` (``ValueError`` if not)."""
        ...

    def write_head(
        self,
        folder: Path,
        params: dict[str, np.ndarray],
        shape: TargetShape,
        d: HeadDims,
        draft_ids: np.ndarray,
        drafts: int,
        target: dict[str, Any],
        card: str,
    ) -> Path:
        """Write the head's files into ``folder``; returns its weights file."""
        ...

    def report(self) -> dict[str, Any]:
        """The method's own entries of ``report.json``."""
        ...

    def card_head(self, target: dict[str, Any]) -> str:
        """The model card's title and first paragraph (what the head is)."""
        ...

    def card_vocab(self, n: int, coverage: dict[str, float]) -> str:
        """The model card's draft-vocabulary line, from the pipeline's coverage figures."""
        ...

    def card_objective(self, settings: TrainSettings) -> str | None:
        """The model card's loss, or None for the unroll's forward KL."""
        ...

    def card_walk(self, acceptance: dict[str, Any]) -> str | None:
        """The model card's engine-walk figures, or None for the chain heads' two walks."""
        ...


def load_method(
    name: str, shape: TargetShape, aux_layers: tuple[int, ...] | None = None, **options: Any
) -> TrainMethod:
    """The method ``name`` for ``shape``'s target.

    ``aux_layers``: the captured layers' override (EAGLE-3's aux ids, DFlash's target layer
    ids); ``options`` left at None are not passed, the others must be among the method
    module's ``OPTIONS`` (DFlash's ``draft_layers``, ``block_size``, ``mask_token``).

    Raises ``ValueError`` for an unknown name, an option the method does not take, or
    options the method refuses.
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    module = importlib.import_module(METHODS[name])
    given = {k: v for k, v in options.items() if v is not None}
    foreign = sorted(set(given) - set(getattr(module, "OPTIONS", ())))
    if foreign:
        flags = ", ".join("--" + k.replace("_", "-") for k in foreign)
        raise ValueError(f"{flags}: not an option of --method {name}")
    method: TrainMethod = module.make(shape, aux_layers, **given)
    return method
