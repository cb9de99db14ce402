"""NCCL through `specdraft.distributed`: the wheel's library made loadable, and
`init(backend="nccl")` on two ranks, which without libnccl or a GPU raises the same clear
`BackendUnavailableError` on every rank instead of hanging (tests/gpu/run.sh checks the
collectives themselves on a GPU, against numpy)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import specdraft
import specdraft.distributed as dist
from specdraft.distributed import Communicator

sys.path.insert(0, str(Path(__file__).parent))
import mpi_ranks  # noqa: E402
from test_distributed import bf16_round, bf16_to_f32, read_ranks, run_ranks  # noqa: E402


def clear_unavailable(message: str) -> bool:
    """The message names libnccl and the wheel to install, or the missing driver or GPU."""
    libnccl = "libnccl" in message and "pip install nvidia-nccl-cu12" in message
    driver = "no CUDA driver (libcuda) found" in message or "no CUDA device" in message
    return libnccl or driver


def test_nccl_library_dir_links_the_wheels_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib_dir = tmp_path / "site" / "nvidia" / "nccl" / "lib"
    lib_dir.mkdir(parents=True)
    lib = lib_dir / "libnccl.so.2"
    lib.write_bytes(b"stands in for the wheel's library")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "nvidia.nccl", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = Path(dist.nccl_library_dir())
    assert folder.parent == tmp_path / "cache" / "specdraft" / "nccl"
    link = folder / "libnccl.so"
    assert link.is_symlink()
    assert link.resolve() == lib.resolve()
    # Again: the same folder, the link still there.
    assert dist.nccl_library_dir() == str(folder)
    assert link.resolve() == lib.resolve()


def test_nccl_library_dir_without_the_wheel_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install nvidia-nccl-cu12"):
        dist.nccl_library_dir()


def test_init_refuses_an_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend must be 'mpi' or 'nccl', got 'gloo'"):
        dist.init(backend="gloo")


def test_nccl_unique_id_is_128_bytes_or_a_clear_error() -> None:
    try:
        unique_id = Communicator._nccl_unique_id()
    except specdraft.BackendUnavailableError as e:
        assert clear_unavailable(str(e)), str(e)
    else:
        assert isinstance(unique_id, bytes) and len(unique_id) == 128


def test_nccl_refuses_bad_arguments_by_name() -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        Communicator._from_nccl(0, 1, bytes(128), 0, 0.0)
    with pytest.raises(specdraft.RequestError, match="128 bytes, got 5"):
        Communicator._from_nccl(0, 1, bytes(5), 0, 10.0)


def test_two_ranks_over_nccl_sum_or_both_fail_clearly(tmp_path: Path) -> None:
    run = run_ranks("nccl", tmp_path)
    ranks = read_ranks(tmp_path, run)
    if ranks[0]["error"] is not None or ranks[1]["error"] is not None:
        # Without libnccl or a GPU every rank says what is missing; with one GPU, rank 1
        # finds no second device and rank 0 times out waiting for it in NCCL's start-up.
        assert any(got["error"] and clear_unavailable(got["error"]) for got in ranks), ranks
        for rank, got in enumerate(ranks):
            assert got["error"] is not None, f"rank {rank} started NCCL though another did not"
            waited = got["error_type"] == "BackendError" and "timed out" in got["error"]
            assert clear_unavailable(got["error"]) or waited, f"rank {rank}: {got['error']}"
        return
    # A machine with libnccl and two GPUs: the sums are numpy's.
    (f0, h0), (f1, h1) = mpi_ranks.inputs(0), mpi_ranks.inputs(1)
    want_bf16 = bf16_round(bf16_to_f32(h0) + bf16_to_f32(h1)).tolist()
    for rank, got in enumerate(ranks):
        assert got["f32"] == (f0 + f1).tolist(), f"rank {rank}: f32 all-reduce is not the sum"
        assert got["bf16"] == want_bf16, f"rank {rank}: bf16 all-reduce is not the sum"
        assert got["from_0"] == mpi_ranks.broadcast_payload().hex()
    assert ranks[1]["commands"] == mpi_ranks.COMMANDS
