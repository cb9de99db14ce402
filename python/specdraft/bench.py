"""``specdraft bench`` on a model: plain decoding against every proposer.

Every proposer runs at several batch widths, under one or more draft policies.

Each proposer of :data:`PROPOSERS` (or each ``--proposer``) gets one engine per batch width
and draft policy, and the built-in prompt set (:mod:`specdraft.bench_prompts`, chat template
applied, greedy) goes through every engine ``--repeat`` times: pass 2 replays the prompts
through the same engines, so a proposer that learns across requests (``suffix``) shows it.
Before it is measured, each engine (plain decoding's, the control's and every proposer's)
makes the same short warm-up call (:func:`warm_up`), so one-time costs stay out of every row
alike. The engines take turns prompt group by prompt group (the group is one ``generate``
call of prompts of one kind, no prompt in two calls of a pass: see :func:`prompt_groups`),
rotating who goes first from call to call and from trial to trial
(:func:`specdraft.measure.turn_order`), so a machine whose load drifts during the run weighs
on all of them alike; every figure is a ratio against plain decoding at the same batch width
and pass, measured in the same command. By default (``--schedule queued``) a group holds all
of its kind's prompts and the engine runs ``--batch`` of them at a time, starting a waiting
one whenever a sequence finishes, as a server does; ``--schedule static`` makes calls of
``--batch`` prompts (a kind's last call holds those left), each lasting as long as its
slowest sequence, so a sequence that drafts badly holds the others' slots idle.

One row per proposer, policy and batch width: tokens/s and the ratio to plain decoding (in
all, per prompt kind, per pass), mean acceptance length, acceptance by draft position, the
draft-length histogram (steps that asked for ``k`` drafts), and whether every output equals
plain decoding's token for token. ``--json`` prints everything; ``--plot FILE.png`` draws
tokens/s by proposer and batch width and acceptance by draft position (needs matplotlib:
``pip install 'specdraft[plot]'``).

One run of the prompt set rests each ratio on a few ``generate`` calls, and on a shared
machine that carries noise of several percent. ``--trials N`` runs the whole comparison N
times, each trial through fresh engines (so a cross-request drafter sees each prompt once a
trial, as in the first pass), with the baseline and proposer calls of each prompt group back
to back. Each row then has the figures :mod:`specdraft.measure` defines, where each JSON
field is documented: the pooled ``speedup`` and ``by_kind``
(:func:`~specdraft.measure.figures`), the per-trial ``ratio`` and ``cpu_ratio``
(:func:`~specdraft.measure.trial_ratios`), ``fastest_ratio``
(:func:`~specdraft.measure.fastest_ratios`) and the steadiest, ``paired_ratio``
(:func:`~specdraft.measure.paired_ratios`). A wide batch makes few calls a trial (at batch
8, one a prompt kind), so its figures need more trials (8 or so) to resolve a few percent.
The table prints the paired median, its standard error and, in brackets, the fastest-trial
ratio.

``--control`` adds a ``control`` row at every width: a second plain-decoding engine that
takes its turns and is paired with the baseline exactly like a proposer. Nothing differs
between the two, so the control's ratios are what the bench reads when there is nothing to
find: their spread is this machine's noise at that width, in the same sitting, and a
proposer whose ratio lies within the control's range is not told apart from plain decoding.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import specdraft
from specdraft.measure import BASELINE, Pass, Run, bench_rows, figures, turn_order

__all__ = [
    "ON_REQUEST",
    "PROPOSERS",
    "SCHEDULES",
    "RandomDrafter",
    "add_model_bench_args",
    "parse_widths",
    "prompt_groups",
    "run_model_bench",
    "warm_up",
]

# The row name of ``--control``: a second plain-decoding engine, measured like a proposer.
CONTROL = "control"

#: Tokens the warm-up call generates on each engine (see :func:`warm_up`): enough for a
#: drafting step after the first token.
WARMUP_TOKENS = 4

#: How a batch width's prompts are handed to the engines (see :func:`prompt_groups`); the
#: first is the default.
SCHEDULES = ("queued", "static")


class RandomDrafter(specdraft.DraftProposer):
    """Drafts uniformly random token ids.

    They are almost never accepted, so its row shows what a useless drafter costs (the
    adaptive policy should turn it down to nearly nothing).
    """

    def alloc_state(self, gpu: Any) -> random.Random:  # noqa: ANN401 - a specdraft backend
        """A seeded generator per sequence."""
        return random.Random(0)

    def propose(
        self,
        last_token: int,
        target_hidden: Any,  # noqa: ANN401 - a specdraft.DevicePtr
        position: int,
        num_drafts: int,
        state: random.Random,
        ctx: Any,  # noqa: ANN401 - a forward context view
        stream: int,
        draft_embed_target: Any = None,  # noqa: ANN401
        grammar_bitmask: Any = None,  # noqa: ANN401
        target_hidden_stack: Any = None,  # noqa: ANN401
    ) -> list[int]:
        """``num_drafts`` random ids from the model's vocabulary."""
        if num_drafts == 0:
            # The policy's usual ask for a drafter this bad: return before building the
            # config view, so the row measures the drafter and not that view.
            return []
        vocab = ctx.config.vocab_size
        return [state.randrange(vocab) for _ in range(num_drafts)]

    def after_verify(self, num_accepted: int, state: random.Random, stream: int) -> None:
        """Nothing to update."""


