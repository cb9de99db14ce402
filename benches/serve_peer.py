"""``specdraft serve`` against llama.cpp's ``llama-server`` and against offline generation.

Same GGUF, the same bench prompts (chat template, greedy, ``--max-tokens`` each), the same
CPUs: the script pins itself, and so every server it starts, to ``--threads`` CPUs, and
llama-server runs ``-t``/``-tb`` that many threads (specdraft's kernels use the CPUs the
process may run on). Three contenders run back to back, in alternating rounds (each round
rotates who goes first, :func:`specdraft.measure.turn_order`), at one client and at 16:

- ``specdraft``: ``specdraft serve`` with ``--proposer`` (default prompt-lookup), started
  afresh for each measurement and driven by ``specdraft bench-serve``'s clients;
- ``llama-server``: started afresh with ``-np`` equal to the clients (1 or 16 slots), the
  same clients;
- ``offline``: ``SpecEngine.chat`` in this process on the same prompts with the same
  proposer: one call per prompt at one client, one call of all of them run 16 at a time
  at 16 clients.

Each server gets one unmeasured request first; the offline engine one short call. At one
client each client makes ``--requests`` requests; at 16, each of the 16 does.

It prints JSON: ``rows``, one per round, clients and contender (output tok/s over the run,
p50 time to first token and time per output token, tokens, errors); and per client count
in ``summary`` the median tok/s and TTFT p50 of each contender over the rounds, with
``specdraft_vs_llama_server`` and ``serve_vs_offline``: the :func:`specdraft.measure.ratio_stats`
of the per-round tok/s ratios (each round's pair measured minutes apart at most). ``goals``
sets them against the targets: at one client serve no more than 5% below offline and at
least 1.5x llama-server, at 16 clients at least 1.5x llama-server with a p50 TTFT no worse.

Run: ``python benches/serve_peer.py [--rounds 3] [--requests 8] [--max-tokens 128]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pinning import pin
from serve_process import ServerProcess, free_port, specdraft_serve
from specdraft.bench_serve import run as drive
from specdraft.measure import per_second, ratio_stats, turn_order
from specdraft.serve.cli import DEFAULT_SEQUENCES

#: Where ../shared/peer/build_llama_cpp_tools.sh leaves llama-server.
LLAMA_SERVER = Path.home() / ".cache/specdraft-peer/llama.cpp-0.3.36/build/bin/llama-server"
CONTENDERS = ("specdraft", "llama-server", "offline")
CLIENTS = (1, 16)
#: The name both servers answer to, so the clients send the same body to either.
NAME = "bench"


def server_command(args: argparse.Namespace, who: str, clients: int, port: int) -> list[str]:
    """The command line that starts ``who`` for ``clients`` clients on ``port``."""
    if who == "specdraft":
        flags = ["--model", args.gguf, "--proposer", args.proposer, "--served-model-name", NAME]
        flags += ["--num-drafts", str(args.num_drafts), "--max-seq-len", str(args.max_seq_len)]
        return specdraft_serve(port, *flags)
    threads = str(args.threads)
    return [
        str(args.llama_server),
        *("-m", args.gguf, "-t", threads, "-tb", threads, "-np", str(clients)),
        *("-c", str(args.max_seq_len * clients), "-a", NAME),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]


def measure_server(args: argparse.Namespace, who: str, clients: int) -> dict[str, Any]:
    """Starts ``who``, warms it up, drives it with ``clients`` clients, stops it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(args, who, clients, port)
    with ServerProcess(cmd, f"{url}/health", startup_s=args.startup):
        drive(url, model=NAME, clients=1, requests=1, max_tokens=8, timeout_s=args.timeout)
        f = drive(
            url,
            model=NAME,
            clients=clients,
            requests=args.requests * clients,
            max_tokens=args.max_tokens,
            timeout_s=args.timeout,
        )
    return {
        "tok_s": round(f["throughput_tok_s"], 2),
        "ttft_p50_s": f["ttft_s"]["p50"],
        "tpot_p50_s": f["tpot_s"]["p50"],
        "output_tokens": f["output_tokens"],
        "requests": f["completed"] + f["errors"],
        "errors": f["errors"],
        "error_samples": f["error_samples"],
        "wall_s": round(f["wall_s"], 3),
    }


