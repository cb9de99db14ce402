"""A ``specdraft serve`` app on the tiny chat GGUF, run by uvicorn on a thread bound to
127.0.0.1 (a free port), for the server's tests. Everything it starts stops with the
context manager, within bounded time."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import specdraft
from specdraft import DraftProposer
from test_engine import _load

uvicorn = __import__("pytest").importorskip("uvicorn")
from specdraft.serve.app import build_app  # noqa: E402
from specdraft.serve.engine_loop import EngineLoop  # noqa: E402
from specdraft.serve.params import ServeContext  # noqa: E402

MODEL = "tiny"


class Sleepy(DraftProposer):
    """Drafts nothing, slowly: each step takes at least ``seconds``, so a request of a few
    hundred tokens runs long enough for a test to act while it runs."""

    def __init__(self, seconds: float = 0.01) -> None:
        self.seconds = seconds

    def alloc_state(self, gpu: Any) -> None:  # noqa: ANN401
        return None

    def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw):  # noqa: ANN001, ANN201
        time.sleep(self.seconds)
        return []

    def after_verify(self, num_accepted, state, stream):  # noqa: ANN001, ANN201
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    engine: Any
    loop: EngineLoop
    model: Any
    gpu: Any


@contextmanager
def serve(
    model_path: Path,
    *,
    api_key: str | None = None,
    max_queue: int = 256,
    max_batch: int = 64,
    kv_blocks: int = 256,
    slow: bool = False,
    max_seq_len: int = 256,
) -> Iterator[Served]:
    """Serves the tiny model with prompt lookup (or, ``slow``, :class:`Sleepy`)."""
    gpu = specdraft.CpuBackend()
    model = _load(model_path, gpu, kv_blocks=kv_blocks, max_seq_len=max_seq_len)
    proposer = Sleepy() if slow else specdraft.PromptLookup()
    engine = specdraft.SpecEngine(
        model, proposer, num_drafts=3, max_batch=max_batch, draft_policy="fixed"
    )
    loop = EngineLoop(
        specdraft.ServingEngine(engine),
        model.tokenizer,
        list(model.config.eos_token_ids),
        "prompt-lookup",
        max_queue,
        gpu=gpu,
    )
    app = build_app(
        loop, ServeContext(MODEL, model.tokenizer, max_seq_len, 32), api_key, drain_s=10
    )
    port = free_port()
    server = uvicorn.Server(
        # log_config=None: uvicorn's own logging set-up (dictConfig) would close every
        # logging handler of the test process, pytest's and absl's (jax's) among them.
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            log_config=None,
        )
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", engine, loop, model, gpu)
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"


def metric(url: str, name: str) -> float:
    """The value of the first sample of ``name`` (with any labels) on ``/metrics``."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def wait_for(cond: Any, seconds: float = 10.0, what: str = "") -> None:  # noqa: ANN401
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