def shipped_head_for(model: Any, model_name: str | None, kind: str = "mtp") -> Any:  # noqa: ANN401
    """The shipped draft head of ``kind`` for the model file ``model_name`` (default smollm2).

    ``kind`` is ``mtp``, ``eagle3`` or ``dflash``. It is loaded beside ``model`` and shares
    its embedding (and, but for an EAGLE-3 head, its LM head).
    """
    from specdraft.heads import default_head_for, load_draft_head

    path = _model_file_for_head(model, model_name, kind)
    return load_draft_head(default_head_for(path, kind), model)


def _model_file_for_head(model: Any, model_name: str | None, proposer: str) -> Path:  # noqa: ANN401
    """The model file a shipped head is looked up by: ``model_name``, default smollm2.

    A head drafts beside a loaded ``model``, so there must be one.
    """
    from specdraft.models import resolve_model

    if model is None:
        raise ValueError(f"--proposer {proposer!r} drafts beside a loaded target model")
    return resolve_model(model_name or "smollm2")


def hybrid_for(model: Any, model_name: str | None, trees: bool = False) -> Any:  # noqa: ANN401
    """Suffix decoding, then the best shipped learned head for ``model_name`` (a Hybrid).

    The head is :func:`specdraft.heads.best_head_for`'s: of the heads shipped for the model,
    the one whose training measured the longest acceptance through the engine. Each step
    drafts by retrieval when the text so far repeats, else with the head; the head catches up
    exactly on the tokens retrieval drafted (it is told the target's layer count). With
    ``trees``, suffix decoding grows its speculation trees and the head (where it can) its
    EAGLE-2 trees, and the hybrid drafts the winner's tree.
    """
    from specdraft.heads import best_head_for, load_draft_head

    path = _model_file_for_head(model, model_name, "hybrid")
    head = load_draft_head(best_head_for(path), model)
    if trees and hasattr(head, "set_grow_trees"):
        head.set_grow_trees(True)
    return specdraft.Hybrid(
        [specdraft.SuffixDecoding(trees=trees), head],
        target_layers=model.config.num_hidden_layers,
    )


#: The proposers ``specdraft bench`` runs by default, in row order. Each entry builds a
#: fresh proposer for the loaded model (None: plain decoding). Adding a proposer to the
#: bench is one line here.
PROPOSERS: dict[str, Callable[[Any, str | None], Any]] = {
    BASELINE: lambda model, model_name: None,
    "prompt-lookup": lambda model, model_name: specdraft.PromptLookup(),
    "suffix": lambda model, model_name: specdraft.SuffixDecoding(),
    "random": lambda model, model_name: RandomDrafter(),
    "mtp": lambda model, model_name: shipped_head_for(model, model_name, "mtp"),
    "eagle3": lambda model, model_name: shipped_head_for(model, model_name, "eagle3"),
    "dflash": lambda model, model_name: shipped_head_for(model, model_name, "dflash"),
    "hybrid": hybrid_for,
}


def tree_head_for(kind: str) -> Callable[[Any, str | None], Any]:
    """A builder of the shipped head of ``kind`` (``mtp`` or ``eagle3``) growing draft trees."""

    def build(model: Any, model_name: str | None) -> Any:  # noqa: ANN401
        head = shipped_head_for(model, model_name, kind)
        head.set_grow_trees(True)
        return head

    return build


