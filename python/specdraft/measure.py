"""What ``specdraft bench`` and ``specdraft bench-serve`` measure, each figure defined once.

Each function here computes one figure (or one family of figures) of the two commands' JSON,
and its docstring says what that JSON field means. The bench's trials, turn order, pairing
and ratio statistics, and the serving bench's percentiles and throughput, live here alone;
the commands only run engines or requests and hand over what they timed.

Invariants: every rate is a count over seconds and 0 when no time passed; every ratio is
against plain decoding (the ``baseline`` row) at the same batch width, and 1.0 for the
baseline itself; statistics of ratios leave out ratios of 0 (a call without tokens).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "BASELINE",
    "Pass",
    "Run",
    "Stream",
    "bench_rows",
    "fastest_ratios",
    "figures",
    "merge",
    "paired_ratios",
    "per_second",
    "percentiles",
    "ratio",
    "ratio_stats",
    "serve_figures",
    "time_per_output_token",
    "trial_ratios",
    "turn_order",
]

#: Plain decoding's row name: every ratio is against this row.
BASELINE = "baseline"

#: The per-request timings a row sums (seconds drafting, verifying, prefilling).
TIMES = ("draft_time_s", "verify_time_s", "prefill_time_s")


def per_second(count: float, seconds: float) -> float:
    """``count`` per second of ``seconds`` (tokens/s, requests/s); 0 when no time passed."""
    return count / seconds if seconds else 0.0


def ratio(a: float, b: float) -> float:
    """``a / b`` to three places: a ``speedup`` (0 when ``b`` is 0)."""
    return round(a / b, 3) if b else 0.0


def turn_order(runs: list[T], trial: int, call: int) -> list[T]:
    """The order ``runs`` take call ``call`` of trial ``trial`` in: rotated by ``trial + call``.

    Each call rotates who goes first, and each trial shifts every call's rotation by one, so
    over ``len(runs)`` trials every run goes first once in every call, whatever the number of
    calls a trial makes (a rotation by a count running over the trials would give a call the
    same order in every trial whenever the calls of a trial are a multiple of the runs: two
    runs and an even number of calls, say).
    """
    if not runs:
        return []
    k = (trial + call) % len(runs)
    return runs[k:] + runs[:k]


def ratio_stats(ratios: list[float], count: str = "trials") -> dict[str, Any]:
    """What a list of ratios (one a trial, or one a call) says: one entry of ``ratio`` & co.

    ``median``, ``min``, ``max`` (to four places), ``geomean`` (the geometric mean) and
    ``stderr`` (the geometric mean's standard error, from the sample deviation of the log
    ratios; 0 with one ratio), and how many ratios under the key ``count`` (``trials`` or
    ``calls``). Ratios of 0 (no tokens) are left out; with none left every figure is 0.
    """
    logs = [math.log(r) for r in ratios if r > 0]
    if not logs:
        return {count: 0, "median": 0.0, "min": 0.0, "max": 0.0, "geomean": 0.0, "stderr": 0.0}
    geomean = math.exp(statistics.fmean(logs))
    spread = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    kept = [r for r in ratios if r > 0]
    return {
        count: len(kept),
        "median": round(statistics.median(kept), 4),
        "min": round(min(kept), 4),
        "max": round(max(kept), 4),
        "geomean": round(geomean, 4),
        "stderr": round(geomean * spread, 4),
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    """``p50``, ``p90``, ``p99`` (nearest rank) and the ``mean`` of ``values`` (None when empty).

    The nearest rank of percentile ``q`` over ``n`` sorted values is the ``ceil(q / 100 * n)``-th.
    """
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    s = sorted(values)

    def rank(q: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "mean": statistics.fmean(s)}


def _sum_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass
class Pass:
    """What one engine did over one pass of the prompt set (or a sum of passes)."""

    tokens: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    # Per prompt kind: tokens, seconds, CPU seconds.
    by_kind: dict[str, list[float]] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)
    # Each call's prompt kind, tokens and wall seconds, in order.
    calls: list[tuple[str, int, float]] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, results: list[Any], seconds: float, kind: str, cpu_seconds: float = 0.0) -> None:
        """Adds one ``generate`` call's results, wall and CPU time, for prompts of ``kind``."""
        tokens = sum(len(r.tokens) for r in results)
        self.tokens += tokens
        self.seconds += seconds
        self.cpu_seconds += cpu_seconds
        self.calls.append((kind, tokens, seconds))
        acc = self.by_kind.setdefault(kind, [0.0, 0.0, 0.0])
        acc[0] += tokens
        acc[1] += seconds
        acc[2] += cpu_seconds
        for r in results:
            self.outputs.append(list(r.tokens))
            for key, value in r.metrics.items():
                if key in ("drafted", "accepted", "verify_steps", "decode_tokens", *TIMES):
                    self.counters[key] = self.counters.get(key, 0) + value
                elif key in ("drafted_at", "accepted_at", "draft_lengths"):
                    self.counters[key] = _sum_lists(self.counters.get(key, []), value)
            if r.error:
                self.errors.append(str(r.error))


