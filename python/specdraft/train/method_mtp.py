"""``--method mtp``: the DeepSeek-V3-style MTP head (see :mod:`specdraft.train.mtp`).

Its cache rows are the target's final hidden; its draft vocabulary is the first ``N`` ids
(``mtp_vocab_size``: the head reads the target's LM head's first rows); its files are
:mod:`specdraft.train.export`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.train import export
from specdraft.train.cache import HiddenCache
from specdraft.train.evaluate import Acceptance, evaluate
from specdraft.train.head import unroll_loss
from specdraft.train.layer import HeadDims
from specdraft.train.mtp import MTP_ROWS, init_params
from specdraft.train.targets import TargetShape
from specdraft.train.trainer import LossFn, TrainSettings

__all__ = ["MtpMethod", "make"]


@dataclass(frozen=True)
class MtpMethod:
    """The MTP head's :class:`~specdraft.train.methods.TrainMethod`."""

    name: str = "mtp"
    cache_layers: tuple[int, ...] = ()
    #: The coverage of the first ids is measured over every training position, as it
    #: always was for this head (its figures in the README are so).
    choices_on_replies: bool = False

    def bind(self, cache: HiddenCache, tokenizer: Any) -> MtpMethod:  # noqa: ANN401
        """Itself: nothing is chosen from the cached text."""
        del cache, tokenizer
        return self

    def init_params(
        self, d: HeadDims, seed: int, lm_head_rows: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Fresh weights; the LM head is the target's, not the head's own."""
        del lm_head_rows
        return init_params(d, seed)

    def choose_draft_ids(self, choices: np.ndarray, n: int, vocab: int) -> np.ndarray:
        """The first ``n`` ids, whatever the target chooses."""
        del choices, vocab
        return np.arange(n, dtype=np.int64)

    def start_draft_ids(self, start: Path) -> np.ndarray | None:
        """None: the vocabulary is always the first ids."""
        del start
        return None

    def loss_fn(self, d: HeadDims, steps: int) -> LossFn:
        """The training-time-test unroll over the MTP row forward."""

        def loss(params, frozen, tok, hid, valid, start):  # noqa: ANN001, ANN202
            return unroll_loss(params, frozen, d, tok, hid, valid, start, steps, MTP_ROWS)

        return loss

    def evaluate(
        self,
        params: Any,  # noqa: ANN401 - the head's weights
        frozen: Any,  # noqa: ANN401
        d: HeadDims,
        cache: HiddenCache,
        k: int,
    ) -> Acceptance:
        """The engine walk of :mod:`specdraft.train.evaluate` over the MTP row forward."""
        return evaluate(params, frozen, d, cache, k, MTP_ROWS)

    def read_head(
        self, path: Path, shape: TargetShape, d: HeadDims, draft_ids: np.ndarray
    ) -> dict[str, np.ndarray]:
        """See :func:`specdraft.train.export.read_head`."""
        del draft_ids
        return export.read_head(path, shape, d)

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
        """``mtp.safetensors``, ``config.json`` and the card (see :mod:`.export`)."""
        del drafts
        return export.write_head(folder, params, shape, d, len(draft_ids), target, card)

    def report(self) -> dict[str, Any]:
        """Nothing beyond the pipeline's figures."""
        return {}

    def card_head(self, target: dict[str, Any]) -> str:
        """What the head is."""
        return f"""# MTP draft head for {target["name"]}

A DeepSeek-V3-style multi-token-prediction module (one decoder layer; the target's
embedding, final norm and LM head are shared, not stored here) trained by
`specdraft train-mtp` to draft for `{target["file"]}`."""

    def card_vocab(self, n: int, coverage: dict[str, float]) -> str:
        """The first ids and how often they hold the target's choice."""
        return f"""- Draft vocabulary: the first {n} token ids (`mtp_vocab_size`), which hold
  the target's greedy choice at {coverage["chosen_train"]:.1%} of training
  positions."""

    def card_objective(self, settings: TrainSettings) -> None:
        """None: the unroll's forward KL."""
        del settings

    def card_walk(self, acceptance: dict[str, Any]) -> None:
        """None: the engine walk and its exact-KV variant."""
        del acceptance


def make(shape: TargetShape, aux_layers: tuple[int, ...] | None) -> MtpMethod:
    """The MTP method; it captures no layers, so ``aux_layers`` must be left out."""
    del shape
    if aux_layers is not None:
        raise ValueError(
            "--aux-layers is an EAGLE-3 and DFlash option; the MTP head reads the final hidden"
        )
    return MtpMethod()
