"""Prints the protocol benchmark as JSON.

It measures microseconds per ``propose`` call through ``dyn DraftProposer`` for
PromptLookup (Rust) and for Python proposers.

Run: ``python benches/protocol_py.py [--iters N]`` (the same code as
``specdraft bench --protocol``).
"""

from __future__ import annotations

import argparse
import json

from specdraft.protocol_bench import run


def main() -> None:
    """Runs the benchmark and prints its JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=100_000, help="propose calls per proposer")
    args = parser.parse_args()
    print(json.dumps(run(iters=args.iters), indent=2))


if __name__ == "__main__":
    main()
