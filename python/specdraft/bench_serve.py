"""``specdraft bench-serve``: drives any OpenAI-compatible endpoint with concurrent clients.

Each client streams chat completions of the bench prompts (:mod:`specdraft.bench_prompts`),
one request after another, until the requests run out, so ``--clients`` requests are in
flight at every moment. It prints JSON: aggregate output tokens per second over the whole
run, requests per second, and the p50 / p90 / p99 (and mean) of the time to first token,
of the gap between successive content chunks and of each request's time per output token,
with the errors; :func:`specdraft.measure.serve_figures` defines each field. It works
against ``specdraft serve``, ``llama-server`` and ``vllm serve`` alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specdraft.measure import Stream, serve_figures, time_per_output_token

__all__ = ["add_bench_serve", "run"]


def _one(
    client: Any,  # noqa: ANN401 - an httpx.Client
    url: str,
    headers: dict[str, str],
    body: dict[str, Any],
) -> Stream:
    out = Stream()
    start = time.perf_counter()
    last = first = None
    chunks = 0
    try:
        with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                return Stream(error=f"HTTP {r.status_code}: {r.read().decode()[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return Stream(error=json.dumps(event["error"])[:300])
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
        return Stream(error=f"{type(e).__name__}: {e}"[:300])
    if out.tokens == 0:
        out.tokens = chunks
    if first is not None and last is not None:
        out.tpot = time_per_output_token(first, last, out.tokens)
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
    outcomes: list[Stream] = []

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
    return {
        "url": base,
        "model": model,
        "clients": clients,
        "requests": requests,
        "max_tokens": max_tokens,
        **serve_figures(outcomes, wall),
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
