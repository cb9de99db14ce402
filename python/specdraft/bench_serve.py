"""``specdraft bench-serve``: drives any OpenAI-compatible endpoint with concurrent clients.

Each client streams chat completions of the bench prompts (:mod:`specdraft.bench_prompts`),
one request after another, until the requests run out, so ``--clients`` requests are in
flight at every moment. It prints JSON: aggregate output tokens per second over the whole
run, requests per second, and the p50 / p90 / p99 (and mean) of the time to first token,
of the gap between successive content chunks as the client sees them (``chunk_gap_s``; a
chunk holds every token one step emitted), and of each request's time per output token
after its first (``tpot_s``), with the errors. It works against ``specdraft serve``,
``llama-server`` and ``vllm serve`` alike.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["add_bench_serve", "percentiles", "run"]


@dataclass
class _Outcome:
    """What one request measured."""

    error: str | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    tpot: float | None = None


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 (nearest rank) and the mean of ``values`` (None for each when empty)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(values)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "mean": statistics.fmean(s)}


def _one(
    client: Any,  # noqa: ANN401 - an httpx.Client
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
) -> _Outcome:
    out = _Outcome()
    start = time.perf_counter()
    last = first = None
    chunks = 0
    try:
        with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return _Outcome(error=f"HTTP {r.status_code}: {r.read().decode()[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return _Outcome(error=json.dumps(event["error"])[:300])
                usage = event.get("usage")
                if usage:
                    out.tokens = int(usage.get("completion_tokens", out.tokens))
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or choice.get("text")
                    if not text:
                        continue
                    now = time.perf_counter()
                    chunks += 1
                    if first is None:
                        first = now
                        out.ttft = now - start
                    elif last is not None:
                        out.gaps.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is a counted error, not a crash
        return _Outcome(error=f"{type(e).__name__}: {e}"[:300])
    if out.tokens == 0:
        out.tokens = chunks
    if first is not None and last is not None and out.tokens > 1:
        out.tpot = (last - first) / (out.tokens - 1)
    return out


def run(
    url: str,
    *,
    model: str | None = None,
    clients: int = 1,
    requests: int = 16,
    max_tokens: int = 128,
    api_key: str | None = None,
    ignore_eos: bool = False,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Drives ``url`` (the server's base, without ``/v1``) and returns the figures."""
    import httpx

    from specdraft.bench_prompts import bench_prompts

    if clients < 1 or requests < 1 or max_tokens < 1:
        raise ValueError("--clients, --requests and --max-tokens must be at least 1")
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if model is None:
        models = httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()
        model = str(models["data"][0]["id"])
    prompts = bench_prompts()
    lock = threading.Lock()
    next_index = [0]
    outcomes: list[_Outcome] = []

    def client_loop() -> None:
        with httpx.Client(timeout=timeout_s) as client:
            while True:
                with lock:
                    i = next_index[0]
                    if i >= requests:
                        return
                    next_index[0] += 1
                body: dict[str, Any] = {
                    "model": model,
                    "messages": list(prompts[i % len(prompts)].messages),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                if ignore_eos:
                    body["ignore_eos"] = True
                o = _one(client, f"{base}/v1/chat/completions", headers, body)
                with lock:
                    outcomes.append(o)

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client_loop) for _ in range(clients)]:
            f.result()
    wall = time.perf_counter() - start
    ok = [o for o in outcomes if o.error is None]
    errors = [o.error for o in outcomes if o.error is not None]
    tokens = sum(o.tokens for o in ok)
    return {
        "url": base,
        "model": model,
        "clients": clients,
        "requests": requests,
        "max_tokens": max_tokens,
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "output_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_s": percentiles([o.ttft for o in ok if o.ttft is not None]),
        "chunk_gap_s": percentiles([g for o in ok for g in o.gaps]),
        "tpot_s": percentiles([o.tpot for o in ok if o.tpot is not None]),
    }


def _plot(figures: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key in zip(axes, ("ttft_s", "chunk_gap_s", "tpot_s"), strict=True):
        p = figures[key]
        names = ["p50", "p90", "p99", "mean"]
        ax.bar(names, [(p[n] or 0.0) * 1000 for n in names])
        ax.set_title(f"{key[:-2]} (ms)")
    fig.suptitle(
        f"{figures['model']} at {figures['url']}: {figures['clients']} clients, "
        f"{figures['throughput_tok_s']:.1f} tok/s"
    )
    fig.tight_layout()
    fig.savefig(path)


def run_bench_serve(args: argparse.Namespace) -> int:
    """``specdraft bench-serve``: prints the figures as JSON (exit 1 when a request failed)."""
    figures = run(
        args.url,
        model=args.model,
        clients=args.clients,
        requests=args.requests,
        max_tokens=args.max_tokens,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
    )
    print(json.dumps(figures, indent=2))
    if args.plot:
        try:
            _plot(figures, args.plot)
        except ImportError as e:
            print(f"specdraft bench-serve: {e} (pip install 'specdraft[plot]')", file=sys.stderr)
            return 2
    return 1 if figures["errors"] else 0


def add_bench_serve(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft bench-serve``."""
    p = subparsers.add_parser(
        "bench-serve", help="drive an OpenAI-compatible server with concurrent clients"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--model", default=None, help="the model name (default: the server's first)")
    p.add_argument("--clients", type=int, default=1, help="requests in flight at once")
    p.add_argument("--requests", type=int, default=16, help="requests in all")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens a request generates")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--ignore-eos", action="store_true", help="ask for max_tokens tokens (ignore_eos)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the latencies")
    p.set_defaults(run=run_bench_serve)
    return p