def merge(passes: list[Pass]) -> Pass:
    """The sum of ``passes``: tokens, times, per-kind sums, counters and errors added up."""
    total = Pass()
    for p in passes:
        total.tokens += p.tokens
        total.seconds += p.seconds
        total.cpu_seconds += p.cpu_seconds
        for kind, figs in p.by_kind.items():
            acc = total.by_kind.setdefault(kind, [0.0, 0.0, 0.0])
            for i, x in enumerate(figs):
                acc[i] += x
        for key, value in p.counters.items():
            if isinstance(value, list):
                total.counters[key] = _sum_lists(total.counters.get(key, []), value)
            else:
                total.counters[key] = total.counters.get(key, 0) + value
        total.errors += p.errors
    return total


@dataclass
class Run:
    """One row of the bench: a proposer at a batch width under a policy.

    It holds the current trial's engine and every trial's passes.
    """

    proposer: str
    policy: str | None
    batch: int
    engine: Any
    trials: list[list[Pass]] = field(default_factory=list)

    @property
    def passes(self) -> list[Pass]:
        """Each pass index's figures summed over the trials."""
        count = max((len(t) for t in self.trials), default=0)
        return [merge([t[i] for t in self.trials if i < len(t)]) for i in range(count)]


def figures(p: Pass, base: Pass | None) -> dict[str, Any]:
    """A pass's (or a sum of passes') figures, pooled over its calls, with ratios to ``base``.

    ``tokens`` generated and wall ``seconds``; ``tokens_per_s`` their quotient; ``speedup``
    that over ``base``'s (the pooled figure: sums of every call and trial); ``by_kind``, per
    prompt kind, ``tokens_per_s`` and ``speedup`` alike; ``mean_acceptance_length`` tokens
    emitted per verify step; ``acceptance_rate`` accepted over drafted tokens;
    ``acceptance_by_position`` the accepted fraction of the drafts at each draft position
    (``accepted_at`` over ``drafted_at``); ``drafted`` and ``accepted`` in all;
    ``draft_lengths`` the histogram of steps that asked for ``k`` drafts; ``time_s``
    seconds drafting, verifying and prefilling, summed over requests (a shared forward split
    by its rows). With ``base`` None, ratios are against ``p`` itself.
    """
    c = p.counters
    steps = c.get("verify_steps", 0)
    drafted_at, accepted_at = c.get("drafted_at", []), c.get("accepted_at", [])
    tps = per_second(p.tokens, p.seconds)
    by_kind = {}
    for kind, (tokens, seconds, _) in sorted(p.by_kind.items()):
        ref = (base or p).by_kind.get(kind, [0.0, 0.0, 0.0])
        by_kind[kind] = {
            "tokens_per_s": round(per_second(tokens, seconds), 2),
            "speedup": ratio(per_second(tokens, seconds), per_second(ref[0], ref[1])),
        }
    return {
        "tokens": p.tokens,
        "seconds": round(p.seconds, 4),
        "tokens_per_s": round(tps, 2),
        "speedup": ratio(tps, per_second((base or p).tokens, (base or p).seconds)),
        "by_kind": by_kind,
        "mean_acceptance_length": round(c.get("decode_tokens", 0) / steps, 3) if steps else 0.0,
        "acceptance_rate": ratio(c.get("accepted", 0), c.get("drafted", 0)),
        "acceptance_by_position": [
            round(a / d, 4) if d else 0.0 for a, d in zip(accepted_at, drafted_at, strict=False)
        ],
        "drafted_at": drafted_at,
        "accepted_at": accepted_at,
        "drafted": c.get("drafted", 0),
        "accepted": c.get("accepted", 0),
        "draft_lengths": c.get("draft_lengths", []),
        "time_s": {key.removesuffix("_time_s"): round(c.get(key, 0.0), 4) for key in TIMES},
    }


