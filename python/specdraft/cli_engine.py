"""The model half of the command line: ``specdraft bench`` and ``specdraft generate``.

``bench`` runs plain decoding (the baseline) and then each ``--proposer`` over the built-in
prompt set (:mod:`specdraft.bench_prompts`, chat template applied), greedy, and prints one
row per run: tokens/s, speedup over the baseline, mean acceptance length (tokens per verify
forward), acceptance rate by draft position, and whether every output equals the
baseline's token for token (greedy speculative decoding must not change the output).
Progress goes to stderr; ``--json`` prints the same figures as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from typing import Any

__all__ = ["add_generate", "add_model_bench_args", "make_proposer", "run_model_bench"]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _backend(device: str) -> Any:  # noqa: ANN401 - a specdraft backend
    """The backend ``--device`` names.

    ``cpu``, ``cuda`` (GPU 0, or an error saying why not) or ``auto``
    (:func:`specdraft.default_backend`).
    """
    import specdraft

    if device == "cpu":
        return specdraft.CpuBackend()
    if device == "cuda":
        return specdraft.CudaBackend(0)
    return specdraft.default_backend()


def make_proposer(name: str) -> Any:  # noqa: ANN401 - a specdraft.DraftProposer or None
    """The proposer called ``name``.

    ``prompt-lookup``, ``suffix`` (:class:`specdraft.SuffixDecoding`), ``none`` (plain
    decoding), or ``module:Class`` (built with no arguments).
    """
    import specdraft

    key = name.strip().lower()
    if key in ("none", "baseline"):
        return None
    if key in ("prompt-lookup", "prompt_lookup", "promptlookup"):
        return specdraft.PromptLookup()
    if key in ("suffix", "suffix-decoding", "suffix_decoding", "suffixdecoding"):
        return specdraft.SuffixDecoding()
    if ":" not in name:
        raise ValueError(
            f"--proposer {name!r}: expected 'prompt-lookup', 'suffix', 'none' or 'module:Class'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--proposer {name!r}: cannot import {module_name!r}: {e}") from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"--proposer {name!r}: {module_name} has no {attr!r}")
    proposer = cls()
    if not isinstance(proposer, specdraft.DraftProposer):
        raise ValueError(f"--proposer {name!r}: {attr} is not a specdraft.DraftProposer subclass")
    return proposer


def _load(args: argparse.Namespace, sequences: int) -> tuple[Any, str]:  # noqa: ANN401
    """The model (with its tokenizer) and the name of the backend it runs on."""
    import specdraft
    from specdraft.models import resolve_model

    gpu = _backend(args.device)
    path = resolve_model(args.model)
    _progress(f"loading {path} on {type(gpu).__name__} ...")
    # The pool holds `sequences` full-length sequences (16-row blocks).
    kv_blocks = max(sequences, 1) * math.ceil(args.max_seq_len / 16) + 1
    model = specdraft.load_model(
        path, gpu=gpu, max_seq_len=args.max_seq_len, kv_blocks=kv_blocks, weights=args.weights
    )
    if model.tokenizer is None:
        raise ValueError(f"{path} carries no tokenizer specdraft can read")
    return model, type(gpu).__name__


def _sum_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _run(
    engine: Any,  # noqa: ANN401
    prompts: list[list[int]],
    kinds: list[str],
    args: argparse.Namespace,
    label: str,
) -> dict[str, Any]:
    outputs: list[list[int]] = []
    # Tokens and seconds per prompt kind; a batch that mixes kinds counts as "mixed".
    by_kind: dict[str, list[float]] = {}
    totals: dict[str, Any] = {
        "tokens": 0,
        "seconds": 0.0,
        "drafted": 0,
        "accepted": 0,
        "verify_steps": 0,
        "decode_tokens": 0,
        "drafted_at": [],
        "accepted_at": [],
        "draft_time_s": 0.0,
        "verify_time_s": 0.0,
        "errors": [],
    }
    for start in range(0, len(prompts), args.batch):
        chunk = prompts[start : start + args.batch]
        t0 = time.perf_counter()
        results = engine.generate(chunk, max_tokens=args.max_tokens)
        seconds = time.perf_counter() - t0
        totals["seconds"] += seconds
        tokens = 0
        for r in results:
            outputs.append(list(r.tokens))
            m = r.metrics
            tokens += len(r.tokens)
            for k in ("drafted", "accepted", "verify_steps", "decode_tokens"):
                totals[k] += m[k]
            totals["drafted_at"] = _sum_lists(totals["drafted_at"], m["drafted_at"])
            totals["accepted_at"] = _sum_lists(totals["accepted_at"], m["accepted_at"])
            totals["draft_time_s"] += m["draft_time_s"]
            totals["verify_time_s"] += m["verify_time_s"]
            if r.error:
                totals["errors"].append(r.error)
        totals["tokens"] += tokens
        chunk_kinds = set(kinds[start : start + args.batch])
        kind = chunk_kinds.pop() if len(chunk_kinds) == 1 else "mixed"
        acc = by_kind.setdefault(kind, [0.0, 0.0])
        acc[0] += tokens
        acc[1] += seconds
        done = min(start + args.batch, len(prompts))
        _progress(
            f"[{label}] {done}/{len(prompts)} prompts: {tokens} tokens in {seconds:.2f} s "
            f"({tokens / seconds if seconds else 0.0:.1f} tok/s)"
        )
    totals["outputs"] = outputs
    totals["by_kind"] = by_kind
    return totals


def _row(name: str, t: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    tps = t["tokens"] / t["seconds"] if t["seconds"] else 0.0
    base_tps = (base["tokens"] / base["seconds"]) if base and base["seconds"] else tps
    steps = t["verify_steps"]
    return {
        "proposer": name,
        "tokens": t["tokens"],
        "seconds": round(t["seconds"], 4),
        "tokens_per_s": round(tps, 2),
        "speedup": round(tps / base_tps, 3) if base_tps else 0.0,
        "mean_acceptance_length": round(t["decode_tokens"] / steps, 3) if steps else 0.0,
        "acceptance_rate": round(t["accepted"] / t["drafted"], 4) if t["drafted"] else 0.0,
        "acceptance_by_position": [
            round(a / d, 4) if d else 0.0
            for a, d in zip(t["accepted_at"], t["drafted_at"], strict=False)
        ],
        "drafted": t["drafted"],
        "accepted": t["accepted"],
        "draft_time_s": round(t["draft_time_s"], 4),
        "verify_time_s": round(t["verify_time_s"], 4),
        "identical_to_baseline": None if base is None else t["outputs"] == base["outputs"],
        "by_kind": _by_kind(t, base),
        "errors": t["errors"],
    }


def _by_kind(t: dict[str, Any], base: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    """Tokens/s and speedup over the baseline for each prompt kind (grounded, open)."""
    out = {}
    for kind, (tokens, seconds) in t["by_kind"].items():
        tps = tokens / seconds if seconds else 0.0
        base_tokens, base_seconds = (base or t)["by_kind"].get(kind, (0.0, 0.0))
        base_tps = base_tokens / base_seconds if base_seconds else 0.0
        out[kind] = {
            "tokens_per_s": round(tps, 2),
            "speedup": round(tps / base_tps, 3) if base_tps else 0.0,
        }
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    head = [
        "proposer",
        "tok/s",
        "speedup",
        "grounded",
        "open",
        "accept len",
        "acceptance by position",
        "same output",
    ]
    body = []
    for r in rows:
        same = r["identical_to_baseline"]
        body.append(
            [
                r["proposer"],
                f"{r['tokens_per_s']:.1f}",
                f"{r['speedup']:.2f}x",
                *(
                    f"{r['by_kind'][k]['speedup']:.2f}x" if k in r["by_kind"] else "-"
                    for k in ("grounded", "open")
                ),
                f"{r['mean_acceptance_length']:.2f}",
                " ".join(f"{x:.2f}" for x in r["acceptance_by_position"]) or "-",
                "-" if same is None else ("yes" if same else "NO"),
            ]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(b) for b in body)])


def run_model_bench(args: argparse.Namespace) -> int:
    """``specdraft bench`` on a model: the baseline, then each proposer."""
    import specdraft
    from specdraft.bench_prompts import bench_prompts

    try:
        names = args.proposer or ["prompt-lookup"]
        proposers = [(n, make_proposer(n)) for n in names]
        chosen = bench_prompts(args.prompts)
        if args.max_tokens < 1 or args.num_drafts < 1 or args.batch < 1:
            raise ValueError("--max-tokens, --num-drafts and --batch must be at least 1")
        model, device = _load(args, args.batch)
    except ImportError as e:
        print(
            f"specdraft bench: {e} (a dependency is missing: reinstall specdraft)",
            file=sys.stderr,
        )
        return 2
    except (ValueError, RuntimeError, OSError, specdraft.SpecdraftError) as e:
        print(f"specdraft bench: {e}", file=sys.stderr)
        return 2
    tokenizer = model.tokenizer
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(list(p.messages))) for p in chosen]
    kinds = [p.kind for p in chosen]
    # Warm-up: one-time costs (kernel loading, first allocations) stay out of the figures.
    specdraft.SpecEngine(model, None).generate(prompts[:1], max_tokens=4)
    runs: list[tuple[str, dict[str, Any]]] = []
    base = _run(
        specdraft.SpecEngine(model, None, max_batch=args.batch), prompts, kinds, args, "baseline"
    )
    runs.append(("baseline", base))
    for name, proposer in proposers:
        engine = specdraft.SpecEngine(
            model, proposer, num_drafts=args.num_drafts, max_batch=args.batch
        )
        runs.append((name, _run(engine, prompts, kinds, args, name)))
    rows = [_row(n, t, None if n == "baseline" else base) for n, t in runs]
    if args.json:
        report = {
            "model": str(args.model),
            "device": device,
            "prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "num_drafts": args.num_drafts,
            "batch": args.batch,
            "results": rows,
        }
        print(json.dumps(report, indent=2))
    else:
        print(
            f"model {args.model} on {device}: {len(prompts)} prompts, "
            f"{args.max_tokens} tokens max, {args.num_drafts} drafts, greedy"
        )
        print(_table(rows))
    failed = [r for r in rows if r["errors"] or r["identical_to_baseline"] is False]
    for r in failed:
        for e in r["errors"]:
            print(f"specdraft bench: {r['proposer']}: {e}", file=sys.stderr)
    return 1 if failed else 0


def _model_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--model", default="smollm2", help="a model name, .gguf file or HF folder")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--max-seq-len", type=int, default=2048, help="context of each sequence")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate")
    p.add_argument("--num-drafts", type=int, default=4, help="drafts per step")
    p.add_argument(
        "--weights",
        default=None,
        help=(
            "quantize a safetensors checkpoint's matrices at load (q8_0, q4_0, q4_1, q5_0, "
            "q5_1, q4_k, q5_k, q6_k); default: the formats the file holds"
        ),
    )


def add_model_bench_args(p: argparse.ArgumentParser) -> None:
    """Adds the model-benchmark options to the ``bench`` parser."""
    _model_args(p, 128)
    p.add_argument(
        "--proposer",
        action="append",
        default=[],
        help=(
            "prompt-lookup, suffix, or module:Class, which imports and runs that module "
            "(repeatable; default prompt-lookup)"
        ),
    )
    p.add_argument("--prompts", type=int, default=None, help="use the first N built-in prompts")
    p.add_argument("--batch", type=int, default=1, help="prompts generated together")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(model_bench=run_model_bench)


def run_generate(args: argparse.Namespace) -> int:
    """``specdraft generate``: prints the completion of ``--prompt``."""
    import specdraft
    from specdraft.grammar import Grammar

    try:
        proposer = make_proposer(args.proposer)
        model, _ = _load(args, 1)
        tokenizer = model.tokenizer
        grammar = None
        if args.regex:
            grammar = Grammar.regex(tokenizer, args.regex)
        elif args.json_schema:
            grammar = Grammar.json_schema(tokenizer, args.json_schema)
        engine = specdraft.SpecEngine(model, proposer, num_drafts=args.num_drafts)
        options = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "seed": args.seed,
            "grammar": grammar,
        }
        if args.no_chat:
            (result,) = engine.generate([args.prompt], **options)
        else:
            (result,) = engine.chat([[{"role": "user", "content": args.prompt}]], **options)
    except ImportError as e:
        extra = "grammar" if "llguidance" in str(e) else "cli"
        print(f"specdraft generate: {e} (pip install 'specdraft[{extra}]')", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError, specdraft.SpecdraftError) as e:
        print(f"specdraft generate: {e}", file=sys.stderr)
        return 2
    if result.error:
        print(f"specdraft generate: {result.error}", file=sys.stderr)
        return 1
    print(result.text)
    m = result.metrics
    _progress(
        f"{len(result.tokens)} tokens ({result.finish_reason}), {m['tokens_per_s']:.1f} tok/s, "
        f"mean acceptance length {m['mean_acceptance_length']:.2f}"
    )
    return 0


def add_generate(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft generate``."""
    p = subparsers.add_parser("generate", help="print a completion of a prompt")
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat)")
    _model_args(p, 256)
    p.add_argument(
        "--proposer",
        default="prompt-lookup",
        help="prompt-lookup, suffix, none or module:Class (imports and runs it)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--regex", help="constrain the output to this regular expression")
    g.add_argument("--json-schema", help="constrain the output to JSON valid against this schema")
    p.set_defaults(run=run_generate)
    return p
