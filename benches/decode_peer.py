"""``specdraft bench`` against llama.cpp's ``llama-bench``, back to back on the same GGUF.

Each round runs, pinned to the same ``--threads`` CPUs:

1. ``llama-bench`` (decode only: ``-p 0 -n MAX_TOKENS``, 3 repetitions, ``-t THREADS``);
2. ``specdraft bench --json`` (batch 1, greedy, the given ``--proposer`` rows beside plain
   decoding, the same ``--max-tokens``), in a process of its own;
3. ``llama-bench`` again.

The peer's rate for the round is the mean of its two runs, so a machine that drifts during
the round moves both sides alike. Rounds repeat the whole sequence (``--rounds``).

A row's ``tokens_per_s`` is ``specdraft bench``'s: its tokens over its wall time, prefill of
the chat-templated prompts included, where ``llama-bench``'s decode test has no prompt; the
ratio therefore understates specdraft's decode rate a little.

Prints JSON: ``rounds`` (each one's two ``llama-bench`` rates, their mean, and every
specdraft row: ``tokens_per_s``, ``speedup`` over plain decoding, ``mean_acceptance_length``,
``identical_to_baseline``) and ``summary``: per row, the median ``tokens_per_s`` over the
rounds and :func:`specdraft.measure.ratio_stats` of its per-round ratio to the peer
(``vs_llama_bench``) and to plain decoding (``vs_plain``). It exits 1 when a row's text
differs from plain decoding's or a run failed.

Run: ``python benches/decode_peer.py [--rounds 2] [--proposer mtp,hybrid]
[--llama-bench PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from pinning import pin
from serve_process import SPECDRAFT
from specdraft.measure import BASELINE, ratio_stats

#: Where llama.cpp's tools are usually built for these benchmarks.
LLAMA_BENCH = Path.home() / ".cache/specdraft-peer/llama.cpp-0.3.36/build/bin/llama-bench"
#: How many times ``llama-bench`` repeats its test in each run.
PEER_REPETITIONS = 3


def decode_rate(output: str) -> float:
    """The tokens per second of the decode test in ``llama-bench -o json``'s output.

    That test is the record with generated tokens and no prompt. A ``ValueError`` names what
    is wrong with any other output.
    """
    try:
        records = json.loads(output)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench printed no JSON ({e}): {output[:200]!r}") from e
    if not isinstance(records, list):
        raise ValueError(f"llama-bench's JSON is not a list of tests: {output[:200]!r}")
    decode = [
        r
        for r in records
        if isinstance(r, dict) and r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0
    ]
    if len(decode) != 1 or not isinstance(decode[0].get("avg_ts"), int | float):
        tests = [(r.get("n_prompt"), r.get("n_gen")) for r in records if isinstance(r, dict)]
        raise ValueError(
            "llama-bench's JSON holds no single decode test with an avg_ts "
            f"(its tests, as (n_prompt, n_gen): {tests})"
        )
    rate = float(decode[0]["avg_ts"])
    if not rate > 0:
        raise ValueError(f"llama-bench's decode test reads {rate} tokens per second")
    return rate


def run_llama_bench(binary: Path, model: Path, threads: int, tokens: int) -> float:
    """One ``llama-bench`` decode run's tokens per second.

    A ``RuntimeError`` carries the end of its error output when it fails.
    """
    command = [str(binary), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(tokens)]
    command += ["-r", str(PEER_REPETITIONS), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"llama-bench exited {done.returncode}: {done.stderr.strip()[-500:] or '(no output)'}"
        )
    return decode_rate(done.stdout)


def run_specdraft_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``specdraft bench --json``'s rows, run in a process of its own.

    A ``RuntimeError`` carries its error output when it fails or prints no report.
    """
    command = [*SPECDRAFT, "bench", "--json", "--batch", "1", "--device", "cpu"]
    command += ["--model", str(args.model), "--max-tokens", str(args.max_tokens)]
    command += args.bench_args
    if args.proposer:
        command += ["--proposer", args.proposer]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = None
    if not isinstance(report, dict) or "results" not in report:
        raise RuntimeError(
            f"specdraft bench exited {done.returncode} without a report: "
            f"{done.stderr.strip()[-800:] or '(no output)'}"
        )
    return report["results"]


