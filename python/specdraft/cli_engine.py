"""The model half of the command line: ``specdraft generate``, and what it shares.

``specdraft bench`` (:mod:`specdraft.bench`) shares the model options, loading, and
proposers by name.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from typing import Any

from specdraft.bench import add_model_bench_args, run_model_bench

__all__ = [
    "add_generate",
    "add_model_args",
    "add_model_bench_args",
    "finish_ranks",
    "load_for_bench",
    "make_proposer",
    "proposer_key",
    "run_model_bench",
]


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


#: Other spellings of :data:`specdraft.bench.PROPOSERS` names.
_ALIASES = {
    "none": "baseline",
    "prompt_lookup": "prompt-lookup",
    "promptlookup": "prompt-lookup",
    "suffix-decoding": "suffix",
    "suffix_decoding": "suffix",
    "suffixdecoding": "suffix",
}


def proposer_key(name: str) -> str | None:
    """The :data:`specdraft.bench.PROPOSERS` entry or shipped head ``name`` means, or None."""
    from specdraft.bench import ON_REQUEST, PROPOSERS
    from specdraft.heads import shipped_heads

    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    return key if key in PROPOSERS or key in ON_REQUEST or key in shipped_heads() else None


def make_proposer(
    name: str,
    model: Any = None,  # noqa: ANN401 - the specdraft.TargetModel a draft head drafts for
    model_name: str | None = None,
) -> Any:  # noqa: ANN401 - a specdraft.DraftProposer or None
    """The proposer called ``name`` for ``model`` (loaded from ``model_name``).

    A name of :data:`specdraft.bench.PROPOSERS` (``prompt-lookup``, ``suffix``, ``random``,
    ``mtp``, ``eagle3``, ``dflash``: the shipped draft head of that kind trained for
    ``model_name``'s file, ``hybrid``: suffix decoding then the best shipped head; ``none``
    or ``baseline`` is plain decoding) or of :data:`specdraft.bench.ON_REQUEST`
    (``prompt-lookup-tree``, ``suffix-tree``, ``mtp-tree``, ``eagle3-tree``, ``hybrid-tree``), the
    name of a
    shipped head (``smollm2-mtp``), or
    ``module:Class`` (built with no arguments). A draft head is loaded beside ``model``,
    sharing its embedding.
    """
    import specdraft
    from specdraft.bench import ON_REQUEST, PROPOSERS
    from specdraft.heads import load_draft_head, shipped_heads

    key = proposer_key(name)
    builders = {**PROPOSERS, **ON_REQUEST}
    if key in builders:
        return builders[key](model, model_name)
    if key is not None:
        if model is None:
            raise ValueError(f"--proposer {name!r} drafts beside a loaded target model")
        return load_draft_head(key, model)
    if ":" not in name:
        raise ValueError(
            f"--proposer {name!r}: expected one of {', '.join(builders)}, a shipped head "
            f"({', '.join(shipped_heads())}), 'none' or 'module:Class'"
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


def load_for_bench(args: argparse.Namespace, sequences: int) -> tuple[Any, str]:  # noqa: ANN401
    """The model and the name of the backend it runs on.

    The model carries its tokenizer; its KV pool holds ``sequences`` full-length sequences.
    """
    import specdraft
    from specdraft.models import resolve_model

    gpu = _backend(args.device)
    path = resolve_model(args.model)
    comm = _ranks_comm()
    if comm is None or comm.rank == 0:
        ranks = "" if comm is None else f" (rank 0 of {comm.size})"
        _progress(f"loading {path} on {type(gpu).__name__}{ranks} ...")
    # The pool holds `sequences` full-length sequences (16-row blocks).
    kv_blocks = max(sequences, 1) * math.ceil(args.max_seq_len / 16) + 1
    model = specdraft.load_model(
        path,
        # On ranks, load_model's own CPU backend shares the host's cores among them.
        gpu=None if comm is not None and isinstance(gpu, specdraft.CpuBackend) else gpu,
        max_seq_len=args.max_seq_len,
        kv_blocks=kv_blocks,
        weights=args.weights,
        comm=comm,
    )
    if comm is not None:
        _serve_or_lead(comm, model)
    if model.tokenizer is None:
        raise ValueError(f"{path} carries no tokenizer specdraft can read")
    gpu = model.gpu
    name = type(gpu).__name__
    if isinstance(gpu, specdraft.CpuBackend):
        name += f" ({gpu.instruction_set}, {gpu.threads} threads)"
    return model, name


# Rank 0's model of a run under mpiexec, whose workers `finish_ranks` releases.
_LEADING: list[Any] = []


def _ranks_comm() -> Any:  # noqa: ANN401 - a specdraft.distributed.Communicator
    """The communicator when the command runs under ``mpiexec`` with several ranks."""
    import specdraft.distributed

    if specdraft.distributed.launched_ranks() <= 1:
        return None
    # A worker that hears nothing for 10 minutes gives up: rank 0 died before its first
    # command (a refused argument, a failed load) rather than idling, as a command line never does.
    return specdraft.distributed.init(command_timeout=600.0)


def _serve_or_lead(comm: Any, model: Any) -> None:  # noqa: ANN401
    """A worker serves rank 0 until it is done, then exits; rank 0 goes on, remembered."""
    import specdraft

    if comm.rank == 0:
        _LEADING.append(model)
        return
    specdraft.SpecEngine(model).run_worker()
    raise SystemExit(0)


def finish_ranks() -> None:
    """On rank 0 of a run under ``mpiexec``: tells the workers the command is done."""
    import specdraft

    while _LEADING:
        specdraft.SpecEngine(_LEADING.pop()).close()


def add_model_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """Adds the options that pick and size the model (shared by ``bench`` and ``generate``)."""
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


def run_generate(args: argparse.Namespace) -> int:
    """``specdraft generate``: prints the completion of ``--prompt`` as it is generated."""
    import specdraft
    from specdraft.grammar import Grammar

    try:
        if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
            raise ValueError("--max-batch-tokens must be at least 1")
        if proposer_key(args.proposer) is None:
            make_proposer(args.proposer)  # a bad name fails before the model loads
        model, _ = load_for_bench(args, 1)
        proposer = make_proposer(args.proposer, model, args.model)
        tokenizer = model.tokenizer
        grammar = None
        if args.regex:
            grammar = Grammar.regex(tokenizer, args.regex)
        elif args.json_schema:
            grammar = Grammar.json_schema(tokenizer, args.json_schema)
        engine = specdraft.SpecEngine(
            model,
            proposer,
            num_drafts=args.num_drafts,
            max_batch_tokens=args.max_batch_tokens,
            draft_policy=args.draft_policy,
            draft_shape=args.draft_shape,
        )
        text = args.prompt
        if not args.no_chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        stream = engine.stream(
            [tokenizer.encode(text)],
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            grammar=grammar,
        )
        with stream:
            for _, _, delta in stream:
                sys.stdout.write(delta or "")
                sys.stdout.flush()
        (result,) = stream.results
    except ImportError as e:
        extra = "grammar" if "llguidance" in str(e) else "cli"
        print(f"specdraft generate: {e} (pip install 'specdraft[{extra}]')", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError, specdraft.SpecdraftError) as e:
        print(f"specdraft generate: {e}", file=sys.stderr)
        return 2
    print()
    if result.error:
        print(f"specdraft generate: {result.error}", file=sys.stderr)
        return 1
    m = result.metrics
    _progress(
        f"{len(result.tokens)} tokens ({result.finish_reason}), {m['tokens_per_s']:.1f} tok/s, "
        f"first token after {m['time_to_first_token_s']:.3f} s, "
        f"mean acceptance length {m['mean_acceptance_length']:.2f}"
    )
    return 0


def add_generate(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft generate``."""
    p = subparsers.add_parser("generate", help="print a completion of a prompt")
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --no-chat)")
    add_model_args(p, 256)
    p.add_argument(
        "--proposer",
        default="prompt-lookup",
        help="prompt-lookup, suffix, random, mtp, eagle3, dflash (the model's shipped draft "
        "head of that kind), hybrid (suffix, then the best shipped head), prompt-lookup-tree, "
        "suffix-tree, mtp-tree, eagle3-tree, hybrid-tree (drafting trees), none or module:Class "
        "(imports and runs it)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="most rows in one forward; longer prompts are prefilled in chunks "
        "(default: the model's)",
    )
    p.add_argument(
        "--draft-policy",
        choices=["adaptive", "fixed"],
        default="adaptive",
        help="adaptive: each step asks for the drafts that pay; fixed: always --num-drafts",
    )
    p.add_argument(
        "--draft-shape",
        choices=["tree", "chain"],
        default="tree",
        help="tree: a proposer that grows trees drafts one (greedy or sampled), verified in "
        "one forward; chain: always a chain",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--regex", help="constrain the output to this regular expression")
    g.add_argument("--json-schema", help="constrain the output to JSON valid against this schema")
    p.set_defaults(run=run_generate)
    return p
