"""One model served by two ranks over MPI, checked against one rank.

Every rank loads the model with its communicator. A mixture-of-experts checkpoint gives
each rank its share of every layer's routed experts; the default model is dense, so each
rank holds all of it, and the ranks run the same forwards in step. Rank 0 runs the engine as
on one machine; rank 1 serves it until rank 0 closes the engine. Rank 0 then decodes the
same prompt on one rank and checks that the text is the same.

Run: ``mpiexec -n 2 python examples/04_two_ranks.py`` (``pip install 'specdraft[distributed]'``
brings mpi4py, MPICH and ``mpiexec``).
"""

from __future__ import annotations

import specdraft
import specdraft.distributed
from specdraft.models import fetch_default_model

PROMPT = "The three primary colours are red, yellow and blue. The three primary colours are"
TOKENS = 24


def generate(model: specdraft.TargetModel) -> str:
    """The greedy continuation of :data:`PROMPT`, with prompt-lookup drafts."""
    with specdraft.SpecEngine(model, specdraft.PromptLookup()) as engine:
        return engine.generate([PROMPT], max_tokens=TOKENS)[0].text


def main() -> None:
    """Rank 0 generates on both ranks, then alone; the other rank serves it."""
    comm = specdraft.distributed.init()
    # Rank 0 fetches the model once (if it is not cached yet) before the others read it.
    path = fetch_default_model() if comm.rank == 0 else None
    comm.barrier()
    path = path or fetch_default_model()
    model = specdraft.load_model(path, comm=comm)
    if comm.rank != 0:
        report = specdraft.SpecEngine(model).run_worker()
        print(f"rank {comm.rank}: served {report['commands']} commands, {report['failed']} failed")
        return
    on_ranks = generate(model)
    alone = generate(specdraft.load_model(path))
    print(f"rank 0 of {comm.size}: {on_ranks!r}")
    if on_ranks != alone:
        raise SystemExit(f"{comm.size} ranks generated other text than one: {alone!r}")
    print("the same text as one rank")


if __name__ == "__main__":
    main()