def label(row: dict[str, Any]) -> str:
    """A row's name in the summary: its proposer, and its policy when it has one."""
    return f"{row['proposer']} ({row['policy']})" if row.get("policy") else row["proposer"]


def round_record(before: float, rows: list[dict[str, Any]], after: float) -> dict[str, Any]:
    """One round as the report keeps it."""
    keep = ("tokens_per_s", "speedup", "mean_acceptance_length", "identical_to_baseline")
    return {
        "llama_bench_tokens_per_s": [before, after],
        "llama_bench_mean": round((before + after) / 2, 3),
        "rows": [
            {"row": label(r), **{k: r.get(k) for k in keep}, "errors": r["errors"]} for r in rows
        ],
    }


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per row over the rounds: the median tokens per second and two ratios' statistics.

    The ratios are each round's rate against that round's peer mean (``vs_llama_bench``) and
    against the round's plain decoding (``vs_plain``).
    """
    summary: dict[str, Any] = {}
    for r in rounds:
        plain = next((x["tokens_per_s"] for x in r["rows"] if x["row"] == BASELINE), None)
        for x in r["rows"]:
            s = summary.setdefault(
                x["row"], {"tokens_per_s": [], "vs_llama_bench": [], "vs_plain": []}
            )
            s["tokens_per_s"].append(x["tokens_per_s"])
            s["vs_llama_bench"].append(x["tokens_per_s"] / r["llama_bench_mean"])
            if plain:
                s["vs_plain"].append(x["tokens_per_s"] / plain)
    return {
        name: {
            "tokens_per_s": round(statistics.median(s["tokens_per_s"]), 2),
            "vs_llama_bench": ratio_stats(s["vs_llama_bench"], "rounds"),
            "vs_plain": ratio_stats(s["vs_plain"], "rounds"),
        }
        for name, s in summary.items()
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module documentation)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a .gguf file or a known model name")
    p.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH, help="llama-bench's path")
    p.add_argument("--threads", type=int, default=2, help="CPUs both sides run on")
    p.add_argument("--rounds", type=int, default=1, help="times the whole sequence runs")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each side generates")
    p.add_argument(
        "--proposer", default="mtp,hybrid", help="specdraft bench's --proposer rows (comma list)"
    )
    p.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        help="after --, more options for specdraft bench (--prompts 4, say)",
    )
    args = p.parse_args(argv)
    args.bench_args = [a for a in args.bench_args if a != "--"]
    if args.rounds < 1 or args.max_tokens < 1:
        p.error("--rounds and --max-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the rounds and prints the report; the exit status."""
    args = parse_args(argv)
    from specdraft.models import resolve_model

    try:
        args.model = resolve_model(args.model)
    except Exception as e:  # noqa: BLE001 - any failure to find the model ends the run
        print(f"decode_peer: {e}", file=sys.stderr)
        return 2
    if args.model.suffix != ".gguf":
        print(
            f"decode_peer: llama-bench reads GGUF files; {args.model} is not one", file=sys.stderr
        )
        return 2
    if not args.llama_bench.is_file():
        print(
            f"decode_peer: no llama-bench at {args.llama_bench} (build llama.cpp's tools and "
            "pass --llama-bench PATH)",
            file=sys.stderr,
        )
        return 2
    cpus = pin(args.threads)
    rounds = []
    try:
        for n in range(args.rounds):
            print(f"decode_peer: round {n + 1}/{args.rounds} on CPUs {cpus}", file=sys.stderr)
            before = run_llama_bench(args.llama_bench, args.model, args.threads, args.max_tokens)
            rows = run_specdraft_bench(args)
            after = run_llama_bench(args.llama_bench, args.model, args.threads, args.max_tokens)
            rounds.append(round_record(before, rows, after))
    except (RuntimeError, ValueError) as e:
        print(f"decode_peer: {e}", file=sys.stderr)
        return 1
    report = {
        "model": str(args.model),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "rounds": rounds,
        "summary": summarise(rounds),
    }
    print(json.dumps(report, indent=2))
    bad = [
        x["row"]
        for r in rounds
        for x in r["rows"]
        if x["errors"] or x["identical_to_baseline"] is False
    ]
    for row in dict.fromkeys(bad):
        print(f"decode_peer: {row}: failed or differs from plain decoding", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
