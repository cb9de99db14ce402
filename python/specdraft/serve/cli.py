"""``specdraft serve``: the OpenAI API over HTTP on one long-lived engine.

The flags are ``generate``'s and ``bench``'s (model, proposer, draft count and policy, batch
limits) plus the server's own (bind address, API key, queue bound, KV pool size). SIGTERM
or Ctrl-C stops admitting, lets running requests finish (up to ``--drain-timeout``),
cancels the rest, and exits 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from specdraft.cli_engine import add_model_args, make_proposer, proposer_key

#: Full-length sequences the KV pool holds when --kv-blocks is not given.
DEFAULT_SEQUENCES = 16


def _load(args: argparse.Namespace) -> object:
    import specdraft
    from specdraft.cli_engine import _backend
    from specdraft.models import resolve_model

    path = resolve_model(args.model)
    blocks = args.kv_blocks or DEFAULT_SEQUENCES * math.ceil(args.max_seq_len / 16) + 1
    print(f"loading {path} ...", file=sys.stderr, flush=True)
    model = specdraft.load_model(
        path,
        gpu=_backend(args.device),
        max_seq_len=args.max_seq_len,
        kv_blocks=blocks,
        weights=args.weights,
    )
    if model.tokenizer is None:
        raise ValueError(f"{path} carries no tokenizer specdraft can read")
    return model


def _draining_server(uvicorn: Any, config: Any) -> Any:  # noqa: ANN401 - uvicorn's types
    """A uvicorn server whose SIGTERM / SIGINT drain and end the command with status 0.

    uvicorn raises a captured signal again once it has shut down (so the process dies of
    it); a drain that a signal asked for is this command's normal end instead.
    """

    class DrainingServer(uvicorn.Server):  # type: ignore[misc, name-defined]
        def handle_exit(self, sig: int, frame: Any) -> None:  # noqa: ANN401
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    return DrainingServer(config)


def run_serve(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or Ctrl-C; returns the exit status."""
    try:
        import uvicorn

        from specdraft.serve.app import build_app
    except ImportError as e:
        print(f"specdraft serve: {e} (pip install 'specdraft[serve]')", file=sys.stderr)
        return 2
    import specdraft
    from specdraft.serve.engine_loop import EngineLoop
    from specdraft.serve.params import ServeContext

    for flag in ("max_batch", "max_queue", "kv_blocks", "max_batch_tokens"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.dflash:
        if args.proposer is not None:
            raise ValueError(
                "--dflash names the proposer (the shipped DFlash head): drop --proposer"
            )
        args.proposer = "dflash"
    elif args.proposer is None:
        args.proposer = "prompt-lookup"
    if proposer_key(args.proposer) is None:
        make_proposer(args.proposer)  # a bad name fails before the model loads
    model = _load(args)
    proposer = make_proposer(args.proposer, model, args.model)
    engine = specdraft.SpecEngine(
        model,
        proposer,
        num_drafts=args.num_drafts,
        max_batch=args.max_batch,
        max_batch_tokens=args.max_batch_tokens,
        draft_policy=args.draft_policy,
    )
    name = args.served_model_name or args.model
    loop = EngineLoop(
        specdraft.ServingEngine(engine),
        model.tokenizer,
        list(model.config.eos_token_ids),
        args.proposer,
        args.max_queue,
        gpu=model.gpu,
    )
    ctx = ServeContext(name, model.tokenizer, args.max_seq_len, args.max_tokens)
    app = build_app(loop, ctx, args.api_key, args.drain_timeout)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=max(int(math.ceil(args.drain_timeout)), 1),
    )
    server = _draining_server(uvicorn, config)
    print(f"specdraft serve: {name} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server.run()
    return 0 if server.started else 1


def add_serve(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft serve``."""
    p = subparsers.add_parser("serve", help="serve the OpenAI API over HTTP")
    add_model_args(p, 256)
    p.add_argument(
        "--proposer",
        default=None,
        help="prompt-lookup (the default), suffix, random, mtp, eagle3, dflash (the model's "
        "shipped draft head of that kind), hybrid, none or module:Class",
    )
    p.add_argument(
        "--dflash",
        action="store_true",
        help="draft with the model's shipped DFlash head, its block_gamma setting the draft "
        "count (--proposer dflash)",
    )
    p.add_argument(
        "--draft-policy",
        choices=["adaptive", "fixed"],
        default="adaptive",
        help="adaptive: each step asks for the drafts that pay; fixed: always --num-drafts",
    )
    p.add_argument("--kv-blocks", type=int, default=None, help="16-row blocks of the KV pool")
    p.add_argument("--max-batch", type=int, default=64, help="most requests running at once")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="most rows in one forward")
    p.add_argument("--max-queue", type=int, default=1024, help="most requests waiting")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: local only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer <key>")
    p.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: --model)"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish at shutdown before they are cancelled",
    )
    p.set_defaults(run=run_serve)
    return p
