"""The ``specdraft`` command line.

Each subcommand is a function that adds its parser to the subparsers and sets ``run`` to the
function that executes it; :data:`SUBCOMMANDS` lists them. To add one, write an
``add_<name>(subparsers)`` function and append it to :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from specdraft.bench_serve import add_bench_serve
from specdraft.cli_engine import add_generate
from specdraft.quantize import add_quantize
from specdraft.serve.cli import add_serve
from specdraft.train.cli import add_train, add_train_mtp


def run_bench(args: argparse.Namespace) -> int:
    """``specdraft bench``: the protocol benchmark with ``--protocol``, else the model one."""
    if args.protocol:
        from specdraft.protocol_bench import run

        print(json.dumps(run(iters=args.iters), indent=2))
        return 0
    model_bench = getattr(args, "model_bench", None)
    if model_bench is None:
        print(
            "specdraft bench: the model benchmark is not available in this build; "
            "use --protocol for the protocol benchmark",
            file=sys.stderr,
        )
        return 2
    result: int = model_bench(args)
    return result


def add_bench(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft bench``."""
    p = subparsers.add_parser("bench", help="run a benchmark and print its figures as JSON")
    p.add_argument(
        "--protocol",
        action="store_true",
        help="time one propose call through the Rust protocol (PromptLookup and Python proposers)",
    )
    p.add_argument("--iters", type=int, default=100_000, help="propose calls per proposer")
    from specdraft.cli_engine import add_model_bench_args

    add_model_bench_args(p)
    p.set_defaults(run=run_bench)
    return p


#: Functions that each add one subcommand.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = [
    add_bench,
    add_bench_serve,
    add_generate,
    add_quantize,
    add_serve,
    add_train,
    add_train_mtp,
]


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every subcommand of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="specdraft", description="The drafting half of speculative decoding."
    )
    from specdraft import __version__

    parser.add_argument("--version", action="version", version=f"specdraft {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    from specdraft import SpecdraftError
    from specdraft.cli_engine import finish_ranks

    # The one place a refused input becomes a message: a malformed model file, a bad value
    # or a missing file is one line naming the command and what was wrong, not a traceback.
    try:
        status: int = args.run(args)
    except (SpecdraftError, ValueError, OSError) as e:
        print(f"specdraft {args.command}: {one_line(e)}", file=sys.stderr)
        return 2
    finally:
        # Under mpiexec, rank 0 releases the workers whether the command worked or not.
        finish_ranks()
    return status


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (its lines joined), for a command's error line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " / ".join(lines) or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
