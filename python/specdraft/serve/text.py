"""Text of a token stream: incremental detokenizing and stop strings across token boundaries.

Invariants: the deltas :class:`TextDecoder` returns concatenate to the decoding of every id
it was given (text is held back while it ends in an incomplete UTF-8 sequence, U+FFFD);
:class:`StopFilter` never releases text that could still turn out to begin a stop string,
and releases nothing from the first stop string on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextDecoder:
    """Decodes ids as they arrive over a short window (after vLLM's detokenizer)."""

    def __init__(self, tokenizer: Any) -> None:  # noqa: ANN401 - any encode/decode tokenizer
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        """The text ``ids`` add; with ``final``, whatever is left even if incomplete."""
        self._ids.extend(ids)
        if self._read >= len(self._ids):
            return ""
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        if not final and after.endswith("\ufffd"):
            return ""
        if after.startswith(before):
            delta = after[len(before) :]
        else:
            # The window's text changed with the new ids: yield what follows the common part.
            common = 0
            while common < min(len(before), len(after)) and before[common] == after[common]:
                common += 1
            delta = after[common:]
        self._prefix = self._read
        self._read = len(self._ids)
        return str(delta)


class StopFilter:
    """Cuts text at the first of ``stops``, even when a stop string spans two pushes."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buf = ""
        self.stopped = False

    def push(self, text: str, final: bool = False) -> str:
        """The text that may be shown now; sets :attr:`stopped` at a stop string."""
        if self.stopped:
            return ""
        self._buf += text
        hits = [i for i in (self._buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self._buf = self._buf[: min(hits)], ""
            return out
        if final or self._hold == 0:
            out, self._buf = self._buf, ""
            return out
        cut = max(len(self._buf) - self._hold, 0)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out