#: Proposers ``specdraft bench`` runs only when named (``--proposer suffix-tree``): the tree
#: forms of the retrieval proposers and of the learned heads, to compare with their chains
#: in one command.
ON_REQUEST: dict[str, Callable[[Any, str | None], Any]] = {
    "prompt-lookup-tree": lambda model, model_name: specdraft.PromptLookup(trees=True),
    "suffix-tree": lambda model, model_name: specdraft.SuffixDecoding(trees=True),
    "mtp-tree": tree_head_for("mtp"),
    "eagle3-tree": tree_head_for("eagle3"),
    "hybrid-tree": lambda model, model_name: hybrid_for(model, model_name, trees=True),
}


def parse_widths(text: str) -> list[int]:
    """``"1,4,8"`` as ``[1, 4, 8]``: distinct widths of at least 1, in the order given."""
    widths: list[int] = []
    for part in text.split(","):
        try:
            w = int(part)
        except ValueError:
            raise ValueError(f"--batch {text!r}: {part!r} is not a whole number") from None
        if w < 1:
            raise ValueError(f"--batch {text!r}: each width must be at least 1")
        if w not in widths:
            widths.append(w)
    return widths


def prompt_groups(
    kinds: list[str], width: int, schedule: str = SCHEDULES[0]
) -> list[tuple[str, list[int]]]:
    """The ``generate`` calls of one pass at batch ``width``: ``(kind, prompt indices)``.

    Each call holds prompts of one kind (in the order the kinds first appear), so every call
    counts towards that kind's ratio, and each prompt is in exactly one call: a prompt taken
    twice in a pass would let a proposer that learns across requests (``suffix``) draft it
    from its own reply. A call may then hold fewer prompts than the width; every engine of
    the width makes the same calls, so each still has a baseline call of the same prompts.

    ``"static"``: calls of ``width`` prompts (a kind's last call holds those left), each
    finishing before the next starts, so a call lasts as long as its slowest sequence.
    ``"queued"``: one call per kind holding all its prompts, which the engine's scheduler runs
    ``width`` at a time, starting a waiting prompt as soon as a sequence finishes (continuous
    batching, as a server runs). At width 1 both are one call per prompt: a single slot runs
    the prompts one after another either way, and a call each gives a paired ratio each.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    calls = []
    for kind in dict.fromkeys(kinds):
        own = [i for i, k in enumerate(kinds) if k == kind]
        size = width if schedule == "static" or width == 1 else len(own)
        calls += [(kind, own[start : start + size]) for start in range(0, len(own), size)]
    return calls


def _policies(text: str) -> list[str]:
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in ("adaptive", "fixed")]
    if bad or not names:
        raise ValueError(f"--draft-policy {text!r}: expected adaptive, fixed or both (comma)")
    return list(dict.fromkeys(names))


def warm_up(engines: list[Any], prompt: list[int]) -> None:
    """Makes the same short call of ``prompt`` on every engine, none of it measured.

    One-time costs (first allocations, page faults on weights, a drafter's first calls) then
    stay out of plain decoding's rows and every proposer's alike. ``prompt`` is none of the
    measured ones, so a proposer that learns across requests learns no measured reply from it.
    """
    for engine in engines:
        engine.generate([prompt], max_tokens=WARMUP_TOKENS)


def _ratio_cell(row: dict[str, Any], kind: str, trials: int) -> str:
    """The speedup for ``kind``.

    Pooled with one trial, else the median of the paired per-call ratios, its error and the
    fastest-trial ratio.
    """
    if trials > 1:
        stats, fastest = row["paired_ratio"].get(kind), row["fastest_ratio"].get(kind)
        if not stats:
            return "-"
        return f"{stats['median']:.3f}x+-{stats['stderr']:.3f} ({fastest or 0:.3f}x)"
    if kind == "all":
        return f"{row['speedup']:.2f}x"
    return f"{row['by_kind'][kind]['speedup']:.2f}x" if kind in row["by_kind"] else "-"


def _table(rows: list[dict[str, Any]], repeat: int, trials: int = 1) -> str:
    head = ["proposer", "policy", "batch", "tok/s", "speedup", "grounded", "open"]
    if repeat > 1:
        head.append(f"pass {repeat}")
    head += ["accept len", "acceptance by position", "draft lengths", "same output"]
    body = []
    for r in rows:
        same = r["identical_to_baseline"]
        cells = [
            r["proposer"],
            r["policy"] or "-",
            str(r["batch"]),
            f"{r['tokens_per_s']:.1f}",
            *(_ratio_cell(r, k, trials) for k in ("all", "grounded", "open")),
        ]
        if repeat > 1:
            cells.append(f"{r['passes'][-1]['speedup']:.2f}x")
        cells += [
            f"{r['mean_acceptance_length']:.2f}",
            " ".join(f"{x:.2f}" for x in r["acceptance_by_position"]) or "-",
            " ".join(str(x) for x in r["draft_lengths"]) or "-",
            "-" if same is None else ("yes" if same else "NO"),
        ]
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _check_plot_dependency(path: str | None) -> None:
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which specdraft's optional extra 'plot' brings: "
            "pip install 'specdraft[plot]'"
        ) from None


def _progress_ratios(group: list[Run], pass_index: int) -> None:
    """Each run's ratios to plain decoding over this pass so far (figures survive a stop)."""
    base = next((r for r in group if r.proposer == BASELINE), None)
    if base is None:
        return
    for r in group:
        if r is base:
            continue
        f = figures(r.trials[-1][pass_index], base.trials[-1][pass_index])
        kinds = ", ".join(f"{k} {v['speedup']:.3f}x" for k, v in f["by_kind"].items())
        label = f"{r.proposer} ({r.policy})" if r.policy else r.proposer
        _progress(f"  {label}: {f['speedup']:.3f}x ({kinds})")


def run_model_bench(args: argparse.Namespace) -> int:
    """``specdraft bench`` on a model (see the module documentation); the exit status."""
    from specdraft.bench_prompts import WARMUP, bench_prompts
    from specdraft.cli_engine import load_for_bench, make_proposer, proposer_key

    try:
        given = [n.strip() for arg in args.proposer for n in arg.split(",") if n.strip()]
        names = [proposer_key(n) or n for n in given] or [n for n in PROPOSERS if n != BASELINE]
        names = [n for n in dict.fromkeys(names) if n != BASELINE]
        for n in names:
            if proposer_key(n) is None:
                make_proposer(n)  # a bad name fails before the model loads
        widths = parse_widths(args.batch)
        policies = _policies(args.draft_policy)
        chosen = bench_prompts(args.prompts)
        for option, value in [
            ("--max-tokens", args.max_tokens),
            ("--num-drafts", args.num_drafts),
            ("--repeat", args.repeat),
            ("--trials", args.trials),
        ]:
            if value < 1:
                raise ValueError(f"{option} must be at least 1, got {value}")
        _check_plot_dependency(args.plot)
        model, device = load_for_bench(args, max(widths))
    except ImportError as e:
        print(f"specdraft bench: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError, specdraft.SpecdraftError) as e:
        print(f"specdraft bench: {e}", file=sys.stderr)
        return 2
    tokenizer = model.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(list(p.messages))) for p in chosen]
    kinds = [p.kind for p in chosen]
    warmup = tokenizer.encode(tokenizer.apply_chat_template(list(WARMUP)))

    unused: dict[str, Any] = {}
    if not args.proposer:
        # A default row this model has no proposer for (no shipped draft head) is left out;
        # a proposer built to find out serves the first engine of its row.
        for name in list(names):
            try:
                unused[name] = make_proposer(name, model, args.model)
            except ValueError as e:
                _progress(f"specdraft bench: no {name} row: {e}")
                names.remove(name)

    def engine_for(name: str, policy: str | None, width: int) -> Any:  # noqa: ANN401
        if name in (BASELINE, CONTROL):
            return specdraft.SpecEngine(model, None, max_batch=width)
        proposer = unused.pop(name) if name in unused else make_proposer(name, model, args.model)
        return specdraft.SpecEngine(
            model,
            proposer,
            num_drafts=args.num_drafts,
            max_batch=width,
            draft_policy=policy,
            draft_shape=args.draft_shape,
        )

    runs: list[Run] = []
    for width in widths:
        runs.append(Run(BASELINE, None, width, None))
        if args.control:
            runs.append(Run(CONTROL, None, width, None))
        runs += [Run(name, policy, width, None) for name in names for policy in policies]
    started = time.perf_counter()
    for trial in range(args.trials):
        # Fresh engines each trial: a proposer that learns across requests sees each prompt
        # once a trial, so every trial measures what the first does.
        for r in runs:
            r.engine = engine_for(r.proposer, r.policy, r.batch)
            r.trials.append([])
        warm_up([r.engine for r in runs], warmup)
        label = f"trial {trial + 1}/{args.trials}, " if args.trials > 1 else ""
        call = 0
        for pass_index in range(args.repeat):
            for r in runs:
                r.trials[-1].append(Pass())
            for width in widths:
                group = [r for r in runs if r.batch == width]
                calls = prompt_groups(kinds, width, args.schedule)
                for done, (kind, members) in enumerate(calls, 1):
                    chunk = [prompts[i] for i in members]
                    order = turn_order(group, trial, call)
                    call += 1
                    for r in order:
                        t0, c0 = time.perf_counter(), time.process_time()
                        results = r.engine.generate(chunk, max_tokens=args.max_tokens)
                        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                        r.trials[-1][-1].add(results, wall, kind, cpu)
                    _progress(
                        f"{label}pass {pass_index + 1}/{args.repeat}, batch {width}: "
                        f"{done}/{len(calls)} calls ({time.perf_counter() - started:.0f} s)"
                    )
                _progress_ratios(group, pass_index)
        for r in runs:
            r.engine = None
    rows = bench_rows(runs)
    if args.json:
        report = {
            "model": str(args.model),
            "device": device,
            "prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "num_drafts": args.num_drafts,
            "batch": widths,
            "schedule": args.schedule,
            "repeat": args.repeat,
            "trials": args.trials,
            "draft_policies": policies,
            "draft_shape": args.draft_shape,
            "control": args.control,
            "results": rows,
        }
        print(json.dumps(report, indent=2))
    else:
        print(
            f"model {args.model} on {device}: {len(prompts)} prompts x {args.repeat}, "
            f"{args.max_tokens} tokens max, up to {args.num_drafts} drafts, greedy"
            + (
                f"; speedups over {args.trials} trials: median of each call against its "
                "baseline call +- standard error (fastest trial of each prompt group)"
                if args.trials > 1
                else ""
            )
        )
        print(_table(rows, args.repeat, args.trials))
    if args.plot:
        from specdraft.bench_plot import plot_rows

        plot_rows(rows, args.plot)
        _progress(f"plot written to {args.plot}")
    failed = [r for r in rows if r["errors"] or r["identical_to_baseline"] is False]
    for r in failed:
        for e in r["errors"]:
            print(f"specdraft bench: {r['proposer']}: {e}", file=sys.stderr)
        if r["identical_to_baseline"] is False:
            print(
                f"specdraft bench: {r['proposer']} ({r['policy']}, batch {r['batch']}): "
                "output differs from plain decoding",
                file=sys.stderr,
            )
    return 1 if failed else 0


