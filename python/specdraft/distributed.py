"""The ranks of a multi-rank serve: :func:`init` makes their :class:`Communicator` over MPI.

Run one Python process per rank under ``mpiexec`` (``mpiexec -n 2 python script.py``); each
calls :func:`init`, which takes its rank and the number of ranks from ``MPI.COMM_WORLD``.
MPI comes from the optional extra: ``pip install 'specdraft[distributed]'`` brings mpi4py
and the ``mpich`` library with its ``mpiexec``.

Every collective waits at most ``timeout`` seconds for the other ranks: a rank that died or
hung makes the call raise :class:`specdraft.BackendError` naming the ranks, and the
communicator refuses every later call (the ranks are out of step for good).
"""

from __future__ import annotations

import os

from specdraft._core import Communicator

__all__ = ["Communicator", "init", "launched_ranks", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 60.0
"""Seconds a collective waits for the other ranks before it raises."""

_INSTALL_HINT = "pip install 'specdraft[distributed]'"

# The world size each launcher puts in its ranks' environment: MPICH's and Intel MPI's hydra
# (PMI_SIZE), Open MPI (OMPI_COMM_WORLD_SIZE), Slurm's srun (SLURM_NTASKS with a PMI).
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def launched_ranks() -> int:
    """Ranks this process was launched among by ``mpiexec`` (1 when run on its own).

    Read from the launcher's environment, so it costs nothing and imports no MPI: the
    command line calls :func:`init` only when this is above 1.
    """
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def init(timeout: float = DEFAULT_TIMEOUT_S, command_timeout: float | None = None) -> Communicator:
    """The communicator of this process's rank in ``MPI.COMM_WORLD``.

    Args:
        timeout: seconds a collective (all-reduce, broadcast, barrier, and receiving a
            command once rank 0 has begun sending it) waits for the other ranks before it
            raises :class:`specdraft.BackendError` naming them.
        command_timeout: seconds a worker's ``recv_command`` waits for rank 0 to send the
            next command; ``None`` waits as long as rank 0 idles between requests.

    Raises:
        ImportError: mpi4py (or the MPI library it loads) is not installed.
        ValueError: a timeout that is not a positive number of seconds.

    """
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            f"specdraft.distributed needs mpi4py and an MPI library: {_INSTALL_HINT} ({e})"
        ) from e
    return Communicator._from_mpi(MPI.COMM_WORLD, MPI, timeout, command_timeout)
