"""Load on ``specdraft serve``: many streamed requests, some of them dropped mid-stream.

``--requests`` chat completions (default 1,000) run ``--concurrency`` at a time (default
32) over the bench prompts, streamed, greedy, ``--max-tokens`` each. Every
``--disconnect-every``-th request (default 10: a tenth) closes its connection after its
first content chunk. The server is a ``specdraft serve`` this script starts on 127.0.0.1
(``--model``, ``--proposer``, and ``--serve-arg`` for any other flag) and stops with
SIGTERM, or the one at ``--url``.

It prints JSON and exits 1 unless every contract holds:

- ``completed`` + ``cancelled`` = ``requests``: each request either ends with its finish
  reason and ``[DONE]``, or is one this script dropped; ``errors`` is 0 (``error_samples``
  shows up to five);
- ``hung`` is 0: no request went ``--timeout`` seconds without ending (a read that waits
  that long counts too), and ``not_run`` is 0 (requests left when ``--deadline`` passed);
- once nothing runs (waited for up to ``--settle`` seconds), ``kv_blocks_free`` equals
  ``kv_blocks_total`` and ``live_allocations`` equals ``base_allocations`` (the device
  ledger's count before the first request: the model's and the engine's own), from the
  server's ``/metrics``;
- a server it started exits 0 after SIGTERM (``server_exit``).

``server_cancelled`` is the server's count of cancelled requests: a dropped request that had
already finished when the server saw the drop ends as finished there, so it is at most
``cancelled``. ``failed`` names each contract that did not hold.

Run: ``python benches/serve_load.py [--requests 1000] [--concurrency 32] [--max-tokens 32]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from serve_process import ServerProcess, free_port, metrics, specdraft_serve
from specdraft.measure import per_second, percentiles


@dataclass
class Outcome:
    """How one request ended: ``completed``, ``cancelled``, ``hung`` or ``error``."""

    end: str
    detail: str = ""
    ttft: float | None = None
    tokens: int = 0


def one_request(
    client: Any,  # noqa: ANN401 - an httpx.Client
    url: str,
    body: dict[str, Any],
    disconnect: bool,
    timeout_s: float,
) -> Outcome:
    """Streams one chat completion; drops it after its first chunk when ``disconnect``."""
    import httpx

    start = time.perf_counter()
    ttft = None
    finish = None
    tokens = 0
    try:
        with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return Outcome("error", f"HTTP {r.status_code}: {r.read().decode()[:200]}")
            for line in r.iter_lines():
                if time.perf_counter() - start > timeout_s:
                    return Outcome("hung", f"still streaming after {timeout_s} s")
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    if finish is None:
                        return Outcome("error", "[DONE] without a finish reason")
                    return Outcome("completed", finish, ttft, tokens)
                event = json.loads(data)
                if "error" in event:
                    return Outcome("error", json.dumps(event["error"])[:200])
                usage = event.get("usage")
                if usage:
                    tokens = int(usage.get("completion_tokens", tokens))
                for choice in event.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    if (choice.get("delta") or {}).get("content"):
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        if disconnect:
                            # Leaving the block closes the connection with the body unread.
                            return Outcome("cancelled", "dropped after its first chunk", ttft)
            return Outcome("error", "the stream ended without [DONE]")
    except httpx.TimeoutException as e:
        return Outcome("hung", f"{type(e).__name__} after {time.perf_counter() - start:.1f} s")
    except Exception as e:  # noqa: BLE001 - a failed request is a counted error
        return Outcome("error", f"{type(e).__name__}: {e}"[:200])


def drive(args: argparse.Namespace, url: str) -> tuple[list[Outcome], int, float]:
    """Runs the requests; returns their outcomes, the count never started, and wall seconds."""
    import httpx
    from specdraft.bench_prompts import bench_prompts

    prompts = bench_prompts()
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    lock = threading.Lock()
    next_index = [0]
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    deadline = start + args.deadline

    def client_loop() -> None:
        timeout = httpx.Timeout(args.timeout, connect=30.0)
        with httpx.Client(timeout=timeout) as client:
            while time.perf_counter() < deadline:
                with lock:
                    i = next_index[0]
                    if i >= args.requests:
                        return
                    next_index[0] += 1
                body = {
                    "model": model,
                    "messages": list(prompts[i % len(prompts)].messages),
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                drop = args.disconnect_every > 0 and i % args.disconnect_every == 0
                o = one_request(client, f"{url}/v1/chat/completions", body, drop, args.timeout)
                with lock:
                    outcomes.append(o)

    with ThreadPoolExecutor(args.concurrency) as pool:
        for f in [pool.submit(client_loop) for _ in range(args.concurrency)]:
            f.result()
    return outcomes, args.requests - next_index[0], time.perf_counter() - start


def settle(url: str, seconds: float) -> dict[str, float]:
    """``/metrics`` once nothing runs or waits and the KV pool is whole (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        m = metrics(url)
        idle = m.get("specdraft_requests_running") == 0 == m.get("specdraft_requests_waiting")
        whole = m.get("specdraft_kv_blocks_free") == m.get("specdraft_kv_blocks_total")
        live = m.get("specdraft_device_live_allocations")
        if (idle and whole and live == m.get("specdraft_device_base_allocations")) or (
            time.monotonic() > deadline
        ):
            return m
        time.sleep(0.2)


def cancelled_count(m: dict[str, float]) -> int:
    """Requests the server counted as cancelled."""
    return int(
        sum(
            v
            for k, v in m.items()
            if k.startswith("specdraft_requests_total{") and 'finish_reason="cancelled"' in k
        )
    )


def report(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Drives ``url`` and gathers the figures (the server's exit is added by the caller)."""
    before = cancelled_count(metrics(url))
    outcomes, not_run, wall = drive(args, url)
    after = settle(url, args.settle)
    by_end: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_end.setdefault(o.end, []).append(o)
    done = by_end.get("completed", [])
    tokens = sum(o.tokens for o in done)
    bad = by_end.get("error", []) + by_end.get("hung", [])
    return {
        "url": url,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "disconnect_every": args.disconnect_every,
        "completed": len(done),
        "cancelled": len(by_end.get("cancelled", [])),
        "errors": len(by_end.get("error", [])),
        "hung": len(by_end.get("hung", [])),
        "not_run": not_run,
        "error_samples": sorted({o.detail for o in bad})[:5],
        "server_cancelled": cancelled_count(after) - before,
        "kv_blocks_total": int(after.get("specdraft_kv_blocks_total", -1)),
        "kv_blocks_free": int(after.get("specdraft_kv_blocks_free", -1)),
        "live_allocations": int(after.get("specdraft_device_live_allocations", -1)),
        "base_allocations": int(after.get("specdraft_device_base_allocations", -1)),
        "requests_running_after": int(after.get("specdraft_requests_running", -1)),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "throughput_tok_s": round(per_second(tokens, wall), 2),
        "ttft_s": percentiles([o.ttft for o in done if o.ttft is not None]),
    }


def failures(r: dict[str, Any]) -> list[str]:
    """The contracts ``r`` breaks, by name."""
    failed = []
    if r["completed"] + r["cancelled"] != r["requests"]:
        failed.append("completed + cancelled != requests")
    for key in ("errors", "hung", "not_run"):
        if r[key]:
            failed.append(f"{key} = {r[key]}")
    if r["server_cancelled"] > r["cancelled"]:
        failed.append("the server cancelled requests no client dropped")
    if r["kv_blocks_free"] != r["kv_blocks_total"] or r["kv_blocks_total"] <= 0:
        failed.append("kv_blocks_free != kv_blocks_total")
    if r["live_allocations"] != r["base_allocations"] or r["base_allocations"] <= 0:
        failed.append("live_allocations != base_allocations")
    if r.get("server_exit") not in (None, 0):
        failed.append(f"the server exited with {r['server_exit']}")
    return failed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default="smollm2", help="the model a started server loads")
    p.add_argument("--proposer", default="prompt-lookup", help="a started server's proposer")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="another flag for a started server, as --serve-arg=--max-batch=16 (repeat)",
    )
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--disconnect-every", type=int, default=10, help="drop every Nth request (0: none)"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds to start requests in")
    p.add_argument("--settle", type=float, default=30.0, help="seconds to wait for idle after")
    p.add_argument("--startup", type=float, default=300.0, help="seconds a server may take to load")
    args = p.parse_args(argv)
    if min(args.requests, args.concurrency, args.max_tokens) < 1 or args.disconnect_every < 0:
        p.error("--requests, --concurrency and --max-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the load; prints the JSON; 0 when every contract holds."""
    args = parse_args(argv)
    if args.url:
        r = report(args, args.url.rstrip("/"))
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = specdraft_serve(
            port, "--model", args.model, "--proposer", args.proposer, *args.serve_arg
        )
        server = ServerProcess(serve, f"{url}/health", startup_s=args.startup)
        with server:
            r = report(args, url)
        r["server_exit"] = server.returncode
        if server.returncode != 0:
            r["server_log"] = server.log_tail()
    r["failed"] = failures(r)
    print(json.dumps(r, indent=2))
    return 1 if r["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
