"""The one engine loop every client shares.

A thread drives a :class:`specdraft.ServingEngine`, submitting and cancelling requests
between its steps.

Handlers on the server's event loop hand requests over with :meth:`EngineLoop.start`, get a
:class:`RequestStream` whose queue receives :class:`Event` s (text deltas, then one end),
and cancel with :meth:`EngineLoop.cancel` when their client goes away.

Invariants:
- Only the loop thread calls the engine; the event loop never waits on a step.
- Each stream gets its text in order and exactly one end event (unless it was cancelled by
  its handler, which then no longer listens).
- A request cut by a stop string is cancelled in the engine at once, so its KV is freed
  before the next step.
- After :meth:`EngineLoop.close`, nothing is admitted; what runs finishes (or is cancelled at
  the drain's deadline) and the engine is closed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specdraft.serve.errors import ApiError
from specdraft.serve.metrics import ServerMetrics
from specdraft.serve.params import Completion
from specdraft.serve.text import StopFilter, TextDecoder

_log = logging.getLogger("specdraft.serve")

#: The OpenAI finish reason of each engine finish reason.
FINISH = {"stop": "stop", "grammar": "stop", "length": "length", "context": "length"}


@dataclass
class Event:
    """A text delta (``end`` False) or a request's end."""

    text: str = ""
    end: bool = False
    finish: str | None = None
    usage: dict[str, int] | None = None
    error: str | None = None


@dataclass
class RequestStream:
    """A request as its handler sees it: events arrive on ``queue``."""

    params: Completion
    queue: asyncio.Queue[Event]
    aloop: asyncio.AbstractEventLoop
    id: int | None = None
    ended: bool = False


@dataclass
class _Live:
    """A request as the loop thread tracks it."""

    stream: RequestStream
    decoder: TextDecoder
    stop: StopFilter
    submitted: float
    eos: frozenset[int]
    first_at: float | None = None
    last_at: float = 0.0
    tokens: int = 0
    stopping: bool = False


@dataclass
class _Snapshot:
    waiting: int = 0
    running: int = 0
    kv_total: int = 0
    kv_free: int = 0
    live_allocs: int = 0


@dataclass
class _Commands:
    submits: collections.deque[tuple[RequestStream, asyncio.Future[int]]] = field(
        default_factory=collections.deque
    )
    cancels: collections.deque[RequestStream] = field(default_factory=collections.deque)


