"""``--method dflash``: the DFlash block drafter (see :mod:`specdraft.train.dflash`).

Its cache rows hold the outputs of its target layers and of the last layer (the final
hidden, the teacher): for SmolLM2 the default layers 1, 14 and 26 are the ones EAGLE-3
captures, so the two methods read one cache (see
:func:`specdraft.train.pipeline.default_cache_folder`). Its draft vocabulary is the target's
first ``N`` ids (the head shares the target's LM head; a loader drafts over its first rows).
Its mask token is a special token of the target's vocabulary that the cached text never
holds, unless ``--mask-token`` names one. Its files are z-lab's layout
(:mod:`specdraft.train.export_dflash`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.train.cache import HiddenCache
from specdraft.train.dflash import (
    DFlashShape,
    default_loss_decay,
    dflash_loss,
    init_params,
    target_layer_ids,
)
from specdraft.train.evaluate import Acceptance
from specdraft.train.evaluate_dflash import evaluate_dflash
from specdraft.train.export_dflash import dflash_config, read_dflash, write_dflash
from specdraft.train.layer import HeadDims
from specdraft.train.targets import TargetShape
from specdraft.train.trainer import LossFn, TrainSettings

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DRAFT_LAYERS",
    "DFlashMethod",
    "choose_mask_token",
    "make",
]

DEFAULT_DRAFT_LAYERS = 2
DEFAULT_BLOCK_SIZE = 8
#: The options ``make`` takes beyond ``aux_layers`` (see ``methods.load_method``).
OPTIONS = ("draft_layers", "block_size", "mask_token")
#: ``mask_token_id`` of a method whose mask token is not chosen yet.
UNBOUND = -1


def choose_mask_token(tokenizer: Any, used: np.ndarray) -> int:  # noqa: ANN401 - Tokenizer
    """The highest-id special token that is no chat marker and never occurs in ``used``.

    A chat marker is the end-of-sequence token, the beginning-of-sequence token or one the
    chat template writes. Raises ``ValueError`` where every special token is one or occurs.
    """
    specials = {int(i): str(t.content) for i, t in tokenizer.hf.get_added_tokens_decoder().items()}
    template = tokenizer.chat_template or ""
    markers = {tokenizer.bos_token, tokenizer.eos_token}
    seen = set(np.unique(np.asarray(used, np.int64)).tolist())
    free = [
        i
        for i, text in specials.items()
        if i != tokenizer.eos_token_id
        and text not in markers
        and text not in template
        and i not in seen
    ]
    if not free:
        raise ValueError(
            f"every special token of the target's vocabulary ({len(specials)}) is a chat marker "
            "or occurs in the cached text, so none can be DFlash's mask token; pass --mask-token"
        )
    return max(free)


@dataclass(frozen=True)
class DFlashMethod:
    """The DFlash head's :class:`~specdraft.train.methods.TrainMethod`."""

    #: The head (its mask token ``UNBOUND`` until :meth:`bind` chooses it).
    head: DFlashShape
    #: The target's last layer: its output is the final hidden, the teacher.
    last_layer: int
    name: str = "dflash"
    choices_on_replies: bool = True

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The target layers, then the last layer."""
        return (*self.head.target_layer_ids, self.last_layer)

    def bind(self, cache: HiddenCache, tokenizer: Any) -> DFlashMethod:  # noqa: ANN401
        """The method with its mask token chosen from the cached text (or checked against it).

        Raises ``ValueError`` where a given mask token occurs in that text.
        """
        tokens, _ = cache.open_arrays()
        if self.head.mask_token_id == UNBOUND:
            return replace(
                self, head=replace(self.head, mask_token_id=choose_mask_token(tokenizer, tokens))
            )
        times = int(np.count_nonzero(np.asarray(tokens) == self.head.mask_token_id))
        if times:
            raise ValueError(
                f"--mask-token {self.head.mask_token_id} occurs {times} times in the cached "
                "text: a block would read it as a mask; name a token the text never holds"
            )
        return self

    def init_params(
        self, d: HeadDims, seed: int, lm_head_rows: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Fresh weights; the LM head is the target's, not the head's own."""
        del lm_head_rows
        return init_params(d, self.head, seed)

    def choose_draft_ids(self, choices: np.ndarray, n: int, vocab: int) -> np.ndarray:
        """The first ``n`` ids, whatever the target chooses."""
        del choices, vocab
        return np.arange(n, dtype=np.int64)

    def start_draft_ids(self, start: Path) -> np.ndarray | None:
        """None: the vocabulary is always the first ids."""
        del start
        return None

    def loss_fn(self, d: HeadDims, steps: int) -> LossFn:
        """Block cross-entropy (:func:`~specdraft.train.dflash.dflash_loss`); ``steps`` unused."""
        del steps
        head = self.head

        def loss(params, frozen, tok, hid, valid, start):  # noqa: ANN001, ANN202
            return dflash_loss(params, frozen, d, head, tok, hid, valid, start)

        return loss

    def evaluate(
        self,
        params: Any,  # noqa: ANN401 - the head's weights
        frozen: Any,  # noqa: ANN401
        d: HeadDims,
        cache: HiddenCache,
        k: int,
    ) -> Acceptance:
        """See :func:`~specdraft.train.evaluate_dflash.evaluate_dflash`.

        A block drafts ``block_size - 1`` tokens, whatever ``k``.
        """
        del k
        return evaluate_dflash(params, frozen, d, self.head, cache)

    def read_head(
        self, path: Path, shape: TargetShape, d: HeadDims, draft_ids: np.ndarray
    ) -> dict[str, np.ndarray]:
        """See :func:`specdraft.train.export_dflash.read_dflash`."""
        del shape, draft_ids
        return read_dflash(path, d, self.head)

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
        """z-lab's layout (see :mod:`.export_dflash`)."""
        del drafts
        config = dflash_config(shape, d, self.head, len(draft_ids), target)
        return write_dflash(folder, params, config, card)

    def report(self) -> dict[str, Any]:
        """The head's shape and its loss."""
        return {
            "target_layer_ids": list(self.head.target_layer_ids),
            "draft_layers": self.head.layers,
            "block_size": self.head.block_size,
            "mask_token_id": self.head.mask_token_id,
            "loss_decay": self.head.loss_decay,
        }

    def card_head(self, target: dict[str, Any]) -> str:
        """What the head is."""
        ids = ", ".join(str(k) for k in self.head.target_layer_ids)
        return f"""# DFlash draft head for {target["name"]}

A DFlash block drafter ({self.head.layers} decoder layers of the target's shape with per-head
q/k norms; the outputs of the target's layers {ids}, fused by `fc` and `hidden_norm`, are
the keys and values of every committed position in each layer; the target's embedding and
LM head are shared, not stored here) in z-lab's layout, trained by `specdraft train
--method dflash` to draft {self.head.drafts} tokens a forward for `{target["file"]}`
(blocks of {self.head.block_size}, mask token {self.head.mask_token_id})."""

    def card_vocab(self, n: int, coverage: dict[str, float]) -> str:
        """The first ids and how often they hold the target's choice."""
        return f"""- Draft vocabulary: the first {n} token ids of the target's LM head, which hold
  its greedy choice at {coverage["first_n_heldout"]:.1%} of the held-out continuations'
  positions ({coverage["first_n_train"]:.1%} of the training reply positions)."""

    def card_objective(self, settings: TrainSettings) -> str:
        """The paper's loss."""
        del settings
        return (
            "cross-entropy on the target's greedy token (its stored final hidden through its "
            "frozen final norm and LM head), blocks anchored at random reply positions, one in "
            f"every {self.head.block_size} positions, block row j weighted exp(-(j - 1) / "
            f"{self.head.loss_decay:g})"
        )

    def card_walk(self, acceptance: dict[str, Any]) -> str:
        """The engine walk (the same with exact KV: a block keeps no rows of its drafts)."""
        return f"engine walk {acceptance['engine_mean_acceptance_length']:.3f}"


