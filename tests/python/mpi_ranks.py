"""One rank of the two-rank communicator tests, run under ``mpiexec -n 2``.

``python mpi_ranks.py SCENARIO OUTDIR [CHECKPOINT]``: each rank writes what it saw to
``OUTDIR/rank<r>.json``; the test (tests/python/test_distributed.py) checks it against
values computed from :func:`inputs`, never from the communicator.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

HIDDEN = 576
BROADCAST_BYTES = 70_000
HANG_TIMEOUT_S = 3.0

COMMANDS: list[dict] = [
    {"kind": "prefill", "batch": [{"seq": 1, "tokens": [5, 6, 7, 49151]}], "layers": [1]},
    {"kind": "proposer_alloc", "state": 77, "budget": 2**64 - 1},
    {"kind": "proposer_prefill", "state": 77, "tokens": [5, 6, 7], "hidden": bytes(range(12))},
    {
        "kind": "mtp_propose",
        "state": 77,
        "last_token": 7,
        "position": 3,
        "num_drafts": 3,
        "hidden": b"\x01\x02\x03\x04",
        "grammar": [-1, 5],
    },
    {
        "kind": "verify",
        "batch": [{"seq": 1, "tokens": [8, 9, 10, 11]}, {"seq": 2, "tokens": [4]}],
        "layers": [],
        "trees": [[0, 0, 1], None],
    },
    {"kind": "trim", "seq": 1, "len": 6},
    {"kind": "compact", "seq": 2, "start": 3, "rows": [4, 6]},
    {"kind": "proposer_after_verify", "state": 77, "accepted": 2},
    {
        "kind": "proposer_catchup",
        "state": 77,
        "tokens": [9],
        "hidden": b"\xff\x00",
        "row_base": 4,
        "pos_base": 5,
    },
    {
        "kind": "mtp_propose",
        "state": 77,
        "last_token": 1,
        "position": 6,
        "num_drafts": 0,
        "hidden": b"",
        "grammar": None,
    },
    {
        "kind": "mtp_propose_batch",
        "states": [77, 2**64 - 1],
        "last_tokens": [7, 49151],
        "positions": [6, 30],
        "num_drafts": 2,
        "hidden": bytes(range(8)),
        "confidences": True,
    },
    {"kind": "proposer_free", "state": 77},
    {"kind": "free", "seq": 1},
    {"kind": "shutdown"},
]

# The engine scenario: prompts, output length and sampling seed.
ENGINE_PROMPTS: list[list[int]] = [
    [1, 5, 17, 33, 4, 90, 12, 12, 7, 64],
    [11, 12, 13, 11, 12, 13, 11, 12],
    [3, 22, 45, 8, 8, 61],
]
ENGINE_TOKENS = 14
ENGINE_LOAD = {"max_rows": 32, "max_seq_len": 64, "kv_blocks": 16}


def jsonable(command: dict) -> dict:
    """``command`` with its bytes values as hex strings, as the rank's JSON report holds it."""
    return {k: v.hex() if isinstance(v, bytes) else v for k, v in command.items()}


