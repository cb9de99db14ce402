"""``specdraft train --method dflash`` on a tiny random llama of six layers (the EAGLE-3
tests' GGUF): the loss falls, the folder is z-lab's layout with the config the Rust head
reads, ``specdraft.DFlashHead`` loads it and drafts losslessly, a resumed run equals an
uninterrupted one. The JAX block forward agrees with an independent numpy forward written
from the paper, its attention sees exactly the context before a block's anchor and the
whole block, the loss is the paper's, the anchors lie in the reply, the engine walk is
exact on a drafter forced right and wrong, the mask token is a special token the text never
holds, and the default layers share EAGLE-3's cache."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import specdraft

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("gguf")
import jax.numpy as jnp  # noqa: E402
from specdraft.cli import build_parser  # noqa: E402
from specdraft.quantize import read_safetensors  # noqa: E402
from specdraft.tokenizer import load_tokenizer  # noqa: E402
from specdraft.train.cache import HiddenCache, bf16_bits, from_bf16_bits  # noqa: E402
from specdraft.train.dflash import (  # noqa: E402
    DFlashShape,
    _zlab_layer_ids,
    block_hidden,
    block_logits,
    dflash_loss,
    param_shapes,
    sample_anchors,
    target_layer_ids,
)
from specdraft.train.evaluate_dflash import evaluate_dflash  # noqa: E402
from specdraft.train.export_dflash import dflash_config, read_dflash, write_dflash  # noqa: E402
from specdraft.train.layer import HeadDims, head_dims  # noqa: E402
from specdraft.train.method_dflash import choose_mask_token  # noqa: E402
from specdraft.train.method_dflash import make as make_dflash  # noqa: E402
from specdraft.train.methods import load_method  # noqa: E402
from specdraft.train.pipeline import (  # noqa: E402
    RunOptions,
    _frozen,
    default_cache_folder,
    train_head,
)
from specdraft.train.targets import TargetShape, read_target_weights, target_shape  # noqa: E402
from specdraft.train.trainer import Batches, Trainer, TrainSettings  # noqa: E402
from test_engine import VOCAB  # noqa: E402
from test_train_eagle3 import write_deep_chat_gguf  # noqa: E402
from test_train_mtp import _conversations  # noqa: E402
from tiny_gguf import HIDDEN  # noqa: E402

LAYERS = 6
# The outputs EAGLE-3's test captures (its aux layers 2, 3, 4), so the two share a cache.
TAPS = (1, 2, 3)
# The first 256 ids (the bytes); the fixture's special tokens lie above them.
DRAFT_VOCAB = 256
SETTINGS = TrainSettings(epochs=3, batch=4, seq_len=64, lr=3e-3, checkpoint_every=5)
# The fixture's one special token that is no chat marker: <pad>.
PAD = 259


def _options(root: Path) -> RunOptions:
    return RunOptions(
        method="dflash",
        target=str(root / "tiny-deep.gguf"),
        out=root / "head",
        tokens=2500,
        draft_vocab=DRAFT_VOCAB,
        aux_layers=TAPS,
        eval_prompts=3,
        eval_new_tokens=12,
        eval_fraction=0.1,
        cache=root / "cache",
        settings=SETTINGS,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    write_deep_chat_gguf(root / "tiny-deep.gguf")
    opts = _options(root)
    report = train_head(opts, conversations=_conversations(120))
    return opts, report


def _shape(opts: RunOptions) -> TargetShape:
    model = specdraft.load_model(opts.target)
    shape = target_shape(model.config)
    del model
    return shape


def test_the_loss_falls_on_a_fixed_batch(run):
    opts, report = run
    assert report["method"] == "dflash" and report["steps"] == report["total_steps"] >= 24
    shape = _shape(opts)
    d = head_dims(shape)
    method = make_dflash(shape, TAPS, mask_token=report["mask_token_id"])
    trained = {k: jnp.asarray(v) for k, v in read_dflash(opts.out, d, method.head).items()}
    frozen = _frozen(read_target_weights(opts.target), DRAFT_VOCAB, np.arange(DRAFT_VOCAB))
    cache = HiddenCache(opts.cache, str(opts.target), shape.hidden)
    trainer = Trainer(d, frozen, SETTINGS, 10, loss=method.loss_fn(d, SETTINGS.steps))
    batch = Batches(cache, SETTINGS).batch(0)
    before, _ = trainer.loss(method.init_params(d, SETTINGS.seed, None), batch)
    after, per_row = trainer.loss(trained, batch)
    # The stated margin: training takes at least half the cross-entropy away.
    assert after <= 0.5 * before, (before, after)
    assert per_row.shape == (7,) and np.all(per_row > 0)


def test_the_folder_is_zlabs_layout(run):
    opts, report = run
    shape = _shape(opts)
    h, ffn, hd = HIDDEN, shape.ffn, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    raw = read_safetensors(opts.out / "model.safetensors")
    want = {"fc.weight": [h, 3 * h], "hidden_norm.weight": [h], "norm.weight": [h]}
    for i in range(2):
        p = f"layers.{i}."
        want.update(
            {
                p + "self_attn.q_proj.weight": [q, h],
                p + "self_attn.k_proj.weight": [kv, h],
                p + "self_attn.v_proj.weight": [kv, h],
                p + "self_attn.o_proj.weight": [h, q],
                p + "self_attn.q_norm.weight": [hd],
                p + "self_attn.k_norm.weight": [hd],
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "mlp.gate_proj.weight": [ffn, h],
                p + "mlp.up_proj.weight": [ffn, h],
                p + "mlp.down_proj.weight": [h, ffn],
            }
        )
    assert {n: (v[0], v[1]) for n, v in raw.items()} == {n: ("BF16", s) for n, s in want.items()}
    config = json.loads((opts.out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"target_layer_ids": [1, 2, 3], "mask_token_id": PAD}
    assert (config["block_size"], config["num_hidden_layers"]) == (8, 2)
    assert config["num_target_layers"] == LAYERS and config["vocab_size"] == VOCAB
    assert (config["hidden_size"], config["intermediate_size"]) == (h, ffn)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["head_dim"] == hd and config["rms_norm_eps"] == shape.rms_norm_eps
    assert config["rope_theta"] == shape.rope_theta
    assert config["max_position_embeddings"] == 2048
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["specdraft_target"]["file"] == Path(opts.target).name
    # The cache holds the target layers and the last layer, as EAGLE-3's for its aux 2, 3, 4.
    assert report["cache_layers"] == [1, 2, 3, LAYERS - 1]
    assert (report["block_size"], report["draft_layers"], report["loss_decay"]) == (8, 2, 4.0)
    assert report["acceptance"]["drafts"] == 7
    card = (opts.out / "README.md").read_text()
    assert "# DFlash draft head" in card and "exp(-(j - 1) / 4)" in card
    assert f"{report['acceptance']['mean_acceptance_length']:.3f}" in card


def test_the_trained_head_loads_and_drafts_losslessly(run, gpu):
    if not hasattr(specdraft, "DFlashHead"):
        pytest.fail(
            "specdraft.DFlashHead is not in this build: the trained head cannot be loaded, "
            "checked with check_proposer or run through SpecEngine"
        )
    opts, report = run
    model = specdraft.load_model(opts.target, gpu=gpu, max_rows=64, max_seq_len=256)
    head = specdraft.DFlashHead.from_checkpoint(
        opts.out, gpu, target=model, draft_vocab=DRAFT_VOCAB
    )
    assert head.target_layer_ids() == list(TAPS) and head.block_gamma() == 8
    assert (head.mask_token_id, head.num_layers) == (report["mask_token_id"], 2)
    assert head.draft_vocab_size == DRAFT_VOCAB
    check = specdraft.check_proposer(head, gpu=gpu, vocab_size=VOCAB, hidden_size=HIDDEN)
    assert check.ok, check.violations
    prompts = [[257, 1, 2, 3, 4], [257, 40, 41], [257, 10, 10, 10, 10, 10, 10]]
    plain = specdraft.SpecEngine(model).generate(prompts, max_tokens=24, ignore_eos=True)
    drafted = specdraft.SpecEngine(model, head).generate(prompts, max_tokens=24, ignore_eos=True)
    assert [list(r.tokens) for r in drafted] == [list(r.tokens) for r in plain]
    assert all(r.error is None for r in drafted)
    assert sum(r.metrics["drafted"] for r in drafted) > 0
    _drafts_as_the_trainer_computes_them(opts, report, model, head, gpu)
    del head, model, plain, drafted


def _drafts_as_the_trainer_computes_them(opts, report, model, head, gpu) -> None:
    """The loaded head drafts what the trainer's forward drafts from the same weights (as
    written, BF16) and the target's own captured rows, but at near-ties."""
    shape = target_shape(model.config)
    d = head_dims(shape)
    s = make_dflash(shape, TAPS, mask_token=report["mask_token_id"]).head
    params = {k: jnp.asarray(v) for k, v in read_dflash(opts.out, d, s).items()}
    weights = read_target_weights(opts.target)
    # The target holds its embedding and LM head in BF16.
    embed = from_bf16_bits(bf16_bits(weights.embed))
    lm_head = from_bf16_bits(bf16_bits(weights.lm_head))[:DRAFT_VOCAB]
    frozen = {"embed": jnp.asarray(embed), "lm_head": jnp.asarray(lm_head)}
    cache = HiddenCache(opts.cache, str(opts.target), shape.hidden)
    seq = max(cache.split("train"), key=lambda x: x.length)
    tokens_all, _ = cache.open_arrays()
    tokens = [int(t) for t in tokens_all[seq.offset : seq.offset + seq.length]]
    stack = model.hidden_states(tokens, layers=list(TAPS))  # [n, 3H], as the engine captures
    rows = from_bf16_bits(bf16_bits(np.asarray(stack, np.float32)))
    row = 3 * HIDDEN
    stack_ptr = gpu.upload(stack, dtype="bf16")
    final_ptr = gpu.upload(np.zeros((len(tokens), HIDDEN), np.float32), dtype="bf16")
    ctx = specdraft.ForwardContext(gpu, model.config, target_hidden_stack=stack_ptr)
    plain = specdraft.ForwardContext(gpu, model.config)
    bases = [8, 20, len(tokens) - 9]
    hidden = block_hidden(
        params,
        frozen,
        d,
        s,
        jnp.asarray(np.asarray(tokens, np.int32)[None]),
        jnp.asarray(rows[None]),
        jnp.asarray([bases], jnp.int32),
    )
    want_logits = np.asarray(block_logits(frozen, hidden))[0]  # [bases, 7, draft vocab]
    compared = 0
    try:
        for b, base in enumerate(bases):
            state = head.alloc_state_for(gpu, 256)
            assert head.prefill_drafter(tokens[:base], final_ptr, state, ctx) == base - 1
            drafts = head.propose(
                tokens[base],
                final_ptr.offset((base - 1) * HIDDEN * 2),
                base,
                7,
                state,
                plain,
                target_hidden_stack=stack_ptr.offset((base - 1) * row * 2),
            )
            assert len(drafts) == 7
            for j, lg in enumerate(want_logits[b]):
                scale = float(np.abs(lg).max())
                # The head rounds activations to BF16, the trainer keeps float32: the stated
                # tolerance is 1.5% of the logits' scale (measured: at most 0.6%).
                err = float(np.abs(head.last_logits(gpu, j) - lg).max())
                assert err <= 0.015 * scale, f"base {base} row {j}: {err} > 1.5% of {scale}"
                # Where the trainer's top two logits lie further apart than the two forwards
                # can move them, the head drafts the trainer's pick.
                top2 = np.sort(lg)[-2:]
                if top2[1] - top2[0] > 2 * err:
                    assert drafts[j] == int(np.argmax(lg)), f"base {base} row {j}"
                    compared += 1
            head.free_state(gpu, state)
    finally:
        gpu.free(stack_ptr)
        gpu.free(final_ptr)
    assert compared >= 6, "too few drafts outside near-ties to compare"


