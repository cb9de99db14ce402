"""The cost of one all-reduce between ranks on the CPU, through specdraft and through mpi4py.

Run under MPI: ``mpiexec -n 2 python benches/comm_mpi.py [--iters N]``. For each buffer
(one hidden row of 576 float32, and 64 KiB of float32) it times three ways of summing it
across the ranks, each after a barrier:

- ``specdraft``: ``Communicator.all_reduce`` (a copy into numpy, ``Iallreduce`` polled with
  ``Test`` under a timeout, a copy back);
- ``mpi4py_allreduce``: a raw blocking ``comm.Allreduce`` in place from Python;
- ``mpi4py_iallreduce``: a raw ``Iallreduce`` then ``Wait`` from Python.

Rank 0 prints JSON: microseconds per call (median and mean over ``--iters`` calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import specdraft.distributed as dist
from mpi4py import MPI

SIZES = {"hidden_row_576_f32": 576, "buffer_64KiB_f32": 64 * 1024 // 4}


def timed(fn: Callable[[], object], iters: int, comm: MPI.Comm) -> dict[str, float]:
    """Microseconds per call of ``fn``: median and mean over ``iters`` calls, after warm-up."""
    for _ in range(max(10, iters // 20)):
        fn()
    comm.Barrier()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return {"median_us": statistics.median(times), "mean_us": statistics.fmean(times)}


def main() -> None:
    """Times each way for each size and prints rank 0's figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=2000, help="timed calls per measurement")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = dist.init()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, n in SIZES.items():
        x = np.full(n, 1.0 + comm.rank, np.float32)
        # Zeros: summed in place again and again, they stay finite.
        raw = np.zeros(n, np.float32)

        def blocking(raw: np.ndarray = raw) -> None:
            world.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)

        def nonblocking(raw: np.ndarray = raw) -> None:
            world.Iallreduce(MPI.IN_PLACE, raw, op=MPI.SUM).Wait()

        def ours(x: np.ndarray = x) -> None:
            comm.all_reduce(x)

        results[name] = {
            "specdraft": timed(ours, args.iters, world),
            "mpi4py_allreduce": timed(blocking, args.iters, world),
            "mpi4py_iallreduce": timed(nonblocking, args.iters, world),
        }
    if comm.rank == 0:
        info = {
            "ranks": comm.size,
            "iters": args.iters,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        }
        print(json.dumps({"setup": info, "all_reduce": results}, indent=2))


if __name__ == "__main__":
    main()
