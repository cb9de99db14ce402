"""specdraft.measure's figures against values worked out by hand from made-up calls.

Two trials of one pass each, a baseline and a proposer, each trial one call of grounded
prompts and one of open prompts (tokens, wall seconds, CPU seconds):

    trial 1  baseline  grounded 6 in 2.0 s (1.0)   open 4 in 4.0 s (2.0)
             proposer  grounded 6 in 1.0 s (0.8)   open 4 in 2.5 s (1.0)
    trial 2  baseline  grounded 6 in 3.0 s (1.5)   open 4 in 2.0 s (1.0)
             proposer  grounded 6 in 2.0 s (1.0)   open 4 in 2.5 s (1.25)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from specdraft.measure import (
    BASELINE,
    Pass,
    Run,
    Stream,
    bench_rows,
    fastest_ratios,
    figures,
    merge,
    paired_ratios,
    per_second,
    percentiles,
    ratio,
    ratio_stats,
    serve_figures,
    time_per_output_token,
    trial_ratios,
    turn_order,
)

# The proposer's three requests of a trial: two grounded, one open.
METRICS = [
    {
        "drafted": 4,
        "accepted": 2,
        "verify_steps": 2,
        "decode_tokens": 3,
        "drafted_at": [2, 2],
        "accepted_at": [2, 0],
        "draft_lengths": [0, 0, 2],
        "draft_time_s": 0.1,
        "verify_time_s": 0.5,
        "prefill_time_s": 0.2,
    },
    {
        "drafted": 2,
        "accepted": 1,
        "verify_steps": 1,
        "decode_tokens": 1,
        "drafted_at": [1, 1],
        "accepted_at": [1, 0],
        "draft_lengths": [0, 0, 1],
        "draft_time_s": 0.05,
        "verify_time_s": 0.25,
        "prefill_time_s": 0.1,
    },
    {
        "drafted": 3,
        "accepted": 0,
        "verify_steps": 3,
        "decode_tokens": 3,
        "drafted_at": [3],
        "accepted_at": [0],
        "draft_lengths": [0, 3],
        "draft_time_s": 0.1,
        "verify_time_s": 0.9,
        "prefill_time_s": 0.3,
    },
]


def result(tokens: list[int], metrics: dict | None = None, error: str | None = None):
    return SimpleNamespace(tokens=tokens, metrics=metrics or {}, error=error)


def one_pass(times: list[tuple[float, float]], drafts: bool, last: int = 4) -> Pass:
    """One pass: a grounded call of two requests (4 and 2 tokens), an open one of 4 tokens
    whose last token is ``last``; ``times`` the two calls' wall and CPU seconds."""
    m = METRICS if drafts else [{}, {}, {}]
    p = Pass()
    (g_wall, g_cpu), (o_wall, o_cpu) = times
    p.add([result([1, 2, 3, 4], m[0]), result([5, 6], m[1])], g_wall, "grounded", g_cpu)
    p.add([result([7, 8, 9, last], m[2])], o_wall, "open", o_cpu)
    return p


def runs(last: int = 4) -> tuple[Run, Run]:
    base = Run(BASELINE, None, 1, None)
    base.trials = [
        [one_pass([(2.0, 1.0), (4.0, 2.0)], False)],
        [one_pass([(3.0, 1.5), (2.0, 1.0)], False)],
    ]
    mine = Run("lookup", "fixed", 1, None)
    mine.trials = [
        [one_pass([(1.0, 0.8), (2.5, 1.0)], True)],
        [one_pass([(2.0, 1.0), (2.5, 1.25)], True, last)],
    ]
    return base, mine


def test_rates_and_ratios_guard_against_no_time() -> None:
    assert per_second(10, 4.0) == 2.5
    assert per_second(10, 0.0) == 0.0
    assert ratio(2.0, 3.0) == 0.667
    assert ratio(1.0, 0.0) == 0.0


def test_turn_order_rotates_by_trial_plus_call() -> None:
    assert turn_order(["a", "b", "c"], 0, 0) == ["a", "b", "c"]
    assert turn_order(["a", "b", "c"], 1, 1) == ["c", "a", "b"]
    assert turn_order(["a", "b", "c"], 2, 2) == ["b", "c", "a"]
    assert turn_order([], 3, 1) == []


def test_ratio_stats_of_two_ratios() -> None:
    # ln 2 and ln 1.5: geomean sqrt(3) = 1.73205; sample deviation ln(4/3) / sqrt(2), its
    # standard error ln(4/3) / 2 = 0.143841, times the geomean 0.249140.
    assert ratio_stats([2.0, 1.5], "calls") == {
        "calls": 2,
        "median": 1.75,
        "min": 1.5,
        "max": 2.0,
        "geomean": 1.7321,
        "stderr": 0.2491,
    }
    assert ratio_stats([0.0]) == {
        "trials": 0,
        "median": 0.0,
        "min": 0.0,
        "max": 0.0,
        "geomean": 0.0,
        "stderr": 0.0,
    }