def test_a_resumed_run_equals_an_uninterrupted_one(run, tmp_path):
    opts, first = run
    part = replace(opts, out=tmp_path / "head", max_steps=4)
    assert train_head(part, conversations=_conversations(120))["steps"] == 4
    rest = train_head(replace(part, max_steps=None, resume=True), conversations=_conversations(120))
    assert rest["steps"] == first["steps"] and rest["mask_token_id"] == first["mask_token_id"]
    a = read_safetensors(opts.out / "model.safetensors")
    b = read_safetensors(tmp_path / "head" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


# Sizes of the forward tests: GQA 4 query heads over 2 KV heads, three taps, two layers.
H, HEADS, KVH, HD, FFN, RVOCAB = 64, 4, 2, 16, 96, 100
DIMS = HeadDims(H, HEADS, KVH, HD, FFN, 1e-6, 10000.0)
HEAD = DFlashShape((1, 2, 3), 2, 8, 97, 4.0)


def _random_params(d: HeadDims, s: DFlashShape, seed: int) -> dict[str, np.ndarray]:
    """Weights large enough that every input moves the output well above rounding."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(d, s).items():
        if len(shape) == 1:
            out[name] = rng.uniform(0.8, 1.2, shape).astype(np.float32)
        else:
            bound = 1.5 / math.sqrt(shape[1])
            out[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
    return out


def _frozen_random(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.uniform(-1, 1, (RVOCAB, H)).astype(np.float32),
        "lm_head": rng.uniform(-3 / math.sqrt(H), 3 / math.sqrt(H), (RVOCAB, H)).astype(np.float32),
        "target_norm": rng.uniform(0.8, 1.2, H).astype(np.float32),
    }


def _np_rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _np_rope(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of ``x`` ``[T, heads, hd]`` (Qwen3's and Llama's)."""
    half = HD // 2
    inv = 1.0 / 10000.0 ** (np.arange(half) * 2.0 / HD)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _np_block(p, frozen, tokens, rows, a, s=HEAD):
    """One block's drafting logits ``[G - 1, V]``, written from the paper in float64.

    As z-lab's model runs it: the context is positions ``0 .. a - 1`` of ``rows``; each
    layer's keys and values are the concatenation of the context's projections and the
    block's, and the block attends to all of it.
    """
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    g = s.block_size
    ctx = _np_rms(rows[:a, : s.taps * H].astype(np.float64) @ p["fc"].T, p["hidden_norm"])
    x = np.asarray(frozen["embed"], np.float64)[[tokens[a]] + [s.mask_token_id] * (g - 1)]
    pos = np.arange(a + g, dtype=np.float64)
    for i in range(s.layers):
        w = {k[len(f"layers.{i}.") :]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        h = _np_rms(x, w["input_layernorm"])
        q = _np_rms((h @ w["self_attn.q_proj"].T).reshape(g, HEADS, HD), w["self_attn.q_norm"])
        q = _np_rope(q, pos[a:])
        both = np.concatenate([ctx, h])
        k = _np_rms((both @ w["self_attn.k_proj"].T).reshape(-1, KVH, HD), w["self_attn.k_norm"])
        k = _np_rope(k, pos)
        v = (both @ w["self_attn.v_proj"].T).reshape(-1, KVH, HD)
        out = np.zeros((g, HEADS, HD))
        for head in range(HEADS):
            kvh = head // (HEADS // KVH)
            scores = q[:, head] @ k[:, kvh].T / math.sqrt(HD)
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[:, head] = (probs / probs.sum(axis=-1, keepdims=True)) @ v[:, kvh]
        x = x + out.reshape(g, -1) @ w["self_attn.o_proj"].T
        m = _np_rms(x, w["post_attention_layernorm"])
        gate = m @ w["mlp.gate_proj"].T
        x = x + (gate / (1 + np.exp(-gate)) * (m @ w["mlp.up_proj"].T)) @ w["mlp.down_proj"].T
    return _np_rms(x, p["norm"])[1:] @ np.asarray(frozen["lm_head"], np.float64).T


def _case(seed: int, length: int = 24):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, RVOCAB - 4, (1, length)).astype(np.int32)
    rows = rng.uniform(-2, 2, (1, length, (HEAD.taps + 1) * H)).astype(np.float32)
    return tokens, rows


def _jax_logits(params, frozen, tokens, rows, anchors, s=HEAD):
    hidden = block_hidden(
        {k: jnp.asarray(v) for k, v in params.items()},
        {k: jnp.asarray(v) for k, v in frozen.items()},
        DIMS,
        s,
        jnp.asarray(tokens),
        jnp.asarray(rows),
        jnp.asarray(anchors, jnp.int32),
    )
    return np.asarray(block_logits({"lm_head": jnp.asarray(frozen["lm_head"])}, hidden))


def test_the_jax_block_forward_matches_an_independent_numpy_forward():
    params, frozen = _random_params(DIMS, HEAD, 1), _frozen_random(2)
    tokens, rows = _case(3)
    # Several blocks of one row in one forward, one with no context and one past the end.
    anchors = np.array([[0, 5, 13, 20]])
    got = _jax_logits(params, frozen, tokens, rows, anchors)
    for n, a in enumerate(anchors[0]):
        want = _np_block(params, frozen, tokens[0], rows[0], int(a))
        # float32 against float64: the stated tolerance is 1e-4 of the logits' scale.
        scale = float(np.abs(want).max())
        assert np.abs(got[0, n] - want).max() <= 1e-4 * scale, f"block at {a}"
        assert np.array_equal(np.argmax(got[0, n], axis=-1), np.argmax(want, axis=-1))


@pytest.mark.parametrize("pos", [1, 9, 17])
def test_the_jax_block_forward_matches_the_numpy_dflash_reference(tmp_path, pos):
    """The head as written (z-lab's layout) drafts in the JAX forward what the numpy reference
    of ``specdraft.DFlashHead``'s tests drafts from the same checkpoint."""
    import dflash_reference as ref

    params, frozen = _random_params(DIMS, HEAD, 13), _frozen_random(14)
    shape = TargetShape(H, HEADS, KVH, HD, FFN, RVOCAB, 8, 1e-6, 10000.0, "llama")
    write_dflash(tmp_path, params, dflash_config(shape, DIMS, HEAD, RVOCAB, {"name": "x"}), "")
    embed, lm_head = ref.bf16(frozen["embed"]), ref.bf16(frozen["lm_head"])
    numpy_head = ref.DFlash(tmp_path, embed, lm_head)
    assert (numpy_head.block_size, numpy_head.mask_token_id) == (8, 97)
    assert list(numpy_head.taps) == [1, 2, 3]
    tokens, rows = _case(15)
    rows = ref.bf16(rows)
    numpy_head.add_context(rows[0, :pos, : HEAD.taps * H], 0)
    _, want = numpy_head.block(int(tokens[0, pos]), pos)
    written = read_dflash(tmp_path, DIMS, HEAD)  # the weights as written, BF16
    got = _jax_logits(written, {"embed": embed, "lm_head": lm_head}, tokens, rows, [[pos]])[0, 0]
    # The reference rounds every activation to BF16, the trainer keeps float32: the stated
    # tolerance is 3% of the logits' scale, and drafts agree outside near-ties of that size.
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 0.03 * scale
    top2 = np.sort(want, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.06 * scale
    assert clear.sum() >= 3
    assert np.array_equal(np.argmax(got, -1)[clear], np.argmax(want, -1)[clear])


def test_a_block_sees_the_context_before_its_anchor_and_its_whole_block():
    params, frozen = _random_params(DIMS, HEAD, 4), _frozen_random(5)
    tokens, rows = _case(6)
    anchors = np.array([[6, 14]])
    base = _jax_logits(params, frozen, tokens, rows, anchors)

    def moved(t, r, s=HEAD):
        return np.abs(_jax_logits(params, frozen, t, r, anchors, s) - base).max(axis=(2, 3))[0]

    rng = np.random.default_rng(7)
    # The context at and after the anchor (the target's rows at positions 6 .. 23) and the
    # tokens after it: the block at 6 does not move; the block at 14 does (it sees 6 .. 13).
    r = rows.copy()
    r[0, 6:] = rng.uniform(-2, 2, r[0, 6:].shape)
    t = tokens.copy()
    t[0, 7:14] = (t[0, 7:14] + 1) % RVOCAB
    first, second = moved(t, r)
    assert first <= 1e-6 and second > 1e-3
    # The row at the anchor alone is not context: the target's hidden there is not known yet.
    r = rows.copy()
    r[0, 14] += 1.0
    first, second = moved(tokens, r)
    assert first <= 1e-6 and second <= 1e-6
    # Another block's anchor token: only that block moves.
    t = tokens.copy()
    t[0, 14] = (t[0, 14] + 1) % RVOCAB
    first, second = moved(t, rows)
    assert first <= 1e-6 and second > 1e-3
    # The context just before the anchor moves the block.
    r = rows.copy()
    r[0, 5] += 1.0
    first, _ = moved(tokens, r)
    assert first > 1e-3
    # Inside the block attention is not causal: the anchor's row reads the mask rows after
    # it, so another mask token moves the anchor row's output (a causal block's would stay).
    hidden = [
        np.asarray(
            block_hidden(
                {k: jnp.asarray(v) for k, v in params.items()},
                {k: jnp.asarray(v) for k, v in frozen.items()},
                DIMS,
                replace(HEAD, mask_token_id=m),
                jnp.asarray(tokens),
                jnp.asarray(rows),
                jnp.asarray(anchors, jnp.int32),
            )
        )
        for m in (97, 98)
    ]
    assert np.abs(hidden[0][0, :, 0] - hidden[1][0, :, 0]).max() > 1e-3


def test_the_loss_is_the_papers_block_cross_entropy():
    """Row j of the block at a learns the target's greedy id at a + j (from its final hidden at
    a + j - 1) where that position is valid, weighted exp(-(j - 1) / 4); blocks not kept do
    not count."""
    params, frozen = _random_params(DIMS, HEAD, 8), _frozen_random(9)
    tokens, rows = _case(10, length=20)
    valid = np.ones((1, 20), np.float32)
    valid[0, 17:] = 0.0  # padding: the block at 12 learns rows 1 .. 4 only
    anchors, keep = np.array([[3, 12, 1]]), np.array([[True, True, False]])
    loss, per_row = dflash_loss(
        {k: jnp.asarray(v) for k, v in params.items()},
        {k: jnp.asarray(v) for k, v in frozen.items()},
        DIMS,
        HEAD,
        jnp.asarray(tokens),
        jnp.asarray(rows),
        jnp.asarray(valid),
        jnp.asarray([3], jnp.int32),
        anchors=(jnp.asarray(anchors, jnp.int32), jnp.asarray(keep)),
    )
    final = rows[0, :, HEAD.taps * H :].astype(np.float64)
    teacher = np.argmax(_np_rms(final, frozen["target_norm"]) @ frozen["lm_head"].T, axis=-1)
    terms, rows_ce = [], [[] for _ in range(7)]
    for a in (3, 12):
        logits = _np_block(params, frozen, tokens[0], rows[0], a)
        top = logits.max(axis=-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
        for j in range(1, 8):
            if a + j < 17:
                ce = -logp[j - 1, teacher[a + j - 1]]
                terms.append((ce, math.exp(-(j - 1) / 4.0)))
                rows_ce[j - 1].append(ce)
    want = sum(c * w for c, w in terms) / sum(w for _, w in terms)
    assert abs(float(loss) - want) <= 1e-4 * want
    np.testing.assert_allclose(np.asarray(per_row), [np.mean(r) for r in rows_ce], rtol=1e-4)


def test_anchors_are_distinct_reply_positions_with_a_draft_after_them():
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, 50, (3, 40)).astype(np.int32)
    valid = np.ones((3, 40), np.float32)
    valid[1, 30:] = 0.0
    valid[2, 12:] = 0.0
    start = np.array([5, 20, 9], np.int32)
    anchors, keep = (np.asarray(x) for x in sample_anchors(tokens, valid, start, 6))
    lengths = valid.sum(axis=1).astype(int)
    for b in range(3):
        kept = anchors[b][keep[b]]
        assert len(set(kept.tolist())) == len(kept)
        assert np.all(kept >= start[b]) and np.all(kept <= lengths[b] - 2)
        # Every position of a short reply is taken; a long one gives the blocks asked for.
        assert len(kept) == min(6, lengths[b] - 1 - start[b])
    again = np.asarray(sample_anchors(tokens, valid, start, 6)[0])
    assert np.array_equal(again, anchors)
    other = tokens.copy()
    other[0, 0] += 1
    assert not np.array_equal(np.asarray(sample_anchors(other, valid, start, 6)[0]), anchors)


def test_the_engine_walk_is_exact_for_a_drafter_forced_right_and_wrong(tmp_path):
    """A head built to draft ``t + 1`` at every row after an anchor token ``t``.

    Its queries are zero (every seen key weighs the same), the context's values are zero
    (``fc`` is), the mask token's embedding is zero, and the anchor row's value carries
    ``e_{t+1}`` to every mask row through ``o_proj``; the target's LM head is the identity,
    so each mask row drafts ``t + 1``. Acceptance then follows from the text alone.
    """
    v, h = 12, 16
    d = HeadDims(h, 2, 1, 8, 8, 1e-6, 10000.0)
    s = DFlashShape((0,), 1, 4, 11, 2.0)
    params = {
        k: np.zeros(shape, np.float32) if len(shape) > 1 else np.ones(shape, np.float32)
        for k, shape in param_shapes(d, s).items()
    }
    for t in range(7):
        params["layers.0.self_attn.v_proj"][t + 1, t] = 1.0
    params["layers.0.self_attn.o_proj"][:8, :8] = np.eye(8)
    embed = np.eye(v, h, dtype=np.float32)
    embed[11] = 0.0
    frozen = {"embed": jnp.asarray(embed), "lm_head": jnp.asarray(np.eye(v, h, dtype=np.float32))}
    cache = HiddenCache(tmp_path, "t", h, layers=(0, 1))
    # Drafts t + 1, t + 1, t + 1 after each base token t; base positions 3 .. 12 accept
    # 3 (4 -> 5 5 5), 0, 0, 1 (5 -> 6), 0, 2 (2 -> 3 3), 0, 0, 0 and 0 (no room).
    seq = [1, 2, 3, 4, 5, 5, 5, 6, 2, 3, 3, 1, 4, 4]
    cache.append("c", "1", "eval", seq, np.zeros((14, 32)), start=3)
    # Wrong everywhere: 0, 0, 0.
    cache.append("c", "2", "eval", [4, 4, 6, 1, 1, 2], np.zeros((6, 32)), start=2)
    params = {k: jnp.asarray(x) for k, x in params.items()}
    acc = evaluate_dflash(params, frozen, d, s, cache).to_dict()
    assert acc["drafts"] == 3 and acc["base_positions"] == 13
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 6 / 13, abs=1e-4)
    assert acc["acceptance_by_position"] == pytest.approx([3 / 13, 2 / 13, 1 / 13], abs=1e-4)
    # The walk lands on 3 (3 accepted), 7 (0), 8 (2), 11 (0), 12 (0), then 2, 3, 4.
    assert acc["engine_verify_steps"] == 8
    assert acc["engine_mean_acceptance_length"] == pytest.approx(1 + 5 / 8, abs=1e-4)
    assert acc["engine_acceptance_by_position"] == pytest.approx([2 / 8, 2 / 8, 1 / 8], abs=1e-4)
    assert acc["exact_kv_engine_mean_acceptance_length"] == acc["engine_mean_acceptance_length"]


def test_the_mask_token_is_a_special_token_the_text_never_holds(tmp_path):
    write_deep_chat_gguf(tmp_path / "t.gguf")
    tok = load_tokenizer(tmp_path / "t.gguf")
    # 256 <|endoftext|>, 257 <|im_start|> (BOS, in the template), 258 <|im_end|> (EOS), 259 <pad>.
    assert choose_mask_token(tok, np.array([1, 2, 257, 258])) == PAD
    assert choose_mask_token(tok, np.array([1, PAD])) == 256
    with pytest.raises(ValueError, match="pass --mask-token"):
        choose_mask_token(tok, np.array([256, PAD]))
    shape = TargetShape(64, 4, 2, 16, 128, VOCAB, LAYERS, 1e-5, 10000.0, "llama")
    cache = HiddenCache(tmp_path / "c", "t", 64, layers=(1, 2, 3, 5))
    cache.append("c", "1", "train", [1, PAD, 2], np.zeros((3, 256), np.float32))
    assert make_dflash(shape, TAPS).bind(cache, tok).head.mask_token_id == 256
    with pytest.raises(ValueError, match="--mask-token 259 occurs 1 times in the cached text"):
        make_dflash(shape, TAPS, mask_token=PAD).bind(cache, tok)
    assert make_dflash(shape, TAPS, mask_token=7).bind(cache, tok).head.mask_token_id == 7


def test_the_default_layers_are_eagle3s_captures_and_share_its_cache():
    smollm2 = TargetShape(576, 9, 3, 64, 1536, 49152, 30, 1e-5, 100000.0, "llama")
    dflash = load_method("dflash", smollm2)
    eagle3 = load_method("eagle3", smollm2)
    assert dflash.head.target_layer_ids == (1, 14, 26)
    assert dflash.cache_layers == eagle3.cache_layers == (1, 14, 26, 29)
    root, target = Path("/c"), Path("/m/SmolLM2.gguf")
    folder = default_cache_folder(root, dflash, target, "seed0")
    assert folder == default_cache_folder(root, eagle3, target, "seed0")
    assert folder == root / "train-eagle3" / "SmolLM2" / "layers-1-14-26-29" / "seed0"
    other = load_method("dflash", smollm2, (2, 9))
    assert default_cache_folder(root, other, target, "seed0").parent.name == "layers-2-9-29"
    # z-lab's spread where EAGLE-3's layers are not distinct (Qwen3-8B's: 1, 9, 17, 25, 33).
    assert target_layer_ids(6, 2) == (1, 3)
    assert _zlab_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    for bad in [(1, 5), (2, 2)]:
        with pytest.raises(ValueError, match=r"each must be in 0..4 .* none twice"):
            target_layer_ids(6, 2, bad)
    with pytest.raises(ValueError, match="--block-size: not an option of --method eagle3"):
        load_method("eagle3", smollm2, block_size=8)
    with pytest.raises(ValueError, match="at least one draft layer and a block of 2"):
        load_method("dflash", smollm2, block_size=1)


def test_a_start_head_of_another_shape_is_refused_naming_the_option(tmp_path):
    shape = TargetShape(H, HEADS, KVH, HD, FFN, RVOCAB, 8, 1e-6, 10000.0, "llama")
    params = _random_params(DIMS, HEAD, 12)
    write_dflash(tmp_path, params, dflash_config(shape, DIMS, HEAD, 64, {"name": "x"}), "")
    back = read_dflash(tmp_path, DIMS, HEAD)
    for name, value in params.items():
        np.testing.assert_array_equal(back[name], from_bf16_bits(bf16_bits(value)))
    with pytest.raises(ValueError, match="mask_token_id 97, not this run's 5; pass --mask-token"):
        read_dflash(tmp_path, DIMS, replace(HEAD, mask_token_id=5))
    with pytest.raises(ValueError, match="block_size 8, not this run's 16; pass --block-size"):
        read_dflash(tmp_path / "model.safetensors", DIMS, replace(HEAD, block_size=16))


def test_the_command_line_takes_the_dflash_options():
    parser = build_parser()
    args = parser.parse_args(
        ["train", "--method", "dflash", "--draft-layers", "3", "--block-size", "16",
         "--mask-token", "16", "--aux-layers", "1,14,26"]
    )  # fmt: skip
    assert (args.method, args.draft_layers, args.block_size, args.mask_token) == (
        "dflash", 3, 16, 16
    )  # fmt: skip
    assert args.aux_layers == (1, 14, 26)
    alias = vars(parser.parse_args(["train-mtp"]))
    assert (alias["draft_layers"], alias["block_size"], alias["mask_token"]) == (None, None, None)
