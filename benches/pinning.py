"""Pinning a benchmark to a number of CPUs.

Specdraft and the peer it is set against then run on the same ones: specdraft's kernels use
every CPU the process may run on, and a peer is given that many threads.
"""

from __future__ import annotations

import os


def pin(threads: int) -> list[int]:
    """Restricts this process (and what it starts) to its first ``threads`` CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads < 1:
        raise SystemExit(f"--threads {threads}: at least 1")
    if len(cpus) < threads:
        raise SystemExit(f"--threads {threads}: this process may run on {len(cpus)} CPUs only")
    os.sched_setaffinity(0, cpus[:threads])
    return cpus[:threads]
