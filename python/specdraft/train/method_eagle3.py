"""``--method eagle3``: the EAGLE-3 head (see :mod:`specdraft.train.eagle3`).

Its cache rows hold the outputs of the capture layers (the hiddens entering the aux layers
``k``: the outputs of layers ``k - 1``) and of the last layer (the final hidden, the
teacher), ``4 * hidden`` BF16 values a token for three aux layers; its draft vocabulary is
the ``N`` ids the target chooses most often on the training replies; its files are a
``speculators`` checkpoint (:mod:`specdraft.train.export_eagle3`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.quantize import read_safetensors
from specdraft.train.cache import HiddenCache
from specdraft.train.eagle3 import EAGLE3_ROWS, aux_layer_ids, capture_layers, init_params
from specdraft.train.evaluate import Acceptance, evaluate
from specdraft.train.export_eagle3 import WEIGHTS_FILE, eagle3_config, read_eagle3, write_eagle3
from specdraft.train.head import unroll_loss
from specdraft.train.layer import HeadDims
from specdraft.train.targets import TargetShape
from specdraft.train.trainer import LossFn, TrainSettings
from specdraft.train.vocab import top_choices

__all__ = ["Eagle3Method", "make"]


@dataclass(frozen=True)
class Eagle3Method:
    """The EAGLE-3 head's :class:`~specdraft.train.methods.TrainMethod`."""

    #: vLLM's convention: the hidden entering each of these layers is fused.
    aux_ids: tuple[int, ...]
    #: The target's last layer: its output is the final hidden, the teacher.
    last_layer: int
    name: str = "eagle3"
    choices_on_replies: bool = True

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The capture layers, then the last layer."""
        return (*capture_layers(self.aux_ids), self.last_layer)

    def bind(self, cache: HiddenCache, tokenizer: Any) -> Eagle3Method:  # noqa: ANN401
        """Itself: nothing is chosen from the cached text."""
        del cache, tokenizer
        return self

    def init_params(
        self, d: HeadDims, seed: int, lm_head_rows: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Fresh weights, the head's LM head starting as the target's rows."""
        return init_params(d, len(self.aux_ids), lm_head_rows, seed)

    def choose_draft_ids(self, choices: np.ndarray, n: int, vocab: int) -> np.ndarray:
        """The ``n`` most frequent choices (ties: the lower id), sorted ascending."""
        return top_choices(choices, n, vocab)

    def start_draft_ids(self, start: Path) -> np.ndarray | None:
        """A trained head's own draft vocabulary (its ``d2t``), or a checkpoint's.

        A checkpoint's is the ``draft_ids.npy`` the pipeline keeps beside it (None where it
        has none).
        """
        if start.suffix == ".npz":
            beside = start.with_name("draft_ids.npy")
            return np.load(beside) if beside.exists() else None
        file = start / WEIGHTS_FILE if start.is_dir() else start
        raw = read_safetensors(file)
        if "d2t" not in raw or raw["d2t"][0] != "I64" or len(raw["d2t"][1]) != 1:
            raise ValueError(f"{file} has no int64 d2t: not an EAGLE-3 head")
        d2t = np.frombuffer(raw["d2t"][2], "<i8")
        return d2t + np.arange(len(d2t), dtype=np.int64)

    def loss_fn(self, d: HeadDims, steps: int) -> LossFn:
        """The training-time-test unroll over the EAGLE-3 row forward."""

        def loss(params, frozen, tok, hid, valid, start):  # noqa: ANN001, ANN202
            return unroll_loss(params, frozen, d, tok, hid, valid, start, steps, EAGLE3_ROWS)

        return loss

    def evaluate(
        self,
        params: Any,  # noqa: ANN401 - the head's weights
        frozen: Any,  # noqa: ANN401
        d: HeadDims,
        cache: HiddenCache,
        k: int,
    ) -> Acceptance:
        """The engine walk of :mod:`specdraft.train.evaluate` over the EAGLE-3 row forward."""
        return evaluate(params, frozen, d, cache, k, EAGLE3_ROWS)

    def read_head(
        self, path: Path, shape: TargetShape, d: HeadDims, draft_ids: np.ndarray
    ) -> dict[str, np.ndarray]:
        """See :func:`specdraft.train.export_eagle3.read_eagle3`."""
        del shape
        return read_eagle3(path, d, len(self.aux_ids), draft_ids)

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
        """A ``speculators`` checkpoint (see :mod:`.export_eagle3`)."""
        config = eagle3_config(shape, d, len(draft_ids), self.aux_ids, drafts, target)
        return write_eagle3(folder, params, draft_ids, config, card)

    def report(self) -> dict[str, Any]:
        """The aux layers (vLLM's ids) and the layers captured for them."""
        return {
            "eagle_aux_hidden_state_layer_ids": list(self.aux_ids),
            "capture_layers": list(capture_layers(self.aux_ids)),
        }

    def card_head(self, target: dict[str, Any]) -> str:
        """What the head is."""
        ids = ", ".join(str(k) for k in self.aux_ids)
        return f"""# EAGLE-3 draft head for {target["name"]}

An EAGLE-3 head (one decoder layer over the target's hiddens entering layers {ids}, fused
by `fc`; its own norm and LM head over a reduced draft vocabulary; the target's embedding
is shared, not stored here) in the `speculators` format, trained by `specdraft train
--method eagle3` to draft for `{target["file"]}`."""

    def card_vocab(self, n: int, coverage: dict[str, float]) -> str:
        """The chosen ids and how often they hold the target's choice, against the first ids."""
        return f"""- Draft vocabulary: the {n} token ids the target chose most often on the
  training replies (`d2t`), which hold its greedy choice at {coverage["chosen_heldout"]:.1%}
  of the held-out continuations' positions ({coverage["chosen_train"]:.1%} of the training
  reply positions they were chosen on); the first {n} ids would hold
  {coverage["first_n_heldout"]:.1%} ({coverage["first_n_train"]:.1%})."""

    def card_objective(self, settings: TrainSettings) -> None:
        """None: the unroll's forward KL."""
        del settings

    def card_walk(self, acceptance: dict[str, Any]) -> None:
        """None: the engine walk and its exact-KV variant."""
        del acceptance


def make(shape: TargetShape, aux_layers: tuple[int, ...] | None) -> Eagle3Method:
    """The EAGLE-3 method for ``shape``'s target.

    ``aux_layers`` are vLLM's ids, else its default ``(2, L // 2, L - 3)``. Raises
    ``ValueError`` where the ids do not fit the target.
    """
    n = shape.num_hidden_layers
    return Eagle3Method(aux_layer_ids(n, aux_layers), n - 1)