def measure_offline(args: argparse.Namespace, model: Any, clients: int) -> dict[str, Any]:  # noqa: ANN401
    """``SpecEngine.chat`` on the requests the clients would send, ``clients`` at a time."""
    import specdraft
    from specdraft.bench_prompts import WARMUP, bench_prompts
    from specdraft.cli_engine import make_proposer

    prompts = bench_prompts()
    chats = [list(prompts[i % len(prompts)].messages) for i in range(args.requests * clients)]
    engine = specdraft.SpecEngine(
        model,
        make_proposer(args.proposer, model, args.model),
        num_drafts=args.num_drafts,
        max_batch=clients,
    )
    engine.chat([list(WARMUP)], max_tokens=8, temperature=0)
    calls = [[c] for c in chats] if clients == 1 else [chats]
    start = time.perf_counter()
    results = [
        r for call in calls for r in engine.chat(call, max_tokens=args.max_tokens, temperature=0)
    ]
    wall = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in results)
    errors = [str(r.error) for r in results if r.error]
    return {
        "tok_s": round(per_second(tokens, wall), 2),
        "ttft_p50_s": None,
        "tpot_p50_s": None,
        "output_tokens": tokens,
        "requests": len(results),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "wall_s": round(wall, 3),
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per client count: each contender's medians and the paired per-round ratios."""
    out: dict[str, Any] = {}
    for clients in CLIENTS:
        mine = [r for r in rows if r["clients"] == clients]
        by_round: dict[int, dict[str, dict[str, Any]]] = {}
        for r in mine:
            by_round.setdefault(r["round"], {})[r["server"]] = r
        s: dict[str, Any] = {}
        for who in CONTENDERS:
            rates = [r["tok_s"] for r in mine if r["server"] == who]
            ttfts = [r["ttft_p50_s"] for r in mine if r["server"] == who and r["ttft_p50_s"]]
            s[who] = {
                "tok_s": statistics.median(rates) if rates else None,
                "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            }
        for key, a, b in [
            ("specdraft_vs_llama_server", "specdraft", "llama-server"),
            ("serve_vs_offline", "specdraft", "offline"),
        ]:
            pairs = [
                got[a]["tok_s"] / got[b]["tok_s"]
                for got in by_round.values()
                if a in got and b in got and got[b]["tok_s"]
            ]
            s[key] = ratio_stats(pairs, "rounds")
        out[str(clients)] = s
    return out


def goals(summary: dict[str, Any]) -> dict[str, bool | None]:
    """Each goal of the comparison: met, missed, or None when not measured."""

    def at_least(value: float | None, target: float) -> bool | None:
        return None if not value else value >= target

    one, many = summary["1"], summary["16"]
    ttft_s, ttft_l = many["specdraft"]["ttft_p50_s"], many["llama-server"]["ttft_p50_s"]
    return {
        "one_client_at_least_95pct_of_offline": at_least(one["serve_vs_offline"]["median"], 0.95),
        "one_client_1.5x_llama_server": at_least(one["specdraft_vs_llama_server"]["median"], 1.5),
        "16_clients_1.5x_llama_server": at_least(many["specdraft_vs_llama_server"]["median"], 1.5),
        "16_clients_ttft_p50_no_worse": None
        if ttft_s is None or ttft_l is None
        else ttft_s <= ttft_l,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a model name or .gguf file")
    p.add_argument("--proposer", default="prompt-lookup")
    p.add_argument("--num-drafts", type=int, default=4)
    p.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    p.add_argument("--threads", type=int, default=2, help="CPUs (and llama-server threads)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=8, help="requests each client makes")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=2048, help="context of each sequence")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--startup", type=float, default=300.0, help="seconds a server may take to load")
    args = p.parse_args(argv)
    if min(args.rounds, args.requests, args.max_tokens, args.threads) < 1:
        p.error("--rounds, --requests, --max-tokens and --threads must be at least 1")
    if not args.llama_server.exists():
        p.error(f"--llama-server {args.llama_server}: no such file (build_llama_cpp_tools.sh)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the rounds; prints the JSON; 1 when a request failed."""
    import specdraft
    from specdraft.models import resolve_model

    args = parse_args(argv)
    cpus = pin(args.threads)
    args.gguf = str(resolve_model(args.model))
    # The KV pool `specdraft serve` gives itself, on the backend it picks.
    blocks = DEFAULT_SEQUENCES * math.ceil(args.max_seq_len / 16) + 1
    model = specdraft.load_model(
        args.gguf,
        gpu=specdraft.default_backend(),
        max_seq_len=args.max_seq_len,
        kv_blocks=blocks,
    )
    rows = []
    for rnd in range(args.rounds):
        for call, clients in enumerate(CLIENTS):
            for who in turn_order(list(CONTENDERS), rnd, call):
                if who == "offline":
                    row = measure_offline(args, model, clients)
                else:
                    row = measure_server(args, who, clients)
                row = {"round": rnd, "clients": clients, "server": who, **row}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    summary = summarise(rows)
    report = {
        "model": args.gguf,
        "proposer": args.proposer,
        "num_drafts": args.num_drafts,
        "cpus": cpus,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests,
        "rounds": args.rounds,
        "rows": rows,
        "summary": summary,
        "goals": goals(summary),
    }
    print(json.dumps(report, indent=2))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