def _kind_rates(p: Pass, cpu: bool = False) -> dict[str, float]:
    """Tokens per second (of wall time, or of the process's CPU time) in all and per kind."""
    rates = {"all": per_second(p.tokens, p.cpu_seconds if cpu else p.seconds)}
    rates.update({kind: per_second(f[0], f[2] if cpu else f[1]) for kind, f in p.by_kind.items()})
    return rates


def trial_ratios(
    r: Run, base: Run, cpu: bool = False
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``ratio`` (or, ``cpu``, ``cpu_ratio``) and ``trials``: ``r`` against ``base`` by trial.

    ``ratio``: per prompt kind (``all``, ``grounded``, ``open``), the :func:`ratio_stats` of
    the per-trial ratios of tokens per wall second, each trial's calls summed. ``cpu_ratio``
    is the same over tokens per second of the process's CPU time, which another program's load
    sways less than wall time. ``trials``: each trial's ratios (``speedup``, per kind, to four
    places) and its ``drafted`` and ``accepted`` counts.
    """
    per_kind: dict[str, list[float]] = {}
    per_trial = []
    for mine, theirs in zip(r.trials, base.trials, strict=False):
        merged = merge(mine)
        own, ref = _kind_rates(merged, cpu), _kind_rates(merge(theirs), cpu)
        speedup = {}
        for kind, rate in own.items():
            if ref.get(kind):
                per_kind.setdefault(kind, []).append(rate / ref[kind])
                speedup[kind] = round(rate / ref[kind], 4)
        per_trial.append(
            {
                "speedup": speedup,
                "drafted": merged.counters.get("drafted", 0),
                "accepted": merged.counters.get("accepted", 0),
            }
        )
    stats = {kind: ratio_stats(ratios) for kind, ratios in sorted(per_kind.items())}
    return stats, per_trial


def paired_ratios(r: Run, base: Run) -> dict[str, dict[str, Any]]:
    """``paired_ratio``: per prompt kind, the statistics of each call's ratio to the baseline.

    Each ``generate`` call is set against the baseline's call of the same prompts, pass and
    trial, which ran just before or after it. A call and its baseline share the machine's
    load of that moment, so each pair cancels most of the drift that separates calls made
    minutes apart: the steadiest figure. Every call of every pass and trial is one ratio
    (``calls`` of them, in place of ``trials``); ``all`` pools the calls of every kind.
    """
    per_kind: dict[str, list[float]] = {}
    for mine, theirs in zip(r.trials, base.trials, strict=False):
        for p, b in zip(mine, theirs, strict=False):
            for (kind, tokens, seconds), (_, ref_tokens, ref_seconds) in zip(
                p.calls, b.calls, strict=False
            ):
                ref = per_second(ref_tokens, ref_seconds)
                if ref:
                    for key in ("all", kind):
                        per_kind.setdefault(key, []).append(per_second(tokens, seconds) / ref)
    return {kind: ratio_stats(ratios, "calls") for kind, ratios in sorted(per_kind.items())}


def fastest_ratios(r: Run, base: Run) -> dict[str, float]:
    """``fastest_ratio``: per prompt kind, the ratio counting each call's fastest trial.

    Another program's load only ever slows a call down, so each prompt group's fastest
    trial is the one least disturbed: the ratio of the sums of those calls' tokens and
    seconds (to four places) estimates a quiet machine's.
    """

    def fastest(run: Run) -> dict[str, list[float]]:
        sums: dict[str, list[float]] = {}
        calls = [[c for p in trial for c in p.calls] for trial in run.trials]
        for i in range(min((len(c) for c in calls), default=0)):
            kind, tokens, _ = calls[0][i]
            best = min(c[i][2] for c in calls)
            for key in ("all", kind):
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += tokens
                acc[1] += best
        return sums

    own, ref = fastest(r), fastest(base)
    return {
        kind: round(per_second(*own[kind]) / per_second(*ref[kind]), 4)
        for kind in sorted(own)
        if kind in ref and per_second(*ref[kind])
    }


def bench_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """``results`` of ``specdraft bench --json``: one row per run.

    Each row holds ``proposer``, ``policy`` and ``batch``; its :func:`figures` over all passes
    and trials pooled, and per pass index (``passes``); ``ratio`` and ``trials`` and
    ``cpu_ratio`` (:func:`trial_ratios`), ``fastest_ratio`` (:func:`fastest_ratios`),
    ``paired_ratio`` (:func:`paired_ratios`); ``identical_to_baseline`` (every output equal to
    plain decoding's token for token; None for the baseline); and its ``errors``. Ratios are
    against the baseline run of the same batch width (and pass, and trial); a width without
    one has empty ratio maps.
    """
    base_of = {r.batch: r for r in runs if r.proposer == BASELINE}
    rows = []
    for r in runs:
        base = base_of.get(r.batch)
        is_base = r is base
        row: dict[str, Any] = {"proposer": r.proposer, "policy": r.policy, "batch": r.batch}
        passes, base_passes = r.passes, None if base is None else base.passes
        row.update(figures(merge(passes), None if base_passes is None else merge(base_passes)))
        row["passes"] = [
            figures(p, None if base_passes is None else base_passes[i])
            for i, p in enumerate(passes)
        ]
        row["ratio"], row["trials"] = ({}, []) if base is None else trial_ratios(r, base)
        row["cpu_ratio"] = {} if base is None else trial_ratios(r, base, cpu=True)[0]
        row["fastest_ratio"] = {} if base is None else fastest_ratios(r, base)
        row["paired_ratio"] = {} if base is None else paired_ratios(r, base)
        row["identical_to_baseline"] = (
            None
            if is_base or base is None
            else all(
                p.outputs == b.outputs
                for mine, theirs in zip(r.trials, base.trials, strict=True)
                for p, b in zip(mine, theirs, strict=True)
            )
        )
        row["errors"] = [e for t in r.trials for p in t for e in p.errors]
        rows.append(row)
    return rows


@dataclass
class Stream:
    """What one streamed request of ``bench-serve`` measured (its ``error``, or its times)."""

    error: str | None = None
    # Seconds from sending the request to its first content chunk.
    ttft: float | None = None
    # Seconds between successive content chunks.
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    tpot: float | None = None


def time_per_output_token(first: float, last: float, tokens: int) -> float | None:
    """A request's ``tpot``: seconds from its first chunk to its last, per token after the first.

    None when it made fewer than two tokens (no time between tokens to speak of).
    """
    return (last - first) / (tokens - 1) if tokens > 1 else None


def serve_figures(streams: list[Stream], wall: float) -> dict[str, Any]:
    """The figures ``bench-serve`` prints over ``streams`` that ran in ``wall`` seconds.

    ``completed`` requests (without error) and ``errors`` (with ``error_samples``, up to five
    distinct messages); ``output_tokens`` the completed requests made; ``wall_s`` the run's
    seconds; ``throughput_tok_s`` and ``requests_per_s``, output tokens and completed requests
    per second of the whole run (all clients together); and the :func:`percentiles` of the
    completed requests' time to first token (``ttft_s``), of the gaps between successive
    content chunks as the client sees them (``chunk_gap_s``; a chunk holds every token one
    step emitted), and of each request's :func:`time_per_output_token` (``tpot_s``).
    """
    ok = [s for s in streams if s.error is None]
    errors = [s.error for s in streams if s.error is not None]
    tokens = sum(s.tokens for s in ok)
    return {
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "output_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": per_second(tokens, wall) if wall > 0 else 0.0,
        "requests_per_s": per_second(len(ok), wall) if wall > 0 else 0.0,
        "ttft_s": percentiles([s.ttft for s in ok if s.ttft is not None]),
        "chunk_gap_s": percentiles([g for s in ok for g in s.gaps]),
        "tpot_s": percentiles([s.tpot for s in ok if s.tpot is not None]),
    }