def test_percentiles_take_the_nearest_rank_of_the_sorted_values() -> None:
    # Ranks ceil(0.5 * 4) = 2, ceil(0.9 * 4) = 4, ceil(0.99 * 4) = 4.
    assert percentiles([4.0, 1.0, 3.0, 2.0]) == {"p50": 2.0, "p90": 4.0, "p99": 4.0, "mean": 2.5}
    # Of five: ranks ceil(2.5) = 3, ceil(4.5) = 5 and ceil(4.95) = 5.
    assert percentiles([5.0, 1.0, 4.0, 2.0, 3.0]) == {
        "p50": 3.0,
        "p90": 5.0,
        "p99": 5.0,
        "mean": 3.0,
    }
    # Of ten: ranks 5, 9 and 10.
    ten = [float(v) for v in range(10, 0, -1)]
    assert percentiles(ten) == {"p50": 5.0, "p90": 9.0, "p99": 10.0, "mean": 5.5}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_a_pass_sums_its_calls_and_requests() -> None:
    p = one_pass([(1.0, 0.8), (2.5, 1.0)], True)
    assert (p.tokens, p.seconds, p.cpu_seconds) == (10, 3.5, 1.8)
    assert p.by_kind == {"grounded": [6.0, 1.0, 0.8], "open": [4.0, 2.5, 1.0]}
    assert p.calls == [("grounded", 6, 1.0), ("open", 4, 2.5)]
    assert p.outputs == [[1, 2, 3, 4], [5, 6], [7, 8, 9, 4]]
    assert p.counters["drafted_at"] == [6, 3] and p.counters["draft_lengths"] == [0, 3, 3]
    assert (p.counters["drafted"], p.counters["verify_steps"]) == (9, 6)
    both = merge([p, one_pass([(2.0, 1.0), (2.5, 1.25)], True)])
    assert (both.tokens, both.seconds, both.cpu_seconds) == (20, 8.0, 4.05)
    assert both.by_kind["open"] == [8.0, 5.0, 2.25]
    assert both.counters["accepted_at"] == [6, 0] and both.counters["decode_tokens"] == 14


def test_figures_of_one_pass_against_its_baseline() -> None:
    mine = one_pass([(1.0, 0.8), (2.5, 1.0)], True)
    base = one_pass([(2.0, 1.0), (4.0, 2.0)], False)
    f = figures(mine, base)
    assert (f["tokens"], f["seconds"], f["tokens_per_s"]) == (10, 3.5, 2.86)
    # 10 / 3.5 over 10 / 6 = 12 / 7 = 1.714.
    assert f["speedup"] == 1.714
    assert f["by_kind"] == {
        "grounded": {"tokens_per_s": 6.0, "speedup": 2.0},
        "open": {"tokens_per_s": 1.6, "speedup": 1.6},
    }
    # 7 tokens emitted over 6 verify steps; 3 of 9 drafts accepted; 3 of 6 and 0 of 3 by
    # position.
    assert f["mean_acceptance_length"] == 1.167
    assert f["acceptance_rate"] == 0.333
    assert f["acceptance_by_position"] == [0.5, 0.0]
    assert (f["drafted_at"], f["accepted_at"]) == ([6, 3], [3, 0])
    assert (f["drafted"], f["accepted"], f["draft_lengths"]) == (9, 3, [0, 3, 3])
    assert f["time_s"] == {"draft": 0.25, "verify": 1.65, "prefill": 0.6}
    # Without a baseline a pass is its own: every speedup 1.
    alone = figures(base, None)
    assert alone["speedup"] == 1.0 and alone["tokens_per_s"] == 1.67
    assert alone["mean_acceptance_length"] == 0.0 and alone["acceptance_rate"] == 0.0


def test_trial_ratios_set_each_trial_against_the_baselines() -> None:
    base, mine = runs()
    stats, trials = trial_ratios(mine, base)
    # all: 12/7 = 1.714286 then (10/4.5)/(10/5) = 10/9 = 1.111111; grounded 2.0 then 1.5;
    # open 1.6 then 0.8.
    assert [t["speedup"] for t in trials] == [
        {"all": 1.7143, "grounded": 2.0, "open": 1.6},
        {"all": 1.1111, "grounded": 1.5, "open": 0.8},
    ]
    assert [(t["drafted"], t["accepted"]) for t in trials] == [(9, 3), (9, 3)]
    assert stats["grounded"]["median"] == 1.75 and stats["grounded"]["trials"] == 2
    # (12/7 + 10/9) / 2 = 1.412698; geomean sqrt(120/63) = 1.380131.
    assert stats["all"]["median"] == 1.4127 and stats["all"]["geomean"] == 1.3801
    assert (stats["open"]["min"], stats["open"]["max"]) == (0.8, 1.6)
    # Over CPU time: grounded (6/0.8)/(6/1.0) = 1.25 then (6/1.0)/(6/1.5) = 1.5; all
    # (10/1.8)/(10/3.0) = 1.666667 then (10/2.25)/(10/2.5) = 1.111111.
    cpu, _ = trial_ratios(mine, base, cpu=True)
    assert cpu["grounded"]["median"] == 1.375
    assert (cpu["all"]["min"], cpu["all"]["max"]) == (1.1111, 1.6667)


