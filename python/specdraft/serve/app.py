"""The HTTP side: a Starlette app serving the OpenAI API over one :class:`EngineLoop`.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``. With an API key, every ``/v1`` route wants
``Authorization: Bearer <key>``. Streams are server-sent events ending in ``data: [DONE]``.

Invariants: every refusal is an OpenAI error body with its status; a client that goes away
(a closed stream, or a dropped connection while it waits for a whole reply) has its request
cancelled; the engine loop starts with the app and is drained when the app shuts down.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from specdraft.serve.engine_loop import EngineLoop, Event, RequestStream
from specdraft.serve.errors import ApiError, bad_request
from specdraft.serve.params import Completion, Kind, ServeContext, parse

Handler = Callable[[Request], Awaitable[Response]]

_log = logging.getLogger("specdraft.serve")


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Api:
    """The route handlers, over one engine loop."""

    def __init__(self, loop: EngineLoop, ctx: ServeContext, api_key: str | None) -> None:
        self.loop = loop
        self.ctx = ctx
        self.api_key = api_key
        self.created = int(time.time())

    def guard(self, handler: Handler) -> Handler:
        """``handler`` behind the API key and the OpenAI error format."""

        async def run(request: Request) -> Response:
            try:
                if self.api_key is not None:
                    got = request.headers.get("authorization", "")
                    want = f"Bearer {self.api_key}"
                    if not hmac.compare_digest(got.encode(), want.encode()):
                        raise ApiError(
                            401,
                            "a valid API key is required (Authorization: Bearer <key>)",
                            code="invalid_api_key",
                        )
                return await handler(request)
            except ApiError as e:
                return _error_response(e)
            except Exception as e:  # noqa: BLE001 - answered in OpenAI's format, and logged
                _log.exception("%s %s failed", request.method, request.url.path)
                return _error_response(ApiError(500, f"internal error: {e}", type="server_error"))

        return run

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``."""
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.ctx.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "specdraft",
                    }
                ],
            }
        )

    async def chat(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: Kind) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from e
        params = parse(kind, body, self.ctx)
        stream = await self.loop.start(params)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        if params.stream:
            return StreamingResponse(
                self._sse(stream, rid),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._whole(request, stream, rid)

    def _chunk(
        self, p: Completion, rid: str, text: str | None, finish: str | None, role: bool = False
    ) -> str:
        if p.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None}
            obj = "text_completion"
        choice["finish_reason"] = finish
        data = {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": self.ctx.model_name,
            "choices": [choice],
        }
        if p.include_usage:
            data["usage"] = None
        return f"data: {json.dumps(data)}\n\n"

    async def _sse(self, stream: RequestStream, rid: str) -> AsyncIterator[str]:
        p = stream.params
        try:
            if p.kind == "chat":
                yield self._chunk(p, rid, "", None, role=True)
            while True:
                ev: Event = await stream.queue.get()
                if not ev.end:
                    yield self._chunk(p, rid, ev.text, None)
                    continue
                stream.ended = True
                if ev.error is not None:
                    err = ApiError(500, ev.error, type="server_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                else:
                    yield self._chunk(p, rid, None if p.kind == "chat" else "", ev.finish)
                    if p.include_usage:
                        obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
                        data = {
                            "id": rid,
                            "object": obj,
                            "created": int(time.time()),
                            "model": self.ctx.model_name,
                            "choices": [],
                            "usage": dict(ev.usage or {}),
                        }
                        yield f"data: {json.dumps(data)}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:
            # A client that went away: the engine frees its request before the next step.
            self.loop.cancel(stream)

    async def _whole(self, request: Request, stream: RequestStream, rid: str) -> Response:
        p = stream.params

        async def collect() -> tuple[str, Event]:
            parts = []
            while True:
                ev = await stream.queue.get()
                if ev.end:
                    return "".join(parts), ev
                parts.append(ev.text)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        reply = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({reply, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not reply.done():
                reply.cancel()
                self.loop.cancel(stream)
        if not reply.done() or reply.cancelled():
            return Response(status_code=499)
        text, ev = reply.result()
        stream.ended = True
        if ev.error is not None:
            return _error_response(ApiError(500, ev.error, type="server_error"))
        if p.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": ev.finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ev.finish}
            obj = "text_completion"
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": self.ctx.model_name,
                "choices": [choice],
                "usage": dict(ev.usage or {}),
            }
        )

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 while the engine loop serves, else 503."""
        if self.loop.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        """``GET /metrics`` in Prometheus' text format."""
        return PlainTextResponse(self.loop.metrics.render(), media_type="text/plain; version=0.0.4")


def build_app(
    loop: EngineLoop, ctx: ServeContext, api_key: str | None = None, drain_s: float = 30.0
) -> Starlette:
    """The app serving ``loop``.

    The app starts the loop, and drains it for up to ``drain_s`` seconds when it shuts down.
    """
    api = _Api(loop, ctx, api_key)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        loop.begin()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.close, drain_s)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", api.guard(api.chat), methods=["POST"]),
            Route("/v1/completions", api.guard(api.completions), methods=["POST"]),
            Route("/v1/models", api.guard(api.models), methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
