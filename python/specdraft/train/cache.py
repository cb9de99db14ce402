"""The target's hidden states over a corpus, in memory-mapped files.

A cache folder holds ``tokens.u32`` (every sequence's token ids, concatenated),
``hiddens.bf16`` (a row of the target's hidden states at each of those tokens, ``[tokens,
width]`` BF16 as little-endian ``uint16``) and ``index.json`` (its format, the target it
came from, the hidden size, the layers a row holds, the split it was made for, and per
sequence its corpus, id, split, offset, length and reply start). A row is the target's
hidden before its final norm (``layers`` empty: the MTP head's cache, and every index
written before layers were recorded), or the outputs of the decoder layers ``layers`` side
by side, ``len(layers) * hidden`` wide (EAGLE-3's: its captured layers, then the last
layer, whose output is the final hidden). Logits are never stored: at 49k vocabulary they
would be ~90 times larger than the hidden; the trainer recomputes the target's
distribution from the final hidden through the frozen final norm and LM head.

Invariants: the two data files hold exactly ``index["tokens"]`` rows; a sequence is listed
in the index only after its rows are written (``flush`` writes the files first), so an
interrupted extraction resumes from the last listed sequence, truncating anything after it.
A cache holds one split (``split``, see ``data.split_record``): opened for another it is
refused, as its training sequences would include that split's held-out prompts. It holds
one set of layers: opened for others it is refused (its rows would be read as the wrong
layers, or be of the wrong width). A cache
of an older format is refused too: its teacher-forced training sequences were listed
without their reply start, so training on them would learn the prompts (and its split is
not recorded); it is not rebuilt in place, as it may hold hours of extraction that the
user may want to keep or move.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "CACHE_FORMAT",
    "HiddenCache",
    "Sequence",
    "bf16_bits",
    "describe_layers",
    "from_bf16_bits",
]

#: The index's ``format``. 2: every sequence has its reply start, and the split is recorded.
CACHE_FORMAT = 2


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (``uint16``), rounding to nearest, ties to even."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (b + np.uint32(0x7FFF) + ((b >> 16) & np.uint32(1))) >> 16
    return rounded.astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (``uint16``) -> float32, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class Sequence:
    """One cached sequence: rows ``offset .. offset + length`` of the data files.

    ``start`` is the position of its reply's first token (the prompt's length): the
    evaluation drafts from there on, and training learns only from there on.
    """

    corpus: str
    id: str
    split: str
    offset: int
    length: int
    start: int = 1


def describe_layers(layers: tuple[int, ...]) -> str:
    """How a cache's rows are described to a user."""
    if not layers:
        return "the final hidden"
    return "the outputs of layers " + ", ".join(str(i) for i in layers)


def _describe_split(split: dict[str, Any] | None) -> str:
    if split is None:
        return "no recorded split"
    return ", ".join(f"{k} {split[k]}" for k in sorted(split))


