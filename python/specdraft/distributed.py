"""The ranks of a multi-rank serve: :func:`init` makes their :class:`Communicator`.

Run one Python process per rank under ``mpiexec`` (``mpiexec -n 2 python script.py``); each
calls :func:`init`, which takes its rank and the number of ranks from ``MPI.COMM_WORLD``.
MPI comes from the optional extra: ``pip install 'specdraft[distributed]'`` brings mpi4py
and the ``mpich`` library with its ``mpiexec``.

``init(backend="nccl")`` runs the collectives through NCCL on each rank's GPU instead (a
CUDA build of specdraft; ``pip install 'specdraft[nccl]'`` brings libnccl in the
``nvidia-nccl-cu12`` wheel). MPI still starts the ranks and carries NCCL's unique id from
rank 0. The wheel names its library ``libnccl.so.2``, which the loader finds only through a
``libnccl.so`` link on ``LD_LIBRARY_PATH`` set before Python starts; :func:`nccl_library_dir`
makes that link::

    lib=$(python3 -c 'import specdraft.distributed as d; print(d.nccl_library_dir())')
    LD_LIBRARY_PATH=$lib mpiexec -n 2 python script.py

Every collective waits at most ``timeout`` seconds for the other ranks: a rank that died or
hung makes the call raise :class:`specdraft.BackendError` naming the ranks, and the
communicator refuses every later call (the ranks are out of step for good).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from specdraft._core import Communicator

__all__ = ["Communicator", "init", "launched_ranks", "nccl_library_dir", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 60.0
"""Seconds a collective waits for the other ranks before it raises."""

_INSTALL_HINT = "pip install 'specdraft[distributed]'"
_NCCL_WHEEL = "nvidia-nccl-cu12"

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


def nccl_library_dir() -> str:
    """A folder holding ``libnccl.so``, a link to the ``nvidia-nccl-cu12`` wheel's library.

    Put it on ``LD_LIBRARY_PATH`` before the process starts: specdraft loads NCCL under the
    name ``libnccl.so``, and the wheel names it ``libnccl.so.2``. The folder is made once per
    wheel location under ``$XDG_CACHE_HOME/specdraft/nccl`` (``~/.cache`` by default).

    Raises:
        ImportError: the wheel is not installed (``pip install nvidia-nccl-cu12``).

    """
    lib = _nccl_wheel_library()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "specdraft" / "nccl" / hashlib.sha256(str(lib).encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "libnccl.so"
    if not (link.is_symlink() and Path(os.readlink(link)) == lib):
        # Made aside and renamed over, so ranks starting together never see half a link.
        tmp = folder / f".libnccl.so.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(lib)
        tmp.replace(link)
    return str(folder)


def _nccl_wheel_library() -> Path:
    """The wheel's ``nvidia/nccl/lib/libnccl.so.2`` on ``sys.path``."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "lib" / "libnccl.so.2"
        if lib.is_file():
            return lib.resolve()
    raise ImportError(
        f"the {_NCCL_WHEEL} wheel (nvidia/nccl/lib/libnccl.so.2) is not installed: "
        f"pip install {_NCCL_WHEEL} (or pip install 'specdraft[nccl]')"
    )


def init(
    timeout: float = DEFAULT_TIMEOUT_S,
    command_timeout: float | None = None,
    backend: str = "mpi",
    device: int | None = None,
) -> Communicator:
    """The communicator of this process's rank in ``MPI.COMM_WORLD``.

    Args:
        timeout: seconds a collective (all-reduce, broadcast, barrier, and receiving a
            command once rank 0 has begun sending it) waits for the other ranks before it
            raises :class:`specdraft.BackendError` naming them.
        command_timeout: seconds a worker's ``recv_command`` waits for rank 0 to send the
            next command; ``None`` waits as long as rank 0 idles between requests.
        backend: ``"mpi"`` (collectives over MPI on the host) or ``"nccl"`` (over NCCL on
            each rank's GPU; MPI only starts the ranks and sends NCCL's unique id). The
            timeouts bound NCCL's start-up and collectives too: a rank that does not join
            in time aborts the NCCL communicator and raises ``BackendError``.
        device: the GPU of this rank with ``backend="nccl"``; by default the rank's place
            among the ranks of its machine (MPI's shared-memory split), so ranks on one
            machine take different GPUs (NCCL refuses two ranks on one GPU).

    Raises:
        ImportError: mpi4py (or the MPI library it loads) is not installed.
        ValueError: a timeout that is not a positive number of seconds, or an unknown
            backend.
        specdraft.BackendUnavailableError: ``backend="nccl"`` on a build without CUDA, or
            without libnccl, a CUDA driver or the device; the message says what to install.

    """
    if backend not in ("mpi", "nccl"):
        raise ValueError(f"backend must be 'mpi' or 'nccl', got {backend!r}")
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            f"specdraft.distributed needs mpi4py and an MPI library: {_INSTALL_HINT} ({e})"
        ) from e
    world = MPI.COMM_WORLD
    if backend == "mpi":
        return Communicator._from_mpi(world, MPI, timeout, command_timeout)
    # Rank 0 makes the id; a failure there (no libnccl) reaches every rank as the same
    # error rather than leaving the others waiting for an id that never comes. The first
    # byte says which of the two follows.
    mpi = Communicator._from_mpi(world, MPI, timeout, command_timeout)
    message = b""
    if mpi.rank == 0:
        try:
            message = b"\x00" + Communicator._nccl_unique_id()
        except Exception as e:  # noqa: BLE001 -- sent to the workers, raised below
            message = b"\x01" + str(e).encode()
    message = mpi.broadcast(message, root=0)
    if message[:1] != b"\x00":
        from specdraft import BackendUnavailableError

        raise BackendUnavailableError(message[1:].decode(errors="replace"))
    unique_id = message[1:]
    if device is None:
        device = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return Communicator._from_nccl(mpi.rank, mpi.size, unique_id, device, timeout, command_timeout)
