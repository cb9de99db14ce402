"""The communication cost of a decode step of an expert-parallel MoE target on the CPU.

Run under MPI: ``mpiexec -n 2 python benches/ranks_mpi.py [--checkpoint DIR] [--tokens N]``.
Every rank loads its share of the routed experts of ``--checkpoint`` (a GLM-4.5 or Qwen3-MoE
folder; default: a tiny random GLM-4.5 one written by ``tests/python/moe_target_reference.py``)
and rank 0 decodes ``--tokens`` tokens greedily without drafts, one target forward a token,
while the other ranks serve it. Rank 0 then decodes the same on the whole model alone (one
rank, no communicator) in the same process.

Rank 0 prints JSON: per decode step, the collectives (calls, payload bytes and microseconds of
each kind, from ``Communicator.costs()``), the step's time on the ranks and alone, and the
share of the step spent communicating.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import specdraft
import specdraft.distributed as dist

PROMPT = [1, 5, 17, 33, 4, 90, 12, 12]
LOAD = {"max_rows": 64, "max_seq_len": 512, "kv_blocks": 40}


def tiny_checkpoint(where: Path) -> Path:
    """A tiny random GLM-4.5 checkpoint (8 routed experts, top-2, hidden 64)."""
    script = Path(__file__).parents[1] / "tests" / "python" / "moe_target_reference.py"
    subprocess.run(
        [sys.executable, str(script), "glm4_moe", str(where), "12", "1,2,3"],
        check=True,
        capture_output=True,
    )
    return where


def decode(model: object, tokens: int, comm: object = None) -> tuple[float, int]:
    """Seconds of a greedy decode of ``tokens`` tokens after :data:`PROMPT`, and the tokens.

    A token emitted is a forward (the prefill, then one a token). ``comm``'s costs are reset
    after the warm-up, so they count this decode's calls alone.
    """
    engine = specdraft.SpecEngine(model, draft_policy="fixed")
    engine.generate([PROMPT], max_tokens=4, ignore_eos=True)  # warm-up
    if comm is not None:
        comm.reset_costs()
    start = time.perf_counter()
    (result,) = engine.generate([PROMPT], max_tokens=tokens, ignore_eos=True)
    elapsed = time.perf_counter() - start
    if result.error:
        raise RuntimeError(result.error)
    return elapsed, len(result.tokens)


def main() -> None:
    """Loads the shards, times the decode on the ranks and alone, prints rank 0's figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default=None, help="a glm4_moe or qwen3_moe folder")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded")
    args = parser.parse_args()
    comm = dist.init()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            if comm.rank == 0:
                path = str(tiny_checkpoint(Path(tmp) / "glm4_moe"))
            path = comm.broadcast(path.encode() if comm.rank == 0 else None).decode()
        model = specdraft.load_model(path, comm=comm, **LOAD)
        if comm.rank != 0:
            specdraft.SpecEngine(model).run_worker()
            return
        ranks_s, emitted = decode(model, args.tokens, comm)
        costs = comm.costs()
        specdraft.SpecEngine(model).close()
        steps = emitted
        alone_s, _ = decode(specdraft.load_model(path, **LOAD), args.tokens)
    per_step = {
        op: {
            "calls": c["calls"] / steps,
            "bytes": c["bytes"] / steps,
            "us": 1e6 * c["seconds"] / steps,
        }
        for op, c in costs.items()
    }
    comm_us = sum(c["us"] for c in per_step.values())
    step_us = 1e6 * ranks_s / emitted
    print(
        json.dumps(
            {
                "ranks": comm.size,
                "checkpoint": path if args.checkpoint else "tiny glm4_moe (hidden 64, 8 experts)",
                "tokens": emitted,
                "per_step": per_step,
                "step_us_on_ranks": step_us,
                "step_us_alone": 1e6 * alone_s / emitted,
                "communication_share": comm_us / step_us,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
