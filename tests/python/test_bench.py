"""The draft policy from Python (``SpecEngine(draft_policy=...)``, the draft-length
histogram) and ``specdraft bench`` with batch widths, repeated passes, policies, the
proposer table and plots, on a tiny random model."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import specdraft

gguf = pytest.importorskip("gguf")
from test_engine import _load, write_tiny_chat_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


def test_the_policy_is_chosen_by_name_and_reported_per_request(tiny, gpu) -> None:
    model = _load(tiny, gpu)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]]
    plain = [list(r.tokens) for r in specdraft.SpecEngine(model).generate(prompts, 24)]
    lookup = specdraft.PromptLookup()
    assert specdraft.SpecEngine(model, lookup).draft_policy == "adaptive"
    for policy in ("adaptive", "fixed"):
        engine = specdraft.SpecEngine(model, lookup, num_drafts=3, draft_policy=policy)
        assert engine.draft_policy == policy and policy in repr(engine)
        results = engine.generate(prompts, 24, ignore_eos=True)
        assert [list(r.tokens) for r in results] == plain
        for r in results:
            lengths = r.metrics["draft_lengths"]
            assert len(lengths) <= 4, lengths
            # One count a step that could draft: never more than the verify steps.
            assert 0 < sum(lengths) <= r.metrics["verify_steps"]
            if policy == "fixed":
                assert lengths[0] == 0, "fixed never asks for 0"
    with pytest.raises(specdraft.SpecdraftError, match='draft_policy: "greedy"'):
        specdraft.SpecEngine(model, lookup, draft_policy="greedy")


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from specdraft.cli import main

    code = main(["bench", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _common(tiny: Path) -> list[str]:
    return ["--model", str(tiny), "--device", "cpu", "--max-seq-len", "1024"]


def test_bench_rows_cover_every_proposer_width_policy_and_pass(tiny, capsys) -> None:
    from specdraft.bench import PROPOSERS

    args = [*_common(tiny), "--prompts", "3", "--max-tokens", "6", "--json"]
    args += ["--batch", "1,2", "--repeat", "2", "--draft-policy", "adaptive,fixed"]
    code, out, err = _bench(capsys, *args)
    assert code == 0, err
    report = json.loads(out)
    # The CPU's kernels say which instruction set they ran on.
    cpu = specdraft.CpuBackend()
    assert report["device"] == f"CpuBackend ({cpu.instruction_set}, {cpu.threads} threads)"
    assert (report["batch"], report["repeat"]) == ([1, 2], 2)
    assert report["draft_policies"] == ["adaptive", "fixed"]
    # The tiny model has no shipped draft head: the rows of the heads and the hybrid are left
    # out, with a note each.
    heads = ("mtp", "eagle3", "dflash", "hybrid")
    proposers = [n for n in PROPOSERS if n not in ("baseline", *heads)]
    assert {"prompt-lookup", "suffix", "random"} <= set(proposers)
    assert all(f"no {n} row" in err for n in heads), err
    want = []
    for width in (1, 2):
        want.append(("baseline", None, width))
        want += [(n, p, width) for n in proposers for p in ("adaptive", "fixed")]
    rows = report["results"]
    assert [(r["proposer"], r["policy"], r["batch"]) for r in rows] == want
    tokens_of = {r["batch"]: r["tokens"] for r in rows if r["proposer"] == "baseline"}
    for r in rows:
        assert len(r["passes"]) == 2
        assert r["tokens"] == sum(p["tokens"] for p in r["passes"])
        assert r["tokens"] == tokens_of[r["batch"]]
        assert r["errors"] == []
        if r["proposer"] == "baseline":
            assert r["speedup"] == 1.0 and r["identical_to_baseline"] is None
            assert all(p["speedup"] == 1.0 for p in r["passes"])
            assert r["draft_lengths"] == []
        else:
            assert r["identical_to_baseline"] is True
            assert r["passes"][1]["by_kind"]["grounded"]["tokens_per_s"] > 0
            if r["policy"] == "fixed":
                assert r["draft_lengths"][0] == 0
    assert "pass 2/2, batch 2" in err


def test_tree_proposers_run_when_named_under_the_shape_asked(tiny, capsys, monkeypatch) -> None:
    from specdraft.cli_engine import make_proposer

    assert make_proposer("suffix-tree").grows_trees()
    assert make_proposer("prompt-lookup-tree").grows_trees()
    assert not make_proposer("suffix").grows_trees()
    shapes: list[str] = []
    engine = specdraft.SpecEngine

    def recording(*args: object, **kwargs: object) -> object:
        shapes.append(str(kwargs.get("draft_shape")))
        return engine(*args, **kwargs)

    monkeypatch.setattr(specdraft, "SpecEngine", recording)
    base = [*_common(tiny), "--prompts", "2", "--max-tokens", "6", "--json"]
    for shape in ("tree", "chain"):
        shapes.clear()
        code, out, err = _bench(
            capsys, *base, "--proposer", "suffix-tree,prompt-lookup-tree", "--draft-shape", shape
        )
        assert code == 0, err
        report = json.loads(out)
        assert report["draft_shape"] == shape
        rows = {r["proposer"]: r for r in report["results"]}
        assert set(rows) == {"baseline", "suffix-tree", "prompt-lookup-tree"}
        assert all(r["identical_to_baseline"] for n, r in rows.items() if n != "baseline")
        # Both proposer engines were built under the shape asked; the baseline's takes none.
        assert shapes.count(shape) == 2, shapes


def test_a_proposer_added_to_the_table_gets_its_rows(tiny, capsys, monkeypatch) -> None:
    from specdraft import bench

    monkeypatch.setitem(
        bench.PROPOSERS, "lookup-2", lambda model, model_name: specdraft.PromptLookup()
    )
    code, out, err = _bench(capsys, *_common(tiny), "--prompts", "1", "--max-tokens", "4")
    assert code == 0, err
    assert "lookup-2" in out and "random" in out
    code, out, err = _bench(
        capsys, *_common(tiny), "--prompts", "1", "--max-tokens", "4", "--proposer", "lookup-2"
    )
    assert code == 0, err
    lines = [line.split()[0] for line in out.splitlines()[3:]]
    assert lines == ["baseline", "lookup-2"]


def test_bad_bench_options_are_named(tiny, capsys) -> None:
    for extra, message in [
        (["--batch", "1,x"], "--batch '1,x': 'x' is not a whole number"),
        (["--batch", "0"], "each width must be at least 1"),
        (["--draft-policy", "greedy"], "--draft-policy 'greedy'"),
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--trials", "0"], "--trials must be at least 1"),
        (["--proposer", "nonesuch"], "--proposer 'nonesuch'"),
    ]:
        code, _, err = _bench(capsys, *_common(tiny), *extra)
        assert code == 2 and message in err, (extra, err)


def test_plot_needs_matplotlib_and_says_so(tiny, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    png = tmp_path / "bench.png"
    code, _, err = _bench(capsys, *_common(tiny), "--prompts", "1", "--plot", str(png))
    assert code == 2 and "pip install 'specdraft[plot]'" in err
    assert not png.exists()


def test_plot_draws_a_png(tiny, capsys, tmp_path) -> None:
    # matplotlib is in the test extra: without it this fails rather than skips.
    png = tmp_path / "bench.png"
    args = [*_common(tiny), "--prompts", "2", "--max-tokens", "4", "--batch", "1,2"]
    code, _, err = _bench(capsys, *args, "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_pools_acceptance_over_widths_and_leaves_a_gap_for_a_missing_row() -> None:
    from specdraft.bench_plot import plot_data

    def row(proposer: str, policy: str | None, batch: int, tps: float, drafted, accepted):
        return {
            "proposer": proposer,
            "policy": policy,
            "batch": batch,
            "tokens_per_s": tps,
            "drafted_at": drafted,
            "accepted_at": accepted,
        }

    rows = [
        row("baseline", None, 1, 20.0, [], []),
        row("lookup", "fixed", 1, 30.0, [10, 5], [5, 1]),
        row("lookup", "adaptive", 1, 25.0, [4], [0]),
        row("baseline", None, 4, 60.0, [], []),
        # A longer histogram at the second width, and no adaptive row there.
        row("lookup", "fixed", 4, 70.0, [30, 15, 5], [15, 5, 4]),
    ]
    data = plot_data(rows)
    assert data.widths == [1, 4]
    # Three bars a width, 0.8 / 3 wide, centred on the width's tick.
    step = 0.8 / 3
    assert data.bar_width == pytest.approx(step)
    labels = [label for label, _, _ in data.bars]
    assert labels == ["baseline", "lookup (fixed)", "lookup (adaptive)"]
    xs = {label: x for label, x, _ in data.bars}
    ys = {label: y for label, _, y in data.bars}
    assert xs["baseline"] == pytest.approx([-step, 1 - step])
    assert xs["lookup (fixed)"] == pytest.approx([0.0, 1.0])
    assert xs["lookup (adaptive)"] == pytest.approx([step])
    assert ys == {
        "baseline": [20.0, 60.0],
        "lookup (fixed)": [30.0, 70.0],
        "lookup (adaptive)": [25.0],
    }
    # Pooled counts, not a mean of rates: (5 + 15) / (10 + 30), (1 + 5) / (5 + 15), 4 / 5.
    # The baseline drafted nothing and has no curve.
    assert data.acceptance == [("lookup (fixed)", [0.5, 0.3, 0.8]), ("lookup (adaptive)", [0.0])]


def test_ratio_stats_summarise_per_trial_ratios() -> None:
    from specdraft.measure import ratio_stats

    # Log ratios ln 0.5, ln 1, ln 2, ln 1: mean 0 (geomean 1), sample deviation
    # ln 2 * sqrt(2/3), standard error that over 2.
    got = ratio_stats([0.5, 1.0, 2.0, 1.0])
    assert (got["trials"], got["median"], got["min"], got["max"]) == (4, 1.0, 0.5, 2.0)
    assert got["geomean"] == 1.0
    assert got["stderr"] == round(math.log(2) * math.sqrt(2 / 3) / 2, 4)
    # One trial has no spread; a trial without tokens (ratio 0) is left out.
    assert ratio_stats([1.25, 0.0]) == {
        "trials": 1,
        "median": 1.25,
        "min": 1.25,
        "max": 1.25,
        "geomean": 1.25,
        "stderr": 0.0,
    }
    assert ratio_stats([])["trials"] == 0


def test_trials_report_each_ratio_over_fresh_engines(tiny, capsys) -> None:
    args = [*_common(tiny), "--prompts", "10", "--max-tokens", "5", "--json"]
    args += ["--batch", "1,4", "--trials", "3", "--proposer", "prompt-lookup,suffix"]
    args += ["--schedule", "static"]
    code, out, err = _bench(capsys, *args)
    assert code == 0, err
    report = json.loads(out)
    assert report["trials"] == 3
    # At batch 4: two calls of grounded prompts, then one of the two open ones.
    assert "trial 3/3, pass 1/1, batch 4: 3/3 calls" in err
    rows = report["results"]
    base_tokens = {r["batch"]: r["tokens"] for r in rows if r["proposer"] == "baseline"}
    for r in rows:
        ratio = r["ratio"]
        # Eight grounded prompts, then two open: each kind has a ratio per trial, of wall
        # time and of CPU time.
        assert set(ratio) == set(r["cpu_ratio"]) == {"all", "grounded", "open"}, ratio
        for stats in [*ratio.values(), *r["cpu_ratio"].values()]:
            assert stats["trials"] == 3
            assert stats["min"] <= stats["median"] <= stats["max"]
            assert stats["min"] <= stats["geomean"] <= stats["max"]
        # One paired ratio for every call of every trial.
        calls = {1: {"grounded": 24, "open": 6}, 4: {"grounded": 6, "open": 3}}[r["batch"]]
        calls["all"] = calls["grounded"] + calls["open"]
        assert {k: v["calls"] for k, v in r["paired_ratio"].items()} == calls, r["paired_ratio"]
        # The per-request timings add up to no more than the calls' wall time.
        times = r["time_s"]
        assert times["verify"] > 0 and times["prefill"] > 0
        assert sum(times.values()) <= r["seconds"] + 1e-3, (times, r["seconds"])
        if r["proposer"] == "baseline":
            assert times["draft"] == 0.0
            for stats in [*ratio.values(), *r["cpu_ratio"].values(), *r["paired_ratio"].values()]:
                assert stats["median"] == 1.0 and stats["stderr"] == 0.0
        else:
            assert r["identical_to_baseline"] is True
        # Pooled over the trials: three times one trial's tokens, the same for every row.
        assert r["tokens"] == base_tokens[r["batch"]] and r["tokens"] % 3 == 0
        assert len(r["trials"]) == 3 and len(r["passes"]) == 1
    # Fresh engines each trial: under the fixed policy the suffix drafter, which learns
    # across requests, drafts and hits exactly alike in every trial (a warm one would
    # recall the first trial's outputs in the second).
    code, out, err = _bench(capsys, *args, "--draft-policy", "fixed", "--prompts", "2")
    assert code == 0, err
    (suffix,) = [
        r for r in json.loads(out)["results"] if r["proposer"] == "suffix" and r["batch"] == 1
    ]
    counts = {(t["drafted"], t["accepted"]) for t in suffix["trials"]}
    assert len(counts) == 1 and suffix["drafted"] > 0, suffix["trials"]
    table = [a for a in args if a != "--json"]
    code, out, err = _bench(capsys, *table, "--trials", "2")
    assert code == 0, err
    assert "over 2 trials: median of each call" in out and "+-" in out


def test_the_fastest_trial_of_each_prompt_group_makes_the_fastest_ratio() -> None:
    from specdraft.measure import Pass as _Pass
    from specdraft.measure import Run as _Run
    from specdraft.measure import bench_rows

    def run(name: str, *trials: list[tuple[str, int, float]]) -> _Run:
        r = _Run(name, None, 4, None)
        for calls in trials:
            p = _Pass()
            for kind, tokens, seconds in calls:
                p.tokens += tokens
                p.seconds += seconds
                acc = p.by_kind.setdefault(kind, [0.0, 0.0, 0.0])
                acc[0] += tokens
                acc[1] += seconds
                p.calls.append((kind, tokens, seconds))
            r.trials.append([p])
        return r

    base = run(
        "baseline",
        [("grounded", 10, 1.0), ("open", 10, 4.0)],
        [
            ("grounded", 10, 2.0),
            ("open", 10, 2.0),
        ],
    )
    mine = run(
        "lookup",
        [("grounded", 10, 0.5), ("open", 10, 3.0)],
        [
            ("grounded", 10, 0.8),
            ("open", 10, 2.5),
        ],
    )
    rows = bench_rows([base, mine])
    # Fastest calls: baseline 1.0 s grounded and 2.0 s open; lookup 0.5 s and 2.5 s.
    assert rows[1]["fastest_ratio"] == {"all": 1.0, "grounded": 2.0, "open": 0.8}
    assert rows[0]["fastest_ratio"] == {"all": 1.0, "grounded": 1.0, "open": 1.0}
    # The per-trial ratios: grounded 2.0 then 2.5, open 4/3 then 0.8.
    assert rows[1]["ratio"]["grounded"]["median"] == 2.25
    assert rows[1]["ratio"]["open"]["min"] == 0.8
    # Paired, call by call against the baseline's: the same four ratios, and all of them
    # pooled: 0.8, 4/3, 2.0, 2.5.
    paired = rows[1]["paired_ratio"]
    assert paired["grounded"]["median"] == 2.25 and paired["grounded"]["calls"] == 2
    assert (paired["open"]["min"], paired["open"]["max"]) == (0.8, 1.3333)
    assert paired["all"]["median"] == 1.6667 and paired["all"]["calls"] == 4
    assert rows[0]["paired_ratio"]["all"]["median"] == 1.0


def test_each_static_call_holds_one_prompt_kind_and_each_prompt_once() -> None:
    from specdraft.bench import prompt_groups

    kinds = ["grounded"] * 3 + ["open"] * 2 + ["grounded"]
    # Kinds in the order they first appear; a kind's last call holds the prompts left.
    assert prompt_groups(kinds, 4, "static") == [("grounded", [0, 1, 2, 5]), ("open", [3, 4])]
    assert prompt_groups(kinds, 3, "static") == [
        ("grounded", [0, 1, 2]),
        ("grounded", [5]),
        ("open", [3, 4]),
    ]
    grounded, open_ = [("grounded", [i]) for i in (0, 1, 2, 5)], [("open", [3]), ("open", [4])]
    assert prompt_groups(kinds, 1, "static") == grounded + open_


def test_a_pass_holds_every_prompt_exactly_once_whatever_the_width() -> None:
    from specdraft.bench import SCHEDULES, prompt_groups
    from specdraft.bench_prompts import PROMPTS

    # The built-in set (eight grounded, four open) and a ragged mix, at widths that divide
    # their kinds' counts and widths that do not.
    for kinds in [[p.kind for p in PROMPTS], ["a", "b", "a", "a", "c", "b", "a"]]:
        for schedule in SCHEDULES:
            for width in range(1, len(kinds) + 3):
                calls = prompt_groups(kinds, width, schedule)
                held = sorted(i for _, members in calls for i in members)
                assert held == list(range(len(kinds))), (schedule, width, calls)
                assert all(kinds[i] == kind for kind, members in calls for i in members)
                if schedule == "static":
                    assert all(1 <= len(members) <= width for _, members in calls)


def test_a_queued_schedule_hands_each_kind_to_the_scheduler_in_one_call() -> None:
    from specdraft.bench import prompt_groups

    kinds = ["grounded"] * 3 + ["open"] * 2 + ["grounded"]
    # Every prompt of a kind in one call, however few it has.
    assert prompt_groups(kinds, 2, "queued") == [("grounded", [0, 1, 2, 5]), ("open", [3, 4])]
    # The function's default is the command's.
    assert prompt_groups(kinds, 2) == prompt_groups(kinds, 2, "queued")
    assert prompt_groups(kinds, 3, "queued") == [("grounded", [0, 1, 2, 5]), ("open", [3, 4])]
    # One slot runs the prompts one after another either way: a call each.
    assert prompt_groups(kinds, 1, "queued") == prompt_groups(kinds, 1, "static")
    with pytest.raises(ValueError, match="--schedule 'fifo'"):
        prompt_groups(kinds, 2, "fifo")


def test_the_schedule_decides_the_calls_and_never_the_text(tiny, capsys) -> None:
    # The first five built-in prompts are grounded: at batch 2 a static schedule makes three
    # calls of them (the last holding one), a queued one a single call.
    args = [*_common(tiny), "--prompts", "5", "--max-tokens", "6", "--json", "--batch", "2"]
    args += ["--proposer", "prompt-lookup"]
    calls = {}
    for schedule, want in [("static", 3), ("queued", 1)]:
        code, out, err = _bench(capsys, *args, "--schedule", schedule)
        assert code == 0, err
        report = json.loads(out)
        assert report["schedule"] == schedule
        baseline, lookup = report["results"]
        assert lookup["identical_to_baseline"] is True and lookup["errors"] == []
        assert lookup["paired_ratio"]["grounded"]["calls"] == want
        calls[schedule] = baseline["tokens"]
    # Either way each prompt runs once, to the same text.
    assert calls["static"] == calls["queued"] > 0


def test_every_run_goes_first_once_in_every_call_over_as_many_trials() -> None:
    from specdraft.measure import turn_order

    # Two runs and an even number of calls a trial, three runs and a multiple of three: the
    # counts a rotation by a running total of calls would give the same order every trial.
    for runs, calls in [(["baseline", "lookup"], 16), (["a", "b", "c"], 6), (["a", "b", "c"], 7)]:
        for call in range(calls):
            orders = [turn_order(runs, trial, call) for trial in range(len(runs))]
            assert all(sorted(o) == sorted(runs) for o in orders), orders
            assert sorted(o[0] for o in orders) == sorted(runs), (call, orders)
        # Within a trial, consecutive calls rotate too.
        assert turn_order(runs, 0, 0)[0] != turn_order(runs, 0, 1)[0]
    assert turn_order([], 3, 5) == []


def test_a_control_row_is_plain_decoding_paired_like_a_proposer(tiny, capsys) -> None:
    args = [*_common(tiny), "--prompts", "4", "--max-tokens", "5", "--json", "--trials", "2"]
    args += ["--batch", "1,2", "--proposer", "prompt-lookup"]
    code, out, err = _bench(capsys, *args, "--control")
    assert code == 0, err
    report = json.loads(out)
    assert report["control"] is True
    rows = report["results"]
    order = [(r["proposer"], r["batch"]) for r in rows]
    assert order == [
        (name, width) for width in (1, 2) for name in ("baseline", "control", "prompt-lookup")
    ]
    by = {(r["proposer"], r["batch"]): r for r in rows}
    for width in (1, 2):
        control, lookup = by["control", width], by["prompt-lookup", width]
        # A second plain engine: the baseline's text, no drafting, and ratios paired call by
        # call with the baseline's, as many calls as a proposer's row has.
        assert control["identical_to_baseline"] is True and control["errors"] == []
        assert control["drafted"] == 0 and control["draft_lengths"] == []
        assert control["time_s"]["draft"] == 0.0
        assert control["tokens"] == by["baseline", width]["tokens"]
        calls = {k: v["calls"] for k, v in lookup["paired_ratio"].items()}
        assert {k: v["calls"] for k, v in control["paired_ratio"].items()} == calls
        assert {k: v["trials"] for k, v in control["ratio"].items()} == dict.fromkeys(calls, 2)
    assert "  control: " in err, err
    # Without the option, no control row.
    code, out, err = _bench(capsys, *args)
    assert code == 0, err
    report = json.loads(out)
    assert report["control"] is False
    assert [r["proposer"] for r in report["results"]].count("control") == 0
    code, out, err = _bench(capsys, *[a for a in args if a != "--json"], "--control")
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[3:]] == [
        "baseline",
        "control",
        "prompt-lookup",
    ] * 2


def test_every_engine_makes_the_same_warm_up_call_before_it_is_measured(
    tiny, capsys, monkeypatch
) -> None:
    from specdraft import bench

    real = specdraft.SpecEngine
    engines: list[Recorded] = []
    # Every engine's generate calls and a Python proposer's propose calls, in order.
    events: list[tuple[object, str]] = []

    class Recorded:
        """A SpecEngine that records each call made of it."""

        def __init__(self, model, proposer=None, **options) -> None:
            self.engine = real(model, proposer, **options)
            self.proposer = proposer
            self.calls: list[tuple[list[list[int]], int]] = []
            engines.append(self)

        def generate(self, prompts, max_tokens, **options):
            self.calls.append(([list(p) for p in prompts], max_tokens))
            events.append((self, "generate"))
            return self.engine.generate(prompts, max_tokens=max_tokens, **options)

    class Recording(bench.RandomDrafter):
        def propose(self, *args, **kwargs) -> list[int]:
            events.append((self, "propose"))
            return super().propose(*args, **kwargs)

    monkeypatch.setattr(specdraft, "SpecEngine", Recorded)
    monkeypatch.setitem(bench.PROPOSERS, "recording", lambda model, name: Recording())
    args = [*_common(tiny), "--prompts", "3", "--max-tokens", "5", "--json", "--control"]
    args += ["--batch", "1,2", "--trials", "2", "--proposer", "recording,suffix"]
    code, out, err = _bench(capsys, *args)
    assert code == 0, err
    # One engine for each of baseline, control, recording and suffix, at each width, in each
    # trial, and no other.
    assert len(engines) == 2 * 2 * 4, [type(e.proposer).__name__ for e in engines]
    kinds = {type(e.proposer).__name__ for e in engines}
    assert kinds == {"NoneType", "Recording", "SuffixDecoding"}, kinds
    # Each one's first call is the warm-up, the same call for all, and no measured call is it.
    warm = engines[0].calls[0]
    assert all(e.calls[0] == warm for e in engines), [e.calls[0] for e in engines]
    measured = [c for e in engines for c in e.calls[1:]]
    assert measured and all(c[1] == 5 for c in measured)
    # Its prompt is none of the measured ones: a drafter learning from it learns no reply.
    assert warm[0][0] not in [p for prompts, _ in measured for p in prompts]
    # The warm-up reached the Python proposer: it drafted during each of its engines'.
    for e in engines:
        if isinstance(e.proposer, Recording):
            first = events.index((e, "generate"))
            following = events[first + 1 :]
            end = next(
                (i for i, (_, what) in enumerate(following) if what == "generate"),
                len(following),
            )
            assert (e.proposer, "propose") in following[:end]
    # The warm-up is not counted: every row generated the baseline's measured tokens.
    rows = json.loads(out)["results"]
    base = {r["batch"]: r["tokens"] for r in rows if r["proposer"] == "baseline"}
    assert all(r["tokens"] == base[r["batch"]] for r in rows)


def test_the_bench_flags_a_row_whose_output_differs_from_plain_decoding(
    tiny, capsys, monkeypatch
) -> None:
    from types import SimpleNamespace

    real = specdraft.SpecEngine
    made: list[int] = []

    class Tampered:
        """A SpecEngine that, on the prompt-lookup engine at batch 2 of the second trial,
        changes the last token of one output of its second measured call (pass 2)."""

        def __init__(self, model, proposer=None, **options) -> None:
            self.engine = real(model, proposer, **options)
            lookup = isinstance(proposer, specdraft.PromptLookup)
            if lookup and options.get("max_batch") == 2:
                made.append(1)
            self.tamper = lookup and options.get("max_batch") == 2 and len(made) == 2
            self.measured = 0

        def generate(self, prompts, max_tokens, **options):
            results = self.engine.generate(prompts, max_tokens=max_tokens, **options)
            if max_tokens != 6:  # the warm-up
                return results
            self.measured += 1
            if not (self.tamper and self.measured == 2):
                return results
            r = results[0]
            tokens = [*r.tokens[:-1], r.tokens[-1] + 1]
            return [SimpleNamespace(tokens=tokens, metrics=r.metrics, error=r.error), *results[1:]]

    monkeypatch.setattr(specdraft, "SpecEngine", Tampered)
    args = [*_common(tiny), "--prompts", "3", "--max-tokens", "6", "--batch", "1,2"]
    args += ["--repeat", "2", "--trials", "2", "--proposer", "prompt-lookup,suffix"]
    code, out, err = _bench(capsys, *args, "--json")
    assert made == [1, 1], "one prompt-lookup engine at batch 2 in each trial"
    # The run fails, naming the row; every other row matches the baseline's text.
    assert code == 1, err
    differs = [line for line in err.splitlines() if "output differs" in line]
    assert differs == [
        "specdraft bench: prompt-lookup (adaptive, batch 2): output differs from plain decoding"
    ]
    rows = json.loads(out)["results"]
    same = {(r["proposer"], r["batch"]): r["identical_to_baseline"] for r in rows}
    assert same == {
        ("baseline", 1): None,
        ("prompt-lookup", 1): True,
        ("suffix", 1): True,
        ("baseline", 2): None,
        ("prompt-lookup", 2): False,
        ("suffix", 2): True,
    }
    # Only the text differs: the count of tokens is the baseline's.
    assert len({r["tokens"] for r in rows if r["batch"] == 2}) == 1
    # The table says so too.
    made.clear()
    code, out, err = _bench(capsys, *args)
    assert code == 1, err
    marks = {tuple(line.split()[:3:2]): line.split()[-1] for line in out.splitlines()[3:]}
    assert marks == {
        ("baseline", "1"): "-",
        ("prompt-lookup", "1"): "yes",
        ("suffix", "1"): "yes",
        ("baseline", "2"): "-",
        ("prompt-lookup", "2"): "NO",
        ("suffix", "2"): "yes",
    }, out


def test_head_tree_proposers_are_the_shipped_heads_growing_trees(monkeypatch) -> None:
    import specdraft.bench as bench

    class Head:
        grows: bool | None = None

        def set_grow_trees(self, on: bool) -> None:
            self.grows = on

    kinds: list[str] = []

    def shipped(model: object, model_name: str | None, kind: str = "mtp") -> Head:
        kinds.append(kind)
        return Head()

    monkeypatch.setattr(bench, "shipped_head_for", shipped)
    for name in ("mtp-tree", "eagle3-tree"):
        head = bench.ON_REQUEST[name](object(), None)
        assert head.grows is True, name
    assert kinds == ["mtp", "eagle3"]
    # hybrid-tree: suffix decoding's trees, then the best head growing trees.
    import specdraft.heads as heads

    built: list[tuple[list[object], int]] = []
    monkeypatch.setattr(bench, "_model_file_for_head", lambda model, name, proposer: "m.gguf")
    monkeypatch.setattr(heads, "best_head_for", lambda path: "best")
    monkeypatch.setattr(heads, "load_draft_head", lambda name, model: Head())
    monkeypatch.setattr(
        specdraft, "Hybrid", lambda members, target_layers: built.append((members, target_layers))
    )

    class Model:
        class config:  # noqa: N801 - the attribute path a model has
            num_hidden_layers = 30

    for name, trees in (("hybrid-tree", True), ("hybrid", False)):
        built.clear()
        table = bench.ON_REQUEST if trees else bench.PROPOSERS
        table[name](Model(), None)
        ((suffix, head), layers) = built[0]
        assert layers == 30 and suffix.trees is trees, name
        assert head.grows is (True if trees else None), name