def make(
    shape: TargetShape,
    aux_layers: tuple[int, ...] | None,
    draft_layers: int | None = None,
    block_size: int | None = None,
    mask_token: int | None = None,
) -> DFlashMethod:
    """The DFlash method for ``shape``'s target.

    ``aux_layers`` are its target layers (z-lab's ``target_layer_ids``: the outputs of those
    layers), else :func:`~specdraft.train.dflash.target_layer_ids`' default. Raises
    ``ValueError`` where an option does not fit the target.
    """
    layers = DEFAULT_DRAFT_LAYERS if draft_layers is None else draft_layers
    block = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if layers < 1 or block < 2:
        raise ValueError(
            f"a DFlash head needs at least one draft layer and a block of 2 (the anchor and a "
            f"draft), not --draft-layers {layers} --block-size {block}"
        )
    if mask_token is not None and not 0 <= mask_token < shape.vocab:
        raise ValueError(
            f"--mask-token {mask_token} is not an id of a {shape.vocab}-token vocabulary"
        )
    n = shape.num_hidden_layers
    head = DFlashShape(
        target_layer_ids(n, layers, aux_layers),
        layers,
        block,
        UNBOUND if mask_token is None else mask_token,
        default_loss_decay(block),
    )
    return DFlashMethod(head, n - 1)
