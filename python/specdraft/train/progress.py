"""A one-line progress bar on stderr (the package has no progress-bar dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Redraws ``label [####----] done/total rate postfix`` on stderr at most 4 times a second.

    On a stream that is not a terminal it prints a plain line every ``10%`` instead, so logs
    stay readable.
    """

    def __init__(
        self, total: int, label: str, unit: str = "it", stream: TextIO | None = None
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.unit = unit
        self.stream = stream or sys.stderr
        self.done = 0
        self.postfix = ""
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        """Advance by ``n`` and optionally replace the text after the counts."""
        self.done += n
        if postfix is not None:
            self.postfix = postfix
        now = time.monotonic()
        decile = 10 * self.done // self.total
        if self._tty and (now - self._last_draw >= 0.25 or self.done >= self.total):
            self._last_draw = now
            self.stream.write("\r" + self._line(now))
            self.stream.flush()
        elif not self._tty and decile != self._last_decile:
            self._last_decile = decile
            self.stream.write(self._line(now) + "\n")
            self.stream.flush()

    def _line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        return (
            f"{self.label} [{bar}] {self.done}/{self.total} {self.unit} "
            f"{rate:.1f} {self.unit}/s eta {eta:.0f}s {self.postfix}"
        ).rstrip()

    def close(self) -> None:
        """End the bar's line."""
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
