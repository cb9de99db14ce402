"""The communicator: one process (`Communicator.local()`), and two ranks under `mpiexec -n 2`.

The two-rank tests run `tests/python/mpi_ranks.py` under a hard timeout, kill every process of
the run if it overruns, and check that none is left. Without
`mpiexec` they skip, unless SPECDRAFT_REQUIRE_MPI=1 (as CI sets), where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft.distributed import Communicator

sys.path.insert(0, str(Path(__file__).parent))
import mpi_ranks  # noqa: E402

RANKS_SCRIPT = Path(__file__).with_name("mpi_ranks.py")
RUN_TIMEOUT_S = 120
MARKER_VAR = "SPECDRAFT_MPI_TEST_RUN"


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 to bf16 bit patterns, round to nearest even (finite inputs)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def run_ranks(
    scenario: str, outdir: Path, *extra: str, mpiexec_flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``mpi_ranks.py SCENARIO OUTDIR EXTRA...`` on two ranks."""
    argv = [sys.executable, str(RANKS_SCRIPT), scenario, str(outdir), *extra]
    return run_two(argv, mpiexec_flags)


def run_two(argv: list[str], mpiexec_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``argv`` under ``mpiexec -n 2``, bounded in time, with no process left after it."""
    mpiexec = find_mpiexec()
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        mpiexec = None
    if mpiexec is None:
        reason = "mpiexec or mpi4py not installed (pip install 'specdraft[distributed]')"
        if os.environ.get("SPECDRAFT_REQUIRE_MPI") == "1":
            pytest.fail(f"SPECDRAFT_REQUIRE_MPI=1 but {reason}")
        pytest.skip(reason)
    # hydra puts its proxies and the ranks in sessions of their own, so they are found by
    # a marker in their environment (which mpiexec hands down), not by process group.
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VAR: marker}
    proc = subprocess.Popen(
        [mpiexec, *mpiexec_flags, "-n", "2", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_marked(marker)
        proc.communicate()
        pytest.fail(f"mpiexec -n 2 {argv} ran past {RUN_TIMEOUT_S} s; its processes were killed")
    finally:
        assert_none_left(marker)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def marked(marker: str) -> list[int]:
    """Live processes whose environment carries `marker` (mpiexec, its proxies, the ranks)."""
    tag = f"{MARKER_VAR}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if tag in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def kill_marked(marker: str) -> None:
    for pid in marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_none_left(marker: str) -> None:
    """No process of the run is left (a moment is allowed for exits to finish)."""
    deadline = time.monotonic() + 10
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        kill_marked(marker)
        pytest.fail(f"processes {left} of the mpiexec run were left running")


def read_ranks(outdir: Path, run: subprocess.CompletedProcess) -> list[dict]:
    files = [outdir / f"rank{r}.json" for r in range(2)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"{missing} not written; rc={run.returncode}\n{run.stdout}\n{run.stderr}"
    return [json.loads(f.read_text()) for f in files]


def test_two_ranks_all_reduce_broadcast_and_commands(tmp_path: Path) -> None:
    run = run_ranks("collectives", tmp_path)
    assert run.returncode == 0, run.stderr
    ranks = read_ranks(tmp_path, run)
    (f0, h0), (f1, h1) = mpi_ranks.inputs(0), mpi_ranks.inputs(1)
    want_f32 = (f0 + f1).tolist()
    want_bf16 = bf16_round(bf16_to_f32(h0) + bf16_to_f32(h1)).tolist()
    payload = mpi_ranks.broadcast_payload().hex()
    for rank, got in enumerate(ranks):
        assert (got["rank"], got["size"]) == (rank, 2)
        assert got["f32"] == want_f32, f"rank {rank}: f32 all-reduce is not the sum"
        assert got["f32_shape"] == [24, 24]
        assert got["bf16"] == want_bf16, f"rank {rank}: bf16 all-reduce is not the sum"
        assert got["from_0"] == payload
        assert got["from_1"] == "rank one says hi"
    assert ranks[1]["commands"] == [mpi_ranks.jsonable(c) for c in mpi_ranks.COMMANDS]
    # Every call was counted with its payload: two f32 all-reduces of 576 values, one bf16,
    # two broadcasts (rank 0's payload and rank 1's greeting), two barriers, and the
    # commands on each side.
    for rank, got in enumerate(ranks):
        costs = got["costs"]
        calls = {op: c["calls"] for op, c in costs.items()}
        command_op = "send_command" if rank == 0 else "recv_command"
        assert calls == {
            "all_reduce_f32": 2,
            "all_reduce_bf16": 1,
            "broadcast": 2,
            "barrier": 2,
            command_op: len(mpi_ranks.COMMANDS),
        }, f"rank {rank}: {calls}"
        assert costs["all_reduce_f32"]["bytes"] == 2 * 4 * mpi_ranks.HIDDEN
        assert costs["all_reduce_bf16"]["bytes"] == 2 * mpi_ranks.HIDDEN
        assert costs["broadcast"]["bytes"] == mpi_ranks.BROADCAST_BYTES + len("rank one says hi")
        assert all(c["seconds"] > 0 for c in costs.values()), costs


def moe_checkpoint(family: str, seed: int, where: Path) -> Path:
    """A tiny random MoE checkpoint (8 routed experts) written by the numpy reference."""
    script = Path(__file__).with_name("moe_target_reference.py")
    subprocess.run(
        [sys.executable, str(script), family, str(where), str(seed), "1,2,3"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return where


def routed_expert_bytes(checkpoint: Path) -> int:
    """BF16 bytes of every routed expert, read from the safetensors header."""
    raw = (checkpoint / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return sum(
        2 * int(np.prod(t["shape"])) for name, t in header.items() if ".mlp.experts." in name
    )


@pytest.mark.parametrize(("family", "seed"), [("glm4_moe", 12), ("qwen3_moe", 56)])
def test_two_ranks_serve_the_same_tokens_as_one_with_half_the_experts_each(
    tmp_path: Path, family: str, seed: int
) -> None:
    checkpoint = moe_checkpoint(family, seed, tmp_path / "ckpt")
    run = run_ranks("engine", tmp_path, str(checkpoint))
    assert run.returncode == 0, run.stderr
    ranks = read_ranks(tmp_path, run)
    gpu = specdraft.CpuBackend()
    model = specdraft.load_model(checkpoint, gpu=gpu, **mpi_ranks.ENGINE_LOAD)
    one_rank_bytes = gpu.live_bytes
    want = mpi_ranks.engine_outputs(model)
    assert ranks[0]["greedy"] == want["greedy"], "greedy: two ranks against one"
    assert ranks[0]["sampled"] == want["sampled"], "sampled, same seed: two ranks against one"
    half = routed_expert_bytes(checkpoint) // 2
    for rank, got in enumerate(ranks):
        assert one_rank_bytes - got["weight_bytes"] == half, f"rank {rank}: not half the experts"
        assert got["live_after"] == 0, f"rank {rank}: allocations left after the model"
    # Two ranks on this host: each runs its kernels on half of the cores.
    cores = len(os.sched_getaffinity(0))
    assert [r["default_threads"] for r in ranks] == [max(1, cores // 2)] * 2
    assert specdraft.CpuBackend().threads == cores
    report = ranks[1]["report"]
    assert report["failed"] == 0, report["last_error"]
    assert report["leftover_sequences"] == 0, "the worker kept sequences rank 0 freed"
    assert report["commands"] > 2 * 3 * 2, report


def word_tokenizer(checkpoint: Path, vocab: int) -> None:
    """A whitespace word-level tokenizer with ids ``w0 .. w{vocab-1}``, for the command line."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(checkpoint / "tokenizer.json"))


def test_the_command_line_under_mpiexec_generates_what_one_rank_does(tmp_path: Path) -> None:
    checkpoint = moe_checkpoint("qwen3_moe", 56, tmp_path / "ckpt")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    word_tokenizer(checkpoint, vocab)
    argv = [sys.executable, "-m", "specdraft.cli", "generate", "--model", str(checkpoint)]
    argv += ["--prompt", "w1 w5 w17 w33 w4 w1 w5", "--no-chat", "--max-tokens", "12"]
    argv += ["--device", "cpu", "--max-seq-len", "64", "--proposer", "prompt-lookup"]
    alone = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert alone.returncode == 0, alone.stderr
    assert len(alone.stdout.split()) >= 6, alone.stdout
    two = run_two(argv)
    assert two.returncode == 0, two.stderr
    assert two.stdout == alone.stdout, "two ranks printed other text than one"
    assert "rank 0 of 2" in two.stderr, two.stderr


def test_the_bench_under_mpiexec_runs_every_proposer_on_the_ranks(tmp_path: Path) -> None:
    checkpoint = moe_checkpoint("qwen3_moe", 56, tmp_path / "ckpt")
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    word_tokenizer(checkpoint, vocab)
    argv = [sys.executable, "-m", "specdraft.cli", "bench", "--model", str(checkpoint)]
    argv += ["--device", "cpu", "--max-seq-len", "256", "--max-tokens", "8", "--prompts", "2"]
    argv += ["--proposer", "prompt-lookup", "--json"]
    run = run_two(argv)
    assert run.returncode == 0, run.stderr
    assert "rank 0 of 2" in run.stderr, run.stderr
    # Only rank 0 prints the figures: stdout is exactly one JSON document.
    report = json.loads(run.stdout)
    rows = {r["proposer"]: r for r in report["results"]}
    assert set(rows) == {"baseline", "prompt-lookup"}, rows
    assert all(r["errors"] == [] and r["tokens"] == 16 for r in rows.values()), rows
    assert rows["prompt-lookup"]["identical_to_baseline"] is True
    # Each of the two ranks ran its kernels on half of the host's cores.
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    isa = specdraft.CpuBackend().instruction_set
    assert report["device"] == f"CpuBackend ({isa}, {threads} threads)"


def test_a_killed_worker_ends_the_whole_job_leaving_nothing(tmp_path: Path) -> None:
    # MPICH's mpiexec ends every rank when one is killed (even with -disable-auto-cleanup,
    # rank 0 is ended at its next communication), so rank 0 never hangs on a dead worker.
    checkpoint = moe_checkpoint("glm4_moe", 12, tmp_path / "ckpt")
    start = time.monotonic()
    run = run_ranks("killed_worker", tmp_path, str(checkpoint))
    # run_ranks has checked that no process of the job is left.
    assert run.returncode != 0
    assert "Killed (signal 9)" in run.stdout + run.stderr
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["loaded"] and "error" not in rank0, rank0
    assert time.monotonic() - start < RUN_TIMEOUT_S / 2


def test_a_rank_that_never_joins_fails_the_other_within_the_timeout(tmp_path: Path) -> None:
    run = run_ranks("hang", tmp_path)
    rank0 = read_ranks(tmp_path, run)[0]
    assert rank0["error"] is not None, "the all-reduce returned though rank 1 never joined"
    assert rank0["error"].startswith(
        "rank 0 of 2: all_reduce_sum_f32 timed out after 3.0 s waiting for rank 1"
    ), rank0["error"]
    assert mpi_ranks.HANG_TIMEOUT_S <= rank0["elapsed_s"] < mpi_ranks.HANG_TIMEOUT_S + 2.0
    assert rank0["after"].startswith("rank 0: barrier refused: the communicator is unusable")


def test_a_worker_waits_for_a_command_no_longer_than_its_command_timeout(tmp_path: Path) -> None:
    run = run_ranks("idle_rank_0", tmp_path)
    rank1 = read_ranks(tmp_path, run)[1]
    assert rank1["error"] is not None, f"recv_command returned {rank1.get('command')}"
    assert rank1["error"].startswith(
        "rank 1 of 2: recv_command timed out after 3.0 s waiting for rank 0"
    ), rank1["error"]
    assert mpi_ranks.HANG_TIMEOUT_S <= rank1["elapsed_s"] < mpi_ranks.HANG_TIMEOUT_S + 2.0


def test_local_communicator_is_rank_0_of_1_with_identity_collectives() -> None:
    comm = Communicator.local()
    assert (comm.rank, comm.size, comm.timeout) == (0, 1, None)
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    got = comm.all_reduce(x)
    assert got.dtype == np.float32 and got.shape == (3, 4)
    np.testing.assert_array_equal(got, x)
    bits = np.array([0x3F80, 0xC0E0, 0x0001], np.uint16)
    np.testing.assert_array_equal(comm.all_reduce(bits, dtype="bf16"), bits)
    assert comm.broadcast(b"abc") == b"abc"
    comm.barrier()
    comm.send_command({"kind": "shutdown"})


def test_local_communicator_refuses_bad_arguments_by_name() -> None:
    comm = Communicator.local()
    with pytest.raises(TypeError, match="expected a float32 array, got dtype float64"):
        comm.all_reduce(np.zeros(3))
    with pytest.raises(TypeError, match="uint16 array, got dtype float32"):
        comm.all_reduce(np.zeros(3, np.float32), dtype="bf16")
    with pytest.raises(ValueError, match="rank 0 is the root and must pass data"):
        comm.broadcast(None)
    with pytest.raises(specdraft.RequestError, match="root 1 is not a rank"):
        comm.broadcast(b"x", root=1)
    with pytest.raises(specdraft.RequestError, match="rank 0 of 1: recv_command"):
        comm.recv_command()
    with pytest.raises(ValueError, match='unknown kind "jump"'):
        comm.send_command({"kind": "jump"})
    with pytest.raises(ValueError, match='"free": unexpected key "tokens"'):
        comm.send_command({"kind": "free", "seq": 1, "tokens": [1]})
    with pytest.raises(ValueError, match='"verify": missing "batch"'):
        comm.send_command({"kind": "verify", "layers": []})
    with pytest.raises(ValueError, match='"prefill": a batch entry has no "tokens"'):
        comm.send_command({"kind": "prefill", "batch": [{"seq": 1}]})
    with pytest.raises(ValueError, match='"mtp_propose_batch": missing "confidences"'):
        comm.send_command(
            {
                "kind": "mtp_propose_batch",
                "states": [1],
                "last_tokens": [2],
                "positions": [3],
                "num_drafts": 1,
                "hidden": b"",
            }
        )


def test_init_without_mpi4py_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "import specdraft.distributed as d\n"
        "try:\n    d.init()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pip install 'specdraft[distributed]'" in out.stdout, out.stdout + out.stderr


def test_two_ranks_with_a_sharded_mtp_head_draft_and_serve_what_one_rank_does(
    tmp_path: Path,
) -> None:
    checkpoint = moe_checkpoint("glm4_moe", 12, tmp_path / "ckpt")
    head_dir = mpi_ranks.write_glm_head(tmp_path / "head", 5)
    run = run_ranks("engine_mtp", tmp_path, str(checkpoint), str(head_dir))
    assert run.returncode == 0, run.stderr
    ranks = read_ranks(tmp_path, run)
    gpu = specdraft.CpuBackend()
    model = specdraft.load_model(checkpoint, gpu=gpu, **mpi_ranks.ENGINE_LOAD)
    head = mpi_ranks.load_head(model, gpu, head_dir)
    assert not head.needs_comm(), "a head beside a one-rank target needs no communicator"
    want = mpi_ranks.head_outputs(model, head)
    assert all(n > 0 for n in want["drafted"]), want["drafted"]
    assert ranks[0]["greedy"] == want["greedy"], "greedy with the head: two ranks against one"
    assert ranks[0]["sampled"] == want["sampled"], "sampled, same seed: two ranks against one"
    assert ranks[0]["drafted"] == want["drafted"], "the sharded head drafted other counts"
    for rank, got in enumerate(ranks):
        assert got["needs_comm"], f"rank {rank}: its head holds half the experts"
        assert got["live_after"] == 0, f"rank {rank}: allocations left after the model"
    report = ranks[1]["report"]
    assert report["failed"] == 0, report["last_error"]
    assert report["leftover_sequences"] == 0, "the worker kept sequences or states rank 0 freed"
    # Two sequences at a time draft in one announced propose_batch.
    assert report["by_kind"].get("mtp_propose_batch", 0) > 0, report["by_kind"]