def add_model_bench_args(p: argparse.ArgumentParser) -> None:
    """Adds the model-benchmark options to the ``bench`` parser."""
    from specdraft.cli_engine import add_model_args

    add_model_args(p, 128)
    p.add_argument(
        "--proposer",
        action="append",
        default=[],
        help=(
            f"one of {', '.join(n for n in PROPOSERS if n != BASELINE)} (the default rows), "
            f"{', '.join(ON_REQUEST)}, or module:Class, which imports and runs that module "
            "(repeatable, or a comma list)"
        ),
    )
    p.add_argument("--prompts", type=int, default=None, help="use the first N built-in prompts")
    p.add_argument(
        "--batch", default="1", help="prompts generated together; a comma list runs each width"
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=SCHEDULES[0],
        help=(
            "queued: each prompt kind's prompts in one call, run --batch at a time with a "
            "waiting prompt starting as soon as a sequence finishes (continuous batching); "
            "static: calls of --batch prompts, each lasting as long as its slowest "
            "sequence, a kind's last call holding those left (default: queued)"
        ),
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="passes over the prompt set through the same engines"
    )
    p.add_argument(
        "--trials",
        type=int,
        default=1,
        help=(
            "run the whole comparison N times through fresh engines and report each ratio's "
            "median and spread over the trials (5 or more resolve a few percent)"
        ),
    )
    p.add_argument(
        "--draft-policy",
        default="adaptive",
        help="adaptive, fixed, or both as a comma list (each proposer runs under each)",
    )
    p.add_argument(
        "--draft-shape",
        choices=["tree", "chain"],
        default="tree",
        help="tree: a proposer that grows trees drafts them (as --proposer suffix-tree "
        "does); chain: every proposer drafts chains",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help=(
            "add a 'control' row at every width: a second plain-decoding engine measured "
            "like a proposer, whose ratios show this machine's noise in the same run"
        ),
    )
    p.add_argument("--json", action="store_true", help="print every figure as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the figures to a PNG")
    p.set_defaults(model_bench=run_model_bench)
