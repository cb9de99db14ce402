"""The trainer's JAX forward of the MTP head against the independent numpy reference
(``mtp_reference.py``), and against specdraft's own ``MtpHead`` loaded from the trainer's
exported files: the same weights must draft the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import specdraft

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from specdraft.train.export import tensor_name, write_head  # noqa: E402
from specdraft.train.head import HeadDims, param_shapes, rows_from_window, unroll  # noqa: E402
from specdraft.train.targets import TargetShape  # noqa: E402
from test_mtp_head import FFN, HD, HEADS, KVH, VOCAB, H, ref, write_checkpoint  # noqa: E402

DIMS = HeadDims(H, HEADS, KVH, HD, FFN, 1e-6, 10000.0)
LEVERS = {"mtp_kv_exact": False, "mtp_target_postnorm": False, "mtp_chain_postnorm": False}


def _reference(folder: Path, vocab: int = 0) -> ref.Head:
    return ref.Head(
        {
            "checkpoint": str(folder),
            "layout": "deepseek_v3",
            "quant": "bf16",
            "mtp_vocab_size": vocab,
            "levers": LEVERS,
        }
    )


def _params(folder: Path) -> dict[str, jax.Array]:
    raw = ref.st.read_safetensors(folder / "model.safetensors")
    return {
        part: jnp.asarray(ref.st.to_float32(*raw[tensor_name(1, part)]))
        for part in param_shapes(DIMS)
    }


def _jax_drafts(params, frozen, tokens, hid, base, steps=3):
    """Logits and greedy drafts of the chain drafted after position ``base``."""
    # Positions run on past `base` for the chain; later tokens and hiddens are never read
    # by row `base - 1` (causal) and drafts replace the tokens.
    w = base + 1 + steps
    tok = jnp.asarray(np.asarray(tokens[:w], np.int32)[None])
    pos = jnp.arange(w, dtype=jnp.int32)[None]
    logits = unroll(
        params,
        frozen,
        DIMS,
        rows_from_window(tok, steps),
        rows_from_window(pos, steps),
        jnp.asarray(hid[None, : w - 1]),
        steps,
        feed_drafts=True,
    )
    rows = [np.asarray(lg[0, base - 1]) for lg in logits]
    return rows, [int(np.argmax(r)) for r in rows]


@pytest.fixture
def case(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", "deepseek_v3", seed=5)
    rng = np.random.default_rng(11)
    hid = ref.bf16(rng.uniform(-2, 2, (48, H)).astype(np.float32))
    tokens = [int(x) for x in rng.integers(0, VOCAB, 48)]
    return folder, tokens, hid


@pytest.mark.parametrize("base", [1, 9, 30])
def test_jax_forward_matches_the_numpy_reference(case, base):
    folder, tokens, hid = case
    numpy_head = _reference(folder)
    frozen = {"embed": jnp.asarray(numpy_head.embed), "lm_head": jnp.asarray(numpy_head.lm)}
    got_logits, got = _jax_drafts(_params(folder), frozen, tokens, hid, base)
    # The reference drafts after `base` as the engine does: prefill rows 1..base-1, then
    # the chain from (token at base, target hidden at base - 1).
    for i in range(1, base):
        numpy_head.step(tokens[i], hid[i - 1], i, True, want_logits=False)
    token, hidden = tokens[base], hid[base - 1]
    for j in range(3):
        want, hidden = numpy_head.step(token, hidden, base + j, j == 0)
        scale = float(np.abs(want).max())
        # The reference rounds every activation to BF16, the trainer keeps float32.
        assert np.abs(got_logits[j] - want).max() <= 0.03 * scale, f"step {j}"
        token = int(np.argmax(want))
        assert got[j] == token, f"step {j}"


def test_exported_head_drafts_like_specdraft_mtp_head(tmp_path, case, gpu):
    folder, tokens, hid = case
    draft_vocab = 64
    numpy_head = _reference(folder, draft_vocab)
    params = _params(folder)
    shape = TargetShape(H, HEADS, KVH, HD, FFN, VOCAB, 1, 1e-6, 10000.0, "llama")
    out = tmp_path / "head"
    write_head(out, {k: np.asarray(v) for k, v in params.items()}, shape, DIMS, draft_vocab, {}, "")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mtp_vocab_size"] == draft_vocab and cfg["num_nextn_predict_layers"] == 1
    # Test-only: the target's shared tensors beside the head, so today's loader takes it.
    raw = ref.st.read_safetensors(folder / "model.safetensors")
    shared = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    ref.st.write_safetensors(out / "target.safetensors", {n: raw[n] for n in shared})

    head = specdraft.MtpHead.from_checkpoint(out, gpu, mtp_vocab_size=draft_vocab)
    frozen = {"embed": jnp.asarray(numpy_head.embed), "lm_head": jnp.asarray(numpy_head.lm)}
    ctx = specdraft.ForwardContext(gpu, specdraft.ModelConfig.from_file(out / "config.json"))
    ptr = gpu.upload(hid, dtype="bf16")
    try:
        for base in (6, 20):
            state = head.alloc_state_for(gpu, 100)
            assert head.prefill_drafter(tokens[:base], ptr, state, ctx) == base - 1
            drafts = head.propose(tokens[base], ptr.offset((base - 1) * H * 2), base, 3, state, ctx)
            head.free_state(gpu, state)
            logits, want = _jax_drafts(params, frozen, tokens, hid, base)
            assert all(d < draft_vocab for d in want)
            # A draft may differ only where float32 and BF16 arithmetic can disagree: a
            # top-2 margin inside the BF16 tolerance. Later drafts follow the first one.
            for j, (d, w) in enumerate(zip(drafts, want, strict=True)):
                top2 = np.sort(logits[j])[-2:]
                if top2[1] - top2[0] > 0.03 * np.abs(logits[j]).max():
                    assert d == w, f"base {base} step {j}: MtpHead {d}, trainer {w}"
                if d != w:
                    break
    finally:
        gpu.free(ptr)
        del head