class EngineLoop:
    """Drives ``serving`` (a :class:`specdraft.ServingEngine`) from one thread."""

    def __init__(
        self,
        serving: Any,  # noqa: ANN401 - specdraft.ServingEngine
        tokenizer: Any,  # noqa: ANN401 - the model's tokenizer
        eos_ids: list[int],
        proposer: str,
        max_queue: int,
        gpu: Any = None,  # noqa: ANN401 - the model's specdraft.Backend
    ) -> None:
        self.serving = serving
        self.gpu = gpu
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_ids)
        self.max_queue = max_queue
        self.metrics = ServerMetrics(proposer, self.gauges)
        self._cv = threading.Condition()
        self._cmds = _Commands()
        self._live: dict[int, _Live] = {}
        self._closing = False
        self._drain_deadline = 0.0
        total, free = serving.kv_blocks or (0, 0)
        self._snapshot = _Snapshot(kv_total=total, kv_free=free, live_allocs=self._live_allocs())
        # Before any request the ledger holds the model's and the engine's own allocations:
        # what it returns to whenever no request is queued or running.
        self.base_allocs = self._snapshot.live_allocs
        # Submissions taken off the queue whose place in the engine's queue the snapshot does
        # not show yet (so the queue bound sees them at every moment).
        self._submitting = 0
        self._thread = threading.Thread(target=self._run, name="specdraft-engine", daemon=True)
        self._failure: BaseException | None = None

    # The event loop's side.

    def gauges(self) -> dict[str, float]:
        """The engine's last snapshot, as the metrics' gauges."""
        s = self._snapshot
        return {
            "requests_running": s.running,
            "requests_waiting": self._waiting(),
            "kv_blocks_total": s.kv_total,
            "kv_blocks_free": s.kv_free,
            "device_live_allocations": s.live_allocs,
            "device_base_allocations": self.base_allocs,
        }

    def _live_allocs(self) -> int:
        return int(self.gpu.live_allocs) if self.gpu is not None else 0

    def _waiting(self) -> int:
        return self._snapshot.waiting + self._submitting + len(self._cmds.submits)

    @property
    def healthy(self) -> bool:
        """Whether the loop thread runs (or has not started yet) without having failed."""
        return self._failure is None and not self._closing

    async def start(self, params: Completion) -> RequestStream:
        """Queues ``params`` for the engine and waits until it is submitted.

        Raises :class:`ApiError`: 503 while closing or with ``max_queue`` requests waiting,
        400 when the engine refuses the request.
        """
        aloop = asyncio.get_running_loop()
        stream = RequestStream(params, asyncio.Queue(), aloop)
        fut: asyncio.Future[int] = aloop.create_future()
        with self._cv:
            if self._closing or self._failure is not None:
                raise ApiError(
                    503,
                    "the server is shutting down",
                    type="server_error",
                    code="shutting_down",
                )
            waiting = self._waiting()
            if waiting >= self.max_queue:
                raise ApiError(
                    503,
                    f"the server has {waiting} requests waiting (--max-queue {self.max_queue}); "
                    "retry later",
                    type="server_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            self._cmds.submits.append((stream, fut))
            self._cv.notify()
        stream.id = await fut
        return stream

    def cancel(self, stream: RequestStream) -> None:
        """Ends ``stream``'s request (its client went away).

        Its KV is freed before the next step. Does nothing once the request has ended.
        """
        if stream.ended:
            return
        stream.ended = True
        with self._cv:
            self._cmds.cancels.append(stream)
            self._cv.notify()

    def begin(self) -> None:
        """Starts the loop thread."""
        self._thread.start()

    def close(self, drain_s: float) -> None:
        """Stops admitting and drains.

        Running requests get up to ``drain_s`` seconds to finish; what is left is cancelled
        and the engine closed. Blocks until done.
        """
        with self._cv:
            self._closing = True
            self._drain_deadline = time.monotonic() + drain_s
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join()
        self.serving.close()

    # The loop thread's side.

    def _post(self, stream: RequestStream, event: Event) -> None:
        try:
            stream.aloop.call_soon_threadsafe(stream.queue.put_nowait, event)
        except RuntimeError:  # its event loop is closed: nobody listens
            pass

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as e:  # noqa: BLE001 - reported to every waiting client
            self._failure = e
            for live in self._live.values():
                self._post(live.stream, Event(end=True, error=f"the engine loop failed: {e}"))
            self._live.clear()
            with self._cv:
                waiting = list(self._cmds.submits)
                self._cmds.submits.clear()
            for stream, fut in waiting:
                failed = ApiError(503, f"the engine loop failed: {e}", type="server_error")
                self._resolve(stream, fut, failed)
            _log.exception("the engine loop failed; the server answers 503 from now on")

    def _iterate(self) -> bool:
        with self._cv:
            while not (self._cmds.submits or self._cmds.cancels or self._live or self._closing):
                self._cv.wait()
            submits = list(self._cmds.submits)
            cancels = list(self._cmds.cancels)
            self._cmds.submits.clear()
            self._cmds.cancels.clear()
            self._submitting = len(submits)
            closing = self._closing
        # Submissions first: a cancel that came with its own submission finds its id.
        for stream, fut in submits:
            self._submit(stream, fut)
        if submits:
            self._refresh(submitted=True)
        for stream in cancels:
            self._cancel(stream)
        if closing:
            if not self._live:
                return False
            if time.monotonic() >= self._drain_deadline:
                for live in list(self._live.values()):
                    self._end(live, Event(end=True, error="the server shut down"), "cancelled")
                    self.serving.cancel(live.stream.id)
                self._live.clear()
                return False
        updates = self.serving.step()
        now = time.perf_counter()
        for rid, tokens, finish, metrics, error in updates:
            live = self._live.get(rid)
            if live is not None:
                self._deliver(live, now, tokens, finish, metrics, error)
        self._refresh()
        return True

    def _refresh(self, submitted: bool = False) -> None:
        total, free = self.serving.kv_blocks or (0, 0)
        snapshot = _Snapshot(
            self.serving.waiting, self.serving.running, total, free, self._live_allocs()
        )
        with self._cv:
            self._snapshot = snapshot
            if submitted:
                self._submitting = 0

    def _submit(self, stream: RequestStream, fut: asyncio.Future[int]) -> None:
        import specdraft

        p = stream.params
        try:
            rid = self.serving.submit(
                p.prompt,
                max_tokens=p.max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=p.seed,
                grammar=p.grammar,
                ignore_eos=p.ignore_eos,
            )
        except (specdraft.RequestError, ValueError, TypeError, OverflowError) as e:
            # The engine numbers requests within a call; a server's request is alone in its.
            self._resolve(stream, fut, ApiError(400, re.sub(r"^request \d+: ", "", str(e))))
            return
        except Exception as e:  # noqa: BLE001 - answered as the server's own failure
            self._resolve(stream, fut, ApiError(500, str(e), type="server_error"))
            return
        stream.id = rid
        self._live[rid] = _Live(
            stream,
            TextDecoder(self.tokenizer),
            StopFilter(p.stop),
            time.perf_counter(),
            self.eos,
        )
        self._resolve(stream, fut, rid)

    def _resolve(
        self, stream: RequestStream, fut: asyncio.Future[int], outcome: int | ApiError
    ) -> None:
        def done() -> None:
            if fut.cancelled():
                # The handler went away before it heard of its request.
                if isinstance(outcome, int):
                    self.cancel(stream)
            elif isinstance(outcome, ApiError):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

        try:
            stream.aloop.call_soon_threadsafe(done)
        except RuntimeError:
            if isinstance(outcome, int):
                self._cancel(stream)

    def _cancel(self, stream: RequestStream) -> None:
        live = self._live.pop(stream.id, None) if stream.id is not None else None
        if live is None:
            return
        self.serving.cancel(stream.id)
        self.metrics.request_ended("cancelled", live.tokens, 0, 0)

    def _deliver(
        self,
        live: _Live,
        now: float,
        tokens: list[int],
        finish: str | None,
        metrics: dict[str, Any] | None,
        error: BaseException | None,
    ) -> None:
        if tokens:
            if live.first_at is None:
                live.first_at = now
                self.metrics.first_token(now - live.submitted)
            else:
                self.metrics.tokens(now - live.last_at, len(tokens))
            live.last_at = now
            live.tokens += len(tokens)
        if not live.stopping:
            shown = tokens
            if finish == "stop" and tokens and tokens[-1] in live.eos:
                shown = tokens[:-1]
            text = live.stop.push(live.decoder.push(shown, finish is not None), finish is not None)
            if live.stop.stopped:
                # Cut by a stop string: free it now; its end comes with its metrics.
                live.stopping = True
                self.serving.cancel(live.stream.id)
            if text:
                self._post(live.stream, Event(text=text))
        if finish is None:
            return
        m = metrics or {}
        reason = "stop" if live.stopping else FINISH.get(finish)
        prompt = len(live.stream.params.prompt)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": live.tokens,
            "total_tokens": prompt + live.tokens,
            "drafted_tokens": int(m.get("drafted", 0)),
            "accepted_tokens": int(m.get("accepted", 0)),
        }
        message = None
        if reason is None:
            message = str(error) if error is not None else f"the request ended: {finish}"
        del self._live[live.stream.id]
        self._end(live, Event(end=True, finish=reason, usage=usage, error=message), reason)

    def _end(self, live: _Live, event: Event, reason: str | None) -> None:
        usage = event.usage or {}
        self.metrics.request_ended(
            reason or "error",
            live.tokens,
            usage.get("drafted_tokens", 0),
            usage.get("accepted_tokens", 0),
        )
        self._post(live.stream, event)