def test_paired_ratios_set_each_call_against_the_baselines_same_call() -> None:
    base, mine = runs()
    paired = paired_ratios(mine, base)
    # Calls: grounded 2.0 and 1.5, open 1.6 and 0.8; all four pooled, median (1.5 + 1.6) / 2.
    assert {k: v["calls"] for k, v in paired.items()} == {"all": 4, "grounded": 2, "open": 2}
    assert paired["all"]["median"] == 1.55
    assert (paired["all"]["min"], paired["all"]["max"]) == (0.8, 2.0)
    assert paired["open"]["median"] == 1.2


def test_fastest_ratios_count_each_calls_fastest_trial() -> None:
    base, mine = runs()
    # Baseline's fastest calls: grounded 2.0 s, open 2.0 s; the proposer's 1.0 s and 2.5 s.
    # all: (10 / 3.5) / (10 / 4.0) = 8/7.
    assert fastest_ratios(mine, base) == {"all": 1.1429, "grounded": 2.0, "open": 0.8}
    assert fastest_ratios(base, base) == {"all": 1.0, "grounded": 1.0, "open": 1.0}


def test_bench_rows_hold_every_figure_and_compare_outputs() -> None:
    base, mine = runs()
    rows = bench_rows([base, mine])
    assert [r["proposer"] for r in rows] == [BASELINE, "lookup"]
    b, m = rows
    assert b["identical_to_baseline"] is None and m["identical_to_baseline"] is True
    assert b["paired_ratio"]["all"]["median"] == 1.0 and b["ratio"]["all"]["stderr"] == 0.0
    # Pooled over both trials: 20 tokens in 8.0 s against 20 in 11.0 s.
    assert (m["tokens"], m["seconds"], m["speedup"]) == (20, 8.0, 1.375)
    assert m["fastest_ratio"]["all"] == 1.1429 and m["paired_ratio"]["all"]["median"] == 1.55
    assert m["cpu_ratio"]["grounded"]["median"] == 1.375
    assert len(m["passes"]) == 1 and m["passes"][0]["speedup"] == 1.375
    assert m["errors"] == []
    # One token of one output changed: the row no longer matches plain decoding.
    base, other = runs(last=5)
    assert bench_rows([base, other])[1]["identical_to_baseline"] is False
    # A width without a baseline has no ratios to give.
    (alone,) = bench_rows([mine])
    assert alone["ratio"] == alone["paired_ratio"] == alone["fastest_ratio"] == {}
    assert alone["identical_to_baseline"] is None and alone["speedup"] == 1.0


def test_time_per_output_token_spreads_first_to_last_over_the_later_tokens() -> None:
    assert time_per_output_token(1.0, 2.5, 4) == 0.5
    assert time_per_output_token(1.0, 1.0, 1) is None


def test_serve_figures_count_completed_requests_and_their_latencies() -> None:
    streams = [
        Stream(ttft=0.1, gaps=[0.2, 0.4], tokens=3, tpot=0.3),
        Stream(ttft=0.3, gaps=[0.1], tokens=2, tpot=0.1),
        # A request that failed part way counts none of its tokens.
        Stream(error="x", tokens=7),
        Stream(error="x"),
        Stream(error="a"),
    ]
    f = serve_figures(streams, 2.0)
    assert (f["completed"], f["errors"], f["error_samples"]) == (2, 3, ["a", "x"])
    assert (f["output_tokens"], f["wall_s"]) == (5, 2.0)
    assert (f["throughput_tok_s"], f["requests_per_s"]) == (2.5, 1.0)
    assert f["ttft_s"] == {"p50": 0.1, "p90": 0.3, "p99": 0.3, "mean": pytest.approx(0.2)}
    assert f["chunk_gap_s"]["p50"] == 0.2 and f["chunk_gap_s"]["p99"] == 0.4
    assert f["tpot_s"]["p50"] == 0.1 and f["tpot_s"]["p90"] == 0.3
    empty = serve_figures([], 0.0)
    assert (empty["throughput_tok_s"], empty["ttft_s"]["p50"]) == (0.0, None)
    assert math.isclose(serve_figures(streams[:1], 0.5)["throughput_tok_s"], 6.0)