class HiddenCache:
    """A cache folder, opened for appending and reading (see the module docs).

    ``split`` is what defines the run's train/eval split: a new cache records it, and an
    existing one must hold the same; ``None`` opens any cache of this format (to read it).
    ``layers`` are the decoder layers a row holds (empty: the final hidden) with the same
    rule: ``None`` opens any existing cache, and makes a new one of the final hidden.
    """

    def __init__(
        self,
        folder: Path,
        target: str,
        hidden: int,
        split: dict[str, Any] | None = None,
        layers: tuple[int, ...] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.hidden = int(hidden)
        want = None if layers is None else tuple(int(i) for i in layers)
        index = self.folder / "index.json"
        if index.exists():
            meta = json.loads(index.read_text())
            if meta.get("format") != CACHE_FORMAT:
                raise ValueError(
                    f"{self.folder} is a hidden cache of format {meta.get('format', 1)}, "
                    f"not {CACHE_FORMAT}: its training sequences have no reply start, so "
                    "training would learn the prompts, and its held-out split is not "
                    "recorded; delete the folder or use another"
                )
            if meta["target"] != target or meta["hidden"] != self.hidden:
                raise ValueError(
                    f"{self.folder} caches hiddens of {meta['target']} (hidden "
                    f"{meta['hidden']}), not of {target} (hidden {hidden}); use another folder"
                )
            if split is not None and meta["split"] != split:
                raise ValueError(
                    f"{self.folder} holds the split of {_describe_split(meta['split'])}, "
                    f"not this run's {_describe_split(split)}: its training sequences "
                    "would include this run's held-out prompts; use another folder (the "
                    "default folder is one per split)"
                )
            held = tuple(meta.get("layers", ()))
            if want is not None and held != want:
                raise ValueError(
                    f"{self.folder} caches {describe_layers(held)} at each token, not "
                    f"{describe_layers(want)} as this run needs; use another folder (the "
                    "default folder is one per method and layers)"
                )
            self.layers = held
            self.split_def = meta["split"]
            self.sequences = [Sequence(**s) for s in meta["sequences"]]
        else:
            self.layers = want or ()
            self.split_def = split
            self.sequences = []
        #: Values in a row: the hidden size once per layer held (once for the final hidden).
        self.width = self.hidden * max(len(self.layers), 1)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.target = target
        self.tokens = sum(s.length for s in self.sequences)
        # Drop rows an interrupted run wrote after its last listed sequence.
        for name, width in (("tokens.u32", 4), ("hiddens.bf16", 2 * self.width)):
            path = self.folder / name
            with open(path, "ab") as f:
                f.truncate(self.tokens * width)
        self._keys = {(s.corpus, s.id, s.split) for s in self.sequences}

    def has(self, corpus: str, conv_id: str, split: str) -> bool:
        """Whether the sequence is already cached."""
        return (corpus, conv_id, split) in self._keys

    def append(
        self,
        corpus: str,
        conv_id: str,
        split: str,
        tokens: Iterable[int],
        hiddens: np.ndarray,
        start: int = 1,
    ) -> Sequence:
        """Write one sequence's tokens and float32 rows ``[len, width]``, then list it."""
        ids = np.asarray(list(tokens), dtype="<u4")
        if hiddens.shape != (len(ids), self.width):
            raise ValueError(
                f"hiddens of shape {hiddens.shape} for {len(ids)} tokens of width {self.width} "
                f"({describe_layers(self.layers)}, hidden {self.hidden})"
            )
        with open(self.folder / "tokens.u32", "ab") as f:
            f.write(ids.tobytes())
        with open(self.folder / "hiddens.bf16", "ab") as f:
            f.write(bf16_bits(hiddens).astype("<u2").tobytes())
        seq = Sequence(corpus, conv_id, split, self.tokens, len(ids), start)
        self.sequences.append(seq)
        self._keys.add((corpus, conv_id, split))
        self.tokens += len(ids)
        self._write_index()
        return seq

    def _write_index(self) -> None:
        meta = {
            "format": CACHE_FORMAT,
            "target": self.target,
            "hidden": self.hidden,
            "layers": list(self.layers),
            "split": self.split_def,
            "tokens": self.tokens,
            "sequences": [asdict(s) for s in self.sequences],
        }
        tmp = self.folder / "index.json.part"
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.folder / "index.json")

    def split(self, name: str) -> list[Sequence]:
        """The cached sequences of one split (``"train"`` or ``"eval"``), in order."""
        return [s for s in self.sequences if s.split == name]

    def open_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Read-only memory maps: tokens ``[n]`` uint32 and row bits ``[n, width]`` uint16."""
        if self.tokens == 0:
            return np.zeros(0, np.uint32), np.zeros((0, self.width), np.uint16)
        tokens = np.memmap(self.folder / "tokens.u32", dtype="<u4", mode="r", shape=(self.tokens,))
        hiddens = np.memmap(
            self.folder / "hiddens.bf16", dtype="<u2", mode="r", shape=(self.tokens, self.width)
        )
        return tokens, hiddens
