"""Starts and stops the servers the serving benches drive, each on 127.0.0.1.

A :class:`ServerProcess` runs a server command with its output in a log file (removed after
a clean exit, kept for :meth:`ServerProcess.log_tail` otherwise), waits until
its health URL answers 200 (or the process dies, or the start-up time runs out), and on
exit sends SIGTERM, waits a bounded time, and kills what is still running: nothing it
starts outlives it. :func:`metrics` reads a Prometheus ``/metrics`` page into numbers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType

#: ``specdraft`` as a command, from the Python that runs the bench (no install needed).
SPECDRAFT = [sys.executable, "-c", "import sys; from specdraft.cli import main; sys.exit(main())"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def specdraft_serve(port: int, *args: str) -> list[str]:
    """The command line of ``specdraft serve`` on 127.0.0.1:``port`` with ``args``."""
    return [*SPECDRAFT, "serve", "--host", "127.0.0.1", "--port", str(port), *args]


class ServerProcess:
    """A server command run for the length of a ``with`` block.

    ``health`` is the URL that answers 200 once the server serves; ``startup_s`` bounds the
    wait for it and ``stop_s`` the wait for the process to end after SIGTERM.
    """

    def __init__(
        self,
        command: Sequence[str],
        health: str,
        *,
        startup_s: float = 300.0,
        stop_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.health = health
        self.startup_s = startup_s
        self.stop_s = stop_s
        self.env = {**os.environ, **(env or {})}
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in __exit__
            prefix="serve-bench-", suffix=".log", delete=False
        )
        self.proc: subprocess.Popen[bytes] | None = None
        #: The exit status after the block (None while it runs; negative: killed by a signal).
        self.returncode: int | None = None

    def __enter__(self) -> ServerProcess:
        """Starts the command and waits until ``health`` answers 200."""
        import httpx

        self.proc = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.monotonic() + self.startup_s
        while True:
            if self.proc.poll() is not None:
                self._finish()
                raise RuntimeError(
                    f"{self.command[0]} exited with {self.proc.returncode} before serving:\n"
                    + self.log_tail()
                )
            try:
                if httpx.get(self.health, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._finish()
                raise RuntimeError(
                    f"no answer from {self.health} within {self.startup_s:.0f} s:\n"
                    + self.log_tail()
                )
            time.sleep(0.25)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Sends SIGTERM, waits up to ``stop_s``, then kills."""
        self._finish()

    def _finish(self) -> None:
        if self.proc is None or self.returncode is not None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.returncode = self.proc.returncode
        self.log.close()
        if self.returncode == 0:
            # A clean exit leaves nothing to read; a failed one keeps its log for log_tail.
            os.unlink(self.log.name)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's output."""
        if not self.log.closed:
            self.log.flush()
        try:
            with open(self.log.name, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


def metrics(url: str) -> dict[str, float]:
    """``url``'s ``/metrics``: each sample's value by its name, labels left out.

    Samples of one name with different labels (requests by finish reason) are summed; a
    name with labels is also given whole, ``name{labels}``.
    """
    import httpx

    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, value = line.rsplit(" ", 1)
        name = sample.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
        if "{" in sample:
            values[sample] = float(value)
    return values