def inputs(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s float32 row and its bf16 row (bit patterns in uint16)."""
    rng = np.random.default_rng(1000 + rank)
    f32 = rng.standard_normal(HIDDEN).astype(np.float32) * np.float32(10.0**rank)
    bf16_bits = (rng.standard_normal(HIDDEN).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16
    )
    return f32, bf16_bits


def broadcast_payload() -> bytes:
    """What rank 0 broadcasts."""
    return np.random.default_rng(7).integers(0, 256, BROADCAST_BYTES, dtype=np.uint8).tobytes()


def collectives(out: dict, backend: str = "mpi") -> None:
    """All-reduce, broadcast both ways, barrier and the command channel."""
    import specdraft.distributed as dist

    comm = dist.init(timeout=30.0, backend=backend)
    rank = comm.rank
    out["rank"], out["size"] = rank, comm.size
    f32, bf16_bits = inputs(rank)
    out["f32"] = comm.all_reduce(f32.reshape(24, 24)).reshape(-1).tolist()
    out["f32_shape"] = list(comm.all_reduce(f32.reshape(24, 24)).shape)
    out["bf16"] = comm.all_reduce(bf16_bits, dtype="bf16").tolist()
    payload = broadcast_payload() if rank == 0 else None
    out["from_0"] = comm.broadcast(payload, root=0).hex()
    out["from_1"] = comm.broadcast(b"rank one says hi" if rank == 1 else None, root=1).decode()
    comm.barrier()
    if rank == 0:
        for cmd in COMMANDS:
            comm.send_command(cmd)
        out["commands"] = []
    else:
        got = []
        while not got or got[-1]["kind"] != "shutdown":
            got.append(comm.recv_command())
        out["commands"] = [jsonable(c) for c in got]
    comm.barrier()
    out["costs"] = comm.costs()


def hang(out: dict) -> None:
    """Rank 1 never joins: rank 0's all-reduce must fail in time, naming rank 1."""
    import specdraft
    import specdraft.distributed as dist

    comm = dist.init(timeout=HANG_TIMEOUT_S)
    out["rank"] = comm.rank
    if comm.rank == 1:
        # Stay alive past rank 0's timeout without joining anything: a hung worker.
        time.sleep(HANG_TIMEOUT_S + 2.0)
        return
    start = time.monotonic()
    try:
        comm.all_reduce(np.ones(HIDDEN, np.float32))
        out["error"] = None
    except specdraft.BackendError as e:
        out["error"] = str(e)
    out["elapsed_s"] = time.monotonic() - start
    try:
        comm.barrier()
        out["after"] = None
    except specdraft.BackendError as e:
        out["after"] = str(e)


def idle_rank_0(out: dict) -> None:
    """Rank 0 never sends a command: rank 1's recv_command must fail after command_timeout."""
    import specdraft
    import specdraft.distributed as dist

    comm = dist.init(timeout=30.0, command_timeout=HANG_TIMEOUT_S)
    out["rank"] = comm.rank
    if comm.rank == 0:
        time.sleep(HANG_TIMEOUT_S + 2.0)
        return
    start = time.monotonic()
    try:
        out["command"] = comm.recv_command()
        out["error"] = None
    except specdraft.BackendError as e:
        out["error"] = str(e)
    out["elapsed_s"] = time.monotonic() - start


def nccl(out: dict) -> None:
    """The collectives over NCCL, or the error ``init(backend="nccl")`` raised on this rank."""
    import specdraft
    from mpi4py import MPI

    out["rank"] = MPI.COMM_WORLD.Get_rank()
    try:
        collectives(out, backend="nccl")
        out["error"] = None
    except (specdraft.BackendUnavailableError, specdraft.BackendError) as e:
        # A rank whose GPU is missing fails; one waiting for it in NCCL's start-up times out.
        out["error"], out["error_type"] = str(e), type(e).__name__


def engine_outputs(model: object) -> dict:
    """Greedy and seeded sampled outputs of :data:`ENGINE_PROMPTS` with prompt-lookup drafts;
    the test runs the same on one rank."""
    import specdraft

    engine = specdraft.SpecEngine(
        model, specdraft.PromptLookup(), 4, draft_policy="fixed", max_batch=2
    )
    with engine:
        greedy = engine.generate(ENGINE_PROMPTS, max_tokens=ENGINE_TOKENS, ignore_eos=True)
        sampled = engine.generate(
            ENGINE_PROMPTS, max_tokens=ENGINE_TOKENS, temperature=0.9, seed=7, ignore_eos=True
        )
    return {"greedy": [r.tokens for r in greedy], "sampled": [r.tokens for r in sampled]}


# The MTP head of the head scenario: GLM-4.5's layout (8 routed experts in 2 groups of which
# 1 is kept, top-2, one shared expert) for the tiny GLM target of moe_target_reference.py.
HEAD_LAYER, HEAD_EXPERTS, HEAD_EXPERT_FFN = 3, 8, 32
HEAD_DRAFTS = 3


def write_glm_head(folder: Path, seed: int) -> Path:
    """A tiny random GLM-4.5 MTP head (``model.layers.3.*``: enorm, hnorm, eh_proj, one
    decoder layer with routed and shared experts, shared_head) for the 96-token, 64-wide
    GLM target; only the head's own weights, the rest is the target's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python" / "specdraft"))
    import quantize as st  # its safetensors writer; numpy only

    h, heads, kvh, hd, vocab = 64, 4, 2, 16, 96
    rng = np.random.default_rng(seed)
    raw: dict[str, tuple[str, list[int], bytes]] = {}

    def put(name: str, shape: list[int], scale: float, base: float = 0.0) -> None:
        x = (base + rng.uniform(-scale, scale, shape)).astype(np.float32)
        bits = x.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        raw[name] = ("BF16", list(shape), bits.astype("<u2").tobytes())

    def swiglu(prefix: str, width: int) -> None:
        put(f"{prefix}.gate_proj.weight", [width, h], 1.5 / np.sqrt(h))
        put(f"{prefix}.up_proj.weight", [width, h], 1.5 / np.sqrt(h))
        put(f"{prefix}.down_proj.weight", [h, width], 1.5 / np.sqrt(width))

    p = f"model.layers.{HEAD_LAYER}."
    for norm in (
        "enorm",
        "hnorm",
        "shared_head.norm",
        "input_layernorm",
        "post_attention_layernorm",
    ):
        put(f"{p}{norm}.weight", [h], 0.2, 1.0)
    put(f"{p}eh_proj.weight", [h, 2 * h], 1 / np.sqrt(2 * h))
    put(f"{p}shared_head.head.weight", [vocab, h], 3 / np.sqrt(h))
    s = 1.5 / np.sqrt(h)
    put(f"{p}self_attn.q_proj.weight", [heads * hd, h], s)
    put(f"{p}self_attn.k_proj.weight", [kvh * hd, h], s)
    put(f"{p}self_attn.v_proj.weight", [kvh * hd, h], s)
    put(f"{p}self_attn.o_proj.weight", [h, heads * hd], s)
    put(f"{p}mlp.gate.weight", [HEAD_EXPERTS, h], 2 / np.sqrt(h))
    put(f"{p}mlp.gate.e_score_correction_bias", [HEAD_EXPERTS], 0.1)
    swiglu(f"{p}mlp.shared_experts", HEAD_EXPERT_FFN)
    for e in range(HEAD_EXPERTS):
        swiglu(f"{p}mlp.experts.{e}", HEAD_EXPERT_FFN)
    folder.mkdir(parents=True, exist_ok=True)
    st.write_safetensors(folder / "model.safetensors", raw)
    cfg = {
        "model_type": "glm4_moe",
        "hidden_size": h,
        "intermediate_size": 96,
        "num_hidden_layers": HEAD_LAYER,
        "num_attention_heads": heads,
        "num_key_value_heads": kvh,
        "head_dim": hd,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "partial_rotary_factor": 0.5,
        "n_routed_experts": HEAD_EXPERTS,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": HEAD_EXPERT_FFN,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_group": 2,
        "topk_group": 1,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def load_head(model: object, gpu: object, folder: str | Path) -> object:
    """The MTP head in ``folder`` beside ``model``: on a sharded model, this rank's share of
    its routed experts."""
    import specdraft

    load = ENGINE_LOAD
    return specdraft.MtpHead.from_checkpoint(
        folder, gpu, target=model, max_seq_len=load["max_seq_len"], main_kv_blocks=load["kv_blocks"]
    )


def head_outputs(model: object, head: object) -> dict:
    """Greedy and seeded sampled outputs of :data:`ENGINE_PROMPTS` with the MTP head drafting
    :data:`HEAD_DRAFTS` a step, and how many it drafted; the test runs the same on one rank."""
    import specdraft

    engine = specdraft.SpecEngine(model, head, HEAD_DRAFTS, draft_policy="fixed", max_batch=2)
    out: dict = {"drafted": []}
    with engine:
        for name, sampling in (("greedy", {}), ("sampled", {"temperature": 0.9, "seed": 7})):
            results = engine.generate(
                ENGINE_PROMPTS, max_tokens=ENGINE_TOKENS, ignore_eos=True, **sampling
            )
            assert all(r.error is None for r in results), [str(r.error) for r in results]
            out[name] = [r.tokens for r in results]
            out["drafted"].append(sum(r.metrics["drafted"] for r in results))
    return out


def engine_mtp(out: dict) -> None:
    """As :func:`engine`, with the MTP head in argv[4] drafting beside each rank's half of the
    target: rank 0 generates with it, rank 1 serves its calls with run_worker()."""
    import specdraft
    import specdraft.distributed as dist

    comm = dist.init(timeout=60.0)
    out["rank"] = comm.rank
    gpu = specdraft.CpuBackend()
    model = specdraft.load_model(sys.argv[3], gpu=gpu, comm=comm, **ENGINE_LOAD)
    head = load_head(model, gpu, sys.argv[4])
    out["needs_comm"] = head.needs_comm()
    if comm.rank == 0:
        out.update(head_outputs(model, head))
    else:
        out["report"] = specdraft.SpecEngine(model, head).run_worker()
    del head, model
    out["live_after"] = gpu.live_allocs


def engine(out: dict) -> None:
    """Both ranks load their half of the routed experts of the checkpoint in argv[3]; rank 0
    generates, rank 1 serves it with run_worker()."""
    import specdraft
    import specdraft.distributed as dist

    comm = dist.init(timeout=60.0)
    out["rank"] = comm.rank
    gpu = specdraft.CpuBackend()
    model = specdraft.load_model(sys.argv[3], gpu=gpu, comm=comm, **ENGINE_LOAD)
    out["weight_bytes"] = gpu.live_bytes
    if comm.rank == 0:
        out.update(engine_outputs(model))
    else:
        out["report"] = specdraft.SpecEngine(model).run_worker()
    del model
    out["live_after"] = gpu.live_allocs
    # Without a backend given, each rank's kernels take its share of the host's cores.
    shared = specdraft.load_model(sys.argv[3], comm=comm, **ENGINE_LOAD)
    out["default_threads"] = shared.gpu.threads


def killed_worker(out: dict) -> None:
    """Rank 1 is killed (SIGKILL) after loading while rank 0 generates: mpiexec ends the job.

    Rank 0 records an error if its generate ever returns (it must not: the job ends)."""
    import os
    import signal

    import specdraft
    import specdraft.distributed as dist

    comm = dist.init(timeout=HANG_TIMEOUT_S)
    out["rank"] = comm.rank
    model = specdraft.load_model(sys.argv[3], comm=comm, **ENGINE_LOAD)
    out["loaded"] = True
    if comm.rank == 0:
        # What rank 0 has so far, in case the job is ended under it.
        (Path(sys.argv[2]) / "rank0.json").write_text(json.dumps(out))
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    engine = specdraft.SpecEngine(model, draft_policy="fixed")
    try:
        results = engine.generate(ENGINE_PROMPTS[:1], max_tokens=4, ignore_eos=True)
        out["error"] = results[0].error and str(results[0].error)
        out["error_type"] = type(results[0].error).__name__
    except specdraft.BackendError as e:
        out["error"], out["error_type"] = str(e), "BackendError (raised)"
    out["elapsed_s"] = time.monotonic() - start


def main() -> None:
    """Runs the scenario named on the command line and writes this rank's findings."""
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    out: dict = {}
    scenarios = {
        "collectives": collectives,
        "hang": hang,
        "idle_rank_0": idle_rank_0,
        "engine": engine,
        "engine_mtp": engine_mtp,
        "killed_worker": killed_worker,
        "nccl": nccl,
    }
    scenarios[scenario](out)
    (outdir / f"rank{out['rank']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
