"""``specdraft train --method eagle3`` on a tiny random llama of six layers (a GGUF with a
byte-level tokenizer and a chat template): the loss falls, the folder is a ``speculators``
checkpoint that ``specdraft.Eagle3Head`` loads and drafts losslessly with, the draft
vocabulary is the target's most frequent reply choices, the JAX forward agrees with the
independent numpy reference, a resumed run equals an uninterrupted one, the cache holds
one set of layers, and ``train-mtp`` is ``train --method mtp``."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import specdraft

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
gguf = pytest.importorskip("gguf")
import jax.numpy as jnp  # noqa: E402
from specdraft.cli import build_parser, main  # noqa: E402
from specdraft.quantize import read_safetensors  # noqa: E402
from specdraft.train import data  # noqa: E402
from specdraft.train.cache import HiddenCache, from_bf16_bits  # noqa: E402
from specdraft.train.eagle3 import EAGLE3_ROWS, aux_layer_ids, capture_layers  # noqa: E402
from specdraft.train.export_eagle3 import eagle3_config, read_eagle3, write_eagle3  # noqa: E402
from specdraft.train.head import rows_from_window, unroll  # noqa: E402
from specdraft.train.layer import HeadDims, head_dims  # noqa: E402
from specdraft.train.method_eagle3 import make as make_eagle3  # noqa: E402
from specdraft.train.pipeline import RunOptions, _frozen, train_head  # noqa: E402
from specdraft.train.targets import TargetShape, read_target_weights, target_shape  # noqa: E402
from specdraft.train.trainer import Batches, Trainer, TrainSettings  # noqa: E402
from specdraft.train.vocab import top_choices  # noqa: E402
from test_engine import EOS, SPECIALS, TEMPLATE, VOCAB, _byte_chars, write_tiny_chat_gguf  # noqa: E402
from test_train_mtp import _conversations  # noqa: E402
from tiny_gguf import HIDDEN, write_tiny_llama  # noqa: E402

LAYERS = 6
# vLLM's default (2, L // 2, L - 3) is (2, 3, 3) for six layers: one layer twice, so the run
# names its own.
AUX = (2, 3, 4)
DRAFT_VOCAB = 64
SETTINGS = TrainSettings(epochs=3, batch=4, seq_len=64, lr=3e-3, checkpoint_every=5)
CAPTURES = "layers" in (specdraft.TargetModel.hidden_states.__text_signature__ or "")
needs_capture = pytest.mark.skipif(
    not CAPTURES,
    reason="this build's TargetModel.hidden_states(tokens) takes no layers= (the captured "
    "layers an EAGLE-3 cache holds): rebuild the extension",
)


def write_deep_chat_gguf(path: Path) -> None:
    """The tiny chat llama of ``test_engine``, with six layers."""

    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(_byte_chars() + SPECIALS)
        w.add_token_types([1] * 256 + [3] * len(SPECIALS))
        w.add_token_merges([])
        w.add_bos_token_id(257)
        w.add_eos_token_id(EOS)
        w.add_chat_template(TEMPLATE)

    write_tiny_llama(
        path, vocab=VOCAB, seed=3, context_length=2048, metadata=tokenizer, layers=LAYERS
    )


def _options(root: Path) -> RunOptions:
    return RunOptions(
        method="eagle3",
        target=str(root / "tiny-deep.gguf"),
        out=root / "head",
        tokens=2500,
        draft_vocab=DRAFT_VOCAB,
        aux_layers=AUX,
        eval_prompts=3,
        eval_new_tokens=12,
        eval_fraction=0.1,
        cache=root / "cache",
        settings=SETTINGS,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not CAPTURES:
        pytest.skip(needs_capture.kwargs["reason"])
    root = tmp_path_factory.mktemp("eagle3")
    write_deep_chat_gguf(root / "tiny-deep.gguf")
    opts = _options(root)
    report = train_head(opts, conversations=_conversations(120))
    return opts, report


def _shape(opts: RunOptions) -> TargetShape:
    model = specdraft.load_model(opts.target)
    shape = target_shape(model.config)
    del model
    return shape


def _draft_ids(folder: Path) -> np.ndarray:
    raw = read_safetensors(folder / "model.safetensors")
    d2t = np.frombuffer(raw["d2t"][2], "<i8")
    return d2t + np.arange(len(d2t))


def _trainer(opts: RunOptions):
    shape = _shape(opts)
    d = head_dims(shape)
    cache = HiddenCache(opts.cache, str(opts.target), shape.hidden)
    method = make_eagle3(shape, AUX)
    ids = _draft_ids(opts.out)
    weights = read_target_weights(opts.target)
    frozen = _frozen(weights, DRAFT_VOCAB, ids)
    batches = Batches(cache, SETTINGS)
    trainer = Trainer(d, frozen, SETTINGS, 10, loss=method.loss_fn(d, SETTINGS.steps))
    return shape, d, method, ids, weights, trainer, batches


@needs_capture
def test_the_loss_falls_on_a_fixed_batch(run):
    opts, report = run
    assert report["method"] == "eagle3" and report["steps"] == report["total_steps"] >= 24
    shape, d, method, ids, weights, trainer, batches = _trainer(opts)
    trained = {k: jnp.asarray(v) for k, v in read_eagle3(opts.out, d, len(AUX), ids).items()}
    initial = method.init_params(d, SETTINGS.seed, weights.lm_head[ids])
    batch = batches.batch(0)
    before, _ = trainer.loss(initial, batch)
    after, per_step = trainer.loss(trained, batch)
    # The stated margin: training takes at least half the KL away.
    assert after <= 0.5 * before, (before, after)
    assert per_step.shape == (SETTINGS.steps,) and np.all(per_step >= 0)


@needs_capture
def test_the_folder_is_a_speculators_checkpoint(run):
    opts, report = run
    shape = _shape(opts)
    h, ffn = HIDDEN, shape.ffn
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    raw = read_safetensors(opts.out / "model.safetensors")
    layer = "layers.0."
    want = {
        "fc.weight": ("BF16", [h, 3 * h]),
        layer + "input_layernorm.weight": ("BF16", [h]),
        layer + "hidden_norm.weight": ("BF16", [h]),
        layer + "post_attention_layernorm.weight": ("BF16", [h]),
        layer + "self_attn.q_proj.weight": ("BF16", [q, 2 * h]),
        layer + "self_attn.k_proj.weight": ("BF16", [kv, 2 * h]),
        layer + "self_attn.v_proj.weight": ("BF16", [kv, 2 * h]),
        layer + "self_attn.o_proj.weight": ("BF16", [h, q]),
        layer + "mlp.gate_proj.weight": ("BF16", [ffn, h]),
        layer + "mlp.up_proj.weight": ("BF16", [ffn, h]),
        layer + "mlp.down_proj.weight": ("BF16", [h, ffn]),
        "norm.weight": ("BF16", [h]),
        "lm_head.weight": ("BF16", [DRAFT_VOCAB, h]),
        "d2t": ("I64", [DRAFT_VOCAB]),
        "t2d": ("BOOL", [VOCAB]),
    }
    assert {n: (v[0], v[1]) for n, v in raw.items()} == want
    ids = _draft_ids(opts.out)
    assert np.all(np.diff(ids) > 0) and 0 <= ids[0] and ids[-1] < VOCAB
    t2d = np.frombuffer(raw["t2d"][2], np.uint8)
    assert sorted(np.flatnonzero(t2d)) == ids.tolist()
    config = json.loads((opts.out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    assert config["norm_before_residual"] is False
    layer_cfg = config["transformer_layer_config"]
    assert layer_cfg["num_hidden_layers"] == 1 and layer_cfg["vocab_size"] == VOCAB
    assert (layer_cfg["hidden_size"], layer_cfg["intermediate_size"]) == (h, ffn)
    assert layer_cfg["max_position_embeddings"] == 2048
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["proposal_methods"][0]["speculative_tokens"] == SETTINGS.steps
    assert spec["verifier"]["name_or_path"] == opts.target
    assert config["specdraft_target"]["file"] == Path(opts.target).name
    # The cache holds the captured layers (the hiddens entering AUX) and the last layer.
    assert report["cache_layers"] == [1, 2, 3, LAYERS - 1]
    index = json.loads((opts.cache / "index.json").read_text())
    assert index["layers"] == [1, 2, 3, LAYERS - 1]
    card = (opts.out / "README.md").read_text()
    assert "# EAGLE-3 draft head" in card
    assert f"{report['acceptance']['mean_acceptance_length']:.3f}" in card


@needs_capture
def test_the_cached_rows_are_the_layers_the_target_captures(run):
    """A row holds the captured layers' outputs, then the final hidden (the teacher)."""
    opts, _ = run
    shape = _shape(opts)
    cache = HiddenCache(opts.cache, str(opts.target), shape.hidden)
    seq = cache.split("train")[0]
    tokens, rows = cache.open_arrays()
    ids = [int(t) for t in tokens[seq.offset : seq.offset + seq.length]]
    got = from_bf16_bits(rows[seq.offset : seq.offset + seq.length])
    model = specdraft.load_model(opts.target)
    final = model.hidden_states(ids)
    layers = model.hidden_states(ids, layers=[1, 2, 3])
    del model
    np.testing.assert_array_equal(got[:, 3 * HIDDEN :], from_bf16_bits(_bits(final)))
    np.testing.assert_array_equal(got[:, : 3 * HIDDEN], from_bf16_bits(_bits(layers)))


def _bits(x: np.ndarray) -> np.ndarray:
    from specdraft.train.cache import bf16_bits

    return bf16_bits(np.asarray(x, np.float32))


@needs_capture
def test_the_draft_vocabulary_is_the_targets_most_frequent_reply_choices(run):
    opts, report = run
    shape = _shape(opts)
    cache = HiddenCache(opts.cache, str(opts.target), shape.hidden)
    weights = read_target_weights(opts.target)
    _, rows = cache.open_arrays()
    counts: Counter[int] = Counter()
    for s in cache.split("train"):
        final = from_bf16_bits(rows[s.offset + s.start : s.offset + s.length, 3 * HIDDEN :])
        x = final.astype(np.float64)
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + shape.rms_norm_eps)
        logits = (x * weights.final_norm) @ weights.lm_head.T.astype(np.float64)
        counts.update(int(t) for t in np.argmax(logits, axis=-1))
    # The most frequent first, ties to the lower id.
    ranked = sorted(range(VOCAB), key=lambda t: (-counts[t], t))
    assert _draft_ids(opts.out).tolist() == sorted(ranked[:DRAFT_VOCAB])
    assert len(counts) > 1 and counts[ranked[DRAFT_VOCAB]] <= counts[ranked[DRAFT_VOCAB - 1]]
    choice = report["draft_vocab_choice"]
    assert choice["chosen_train"] >= choice["first_n_train"]


def test_top_choices_ranks_by_count_then_id():
    choices = np.array([5] * 10 + [3] * 7 + [9] * 7 + [1] * 2 + [11])
    assert top_choices(choices, 1, 12).tolist() == [5]
    assert top_choices(choices, 3, 12).tolist() == [3, 5, 9]
    # 3 and 9 tie at 7: the lower id goes first.
    assert top_choices(choices, 2, 12).tolist() == [3, 5]
    assert top_choices(choices, 5, 12).tolist() == [1, 3, 5, 9, 11]
    # Ids never chosen fill the rest from the lowest.
    assert top_choices(choices, 7, 12).tolist() == [0, 1, 2, 3, 5, 9, 11]
    with pytest.raises(ValueError, match="13 ids from a vocabulary of 12"):
        top_choices(choices, 13, 12)


def test_a_cache_of_other_layers_is_refused_naming_both(tmp_path):
    cache = HiddenCache(tmp_path, "m", 4, layers=(1, 2, 3, 5))
    assert cache.width == 16
    cache.append("c", "1", "train", [5, 6], np.zeros((2, 16), np.float32))
    again = HiddenCache(tmp_path, "m", 4, layers=(1, 2, 3, 5))
    assert again.has("c", "1", "train") and again.layers == (1, 2, 3, 5)
    assert HiddenCache(tmp_path, "m", 4).width == 16  # a reader takes any layers
    with pytest.raises(
        ValueError,
        match=r"caches the outputs of layers 1, 2, 3, 5 .*not the "
        r"outputs of layers 0, 2, 3, 5",
    ):
        HiddenCache(tmp_path, "m", 4, layers=(0, 2, 3, 5))
    with pytest.raises(ValueError, match="not the final hidden as this run needs"):
        HiddenCache(tmp_path, "m", 4, layers=())
    with pytest.raises(ValueError, match="hiddens of shape .* width 16"):
        again.append("c", "2", "train", [5, 6], np.zeros((2, 4), np.float32))
    # An index written before layers were recorded holds the final hidden.
    plain = HiddenCache(tmp_path / "plain", "m", 4)
    plain.append("c", "1", "train", [5], np.zeros((1, 4), np.float32))
    index = json.loads((tmp_path / "plain" / "index.json").read_text())
    del index["layers"]
    (tmp_path / "plain" / "index.json").write_text(json.dumps(index))
    assert HiddenCache(tmp_path / "plain", "m", 4, layers=()).has("c", "1", "train")
    with pytest.raises(ValueError, match="caches the final hidden at each token"):
        HiddenCache(tmp_path / "plain", "m", 4, layers=(1, 2, 3, 5))


def test_the_aux_layers_are_vllms_and_capture_the_layer_before():
    assert aux_layer_ids(30) == (2, 15, 27)
    assert capture_layers(aux_layer_ids(30)) == (1, 14, 26)
    assert aux_layer_ids(6, (2, 3, 4)) == (2, 3, 4)
    for bad, message in [
        ((0, 3, 4), r"\[0, 3, 4\] \(--aux-layers\) for a target of 6 layers"),
        ((2, 3, 6), r"each must be in 1..5"),
        ((2, 3, 3), r"none twice"),
    ]:
        with pytest.raises(ValueError, match=message):
            aux_layer_ids(6, bad)
    with pytest.raises(ValueError, match=r"\[2, 3, 3\] \(the default"):
        aux_layer_ids(6)


# The reference's sizes (GQA 4 query heads over 2 KV heads), with a draft vocabulary whose
# ids are not the first ones.
H, HEADS, KVH, HD, FFN, RVOCAB, RDRAFT = 64, 4, 2, 16, 96, 100, 40
DIMS = HeadDims(H, HEADS, KVH, HD, FFN, 1e-6, 10000.0)


def _random_head(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """A random head written by the trainer's exporter: its folder, embedding and ids."""
    rng = np.random.default_rng(5)
    shapes = {
        "fc": ((H, 3 * H), 1.5 / np.sqrt(3 * H)),
        "self_attn.q_proj": ((HEADS * HD, 2 * H), 1.5 / np.sqrt(2 * H)),
        "self_attn.k_proj": ((KVH * HD, 2 * H), 1.5 / np.sqrt(2 * H)),
        "self_attn.v_proj": ((KVH * HD, 2 * H), 1.5 / np.sqrt(2 * H)),
        "self_attn.o_proj": ((H, HEADS * HD), 1.5 / np.sqrt(H)),
        "mlp.gate_proj": ((FFN, H), 1.5 / np.sqrt(H)),
        "mlp.up_proj": ((FFN, H), 1.5 / np.sqrt(H)),
        "mlp.down_proj": ((H, FFN), 1.5 / np.sqrt(FFN)),
        "lm_head": ((RDRAFT, H), 3 / np.sqrt(H)),
    }
    params = {k: rng.uniform(-s, s, shape).astype(np.float32) for k, (shape, s) in shapes.items()}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
        params[norm] = rng.uniform(0.8, 1.2, H).astype(np.float32)
    ids = np.sort(rng.choice(RVOCAB, RDRAFT, replace=False)).astype(np.int64)
    assert ids[-1] >= RDRAFT  # d2t is not all zeros
    shape = TargetShape(H, HEADS, KVH, HD, FFN, RVOCAB, 8, 1e-6, 10000.0, "llama")
    config = eagle3_config(shape, DIMS, RDRAFT, (2, 4, 5), 3, {"name": "x", "file": "x"})
    write_eagle3(tmp_path / "head", params, ids, config, "")
    embed = rng.uniform(-1, 1, (RVOCAB, H)).astype(np.float32)
    return tmp_path / "head", embed, ids


@pytest.mark.parametrize("base", [1, 9, 30])
def test_jax_forward_matches_the_numpy_reference(tmp_path, base):
    ref = pytest.importorskip(
        "eagle3_reference", reason="tests/python/eagle3_reference.py (the numpy EAGLE-3 head)"
    )
    folder, embed, ids = _random_head(tmp_path)
    numpy_head = ref.Eagle3(folder, embed=ref.bf16(embed))
    np.testing.assert_array_equal(numpy_head.draft_to_target, ids)
    params = {k: jnp.asarray(v) for k, v in read_eagle3(folder, DIMS, 3, ids).items()}
    frozen = {"embed": jnp.asarray(ref.bf16(embed)), "draft_ids": jnp.asarray(ids, jnp.int32)}
    rng = np.random.default_rng(11)
    stack = ref.bf16(rng.uniform(-2, 2, (48, 3 * H)).astype(np.float32))
    rows = np.concatenate([stack, np.zeros((48, H), np.float32)], axis=1)  # [captured | final]
    tokens = [int(x) for x in rng.integers(0, RVOCAB, 48)]
    steps = 3
    w = base + 1 + steps
    logits = unroll(
        params,
        frozen,
        DIMS,
        rows_from_window(jnp.asarray(np.asarray(tokens[:w], np.int32)[None]), steps),
        rows_from_window(jnp.arange(w, dtype=jnp.int32)[None], steps),
        jnp.asarray(rows[None, : w - 1]),
        steps,
        feed_drafts=True,
        rows=EAGLE3_ROWS,
    )
    got = [np.asarray(lg[0, base - 1]) for lg in logits]
    # The reference drafts after `base` as the engine does: prefill rows 1..base-1, then the
    # chain from (token at base, captured rows at base - 1).
    for i in range(1, base):
        numpy_head.step(tokens[i], stack[i - 1], i, True, logits=False)
    token, hidden = tokens[base], stack[base - 1]
    for j in range(steps):
        want, hidden = numpy_head.step(token, hidden, base + j, j == 0)
        # The reference rounds every activation to BF16, the trainer keeps float32: the
        # stated tolerance is 3% of the logits' scale.
        scale = float(np.abs(want).max())
        assert np.abs(got[j] - want).max() <= 0.03 * scale, f"step {j}"
        token = int(numpy_head.draft_to_target[int(np.argmax(want))])
        assert int(ids[int(np.argmax(got[j]))]) == token, f"step {j}"


@needs_capture
def test_the_trained_head_loads_and_drafts_losslessly(run, gpu):
    if not hasattr(specdraft, "Eagle3Head"):
        pytest.skip("specdraft.Eagle3Head is not in this build: the head cannot be loaded yet")
    opts, _ = run
    model = specdraft.load_model(opts.target, gpu=gpu, max_rows=64, max_seq_len=256)
    head = specdraft.Eagle3Head.from_checkpoint(opts.out, gpu, target=model)
    assert head.aux_layer_ids == list(AUX) and head.target_layer_ids() == [1, 2, 3]
    assert head.draft_to_target.tolist() == _draft_ids(opts.out).tolist()
    report = specdraft.check_proposer(head, gpu=gpu, vocab_size=VOCAB, hidden_size=HIDDEN)
    assert report.ok, report.violations
    prompts = [[257, 1, 2, 3, 4], [257, 40, 41], [257, 10, 10, 10, 10, 10, 10]]
    plain = specdraft.SpecEngine(model).generate(prompts, max_tokens=24, ignore_eos=True)
    drafted = specdraft.SpecEngine(model, head, num_drafts=3).generate(
        prompts, max_tokens=24, ignore_eos=True
    )
    assert [list(r.tokens) for r in drafted] == [list(r.tokens) for r in plain]
    assert all(r.error is None for r in drafted)
    assert sum(r.metrics["drafted"] for r in drafted) > 0
    _drafts_as_the_trainer_computes_them(opts, model, head, gpu)
    del head, model, plain, drafted


def _drafts_as_the_trainer_computes_them(opts, model, head, gpu) -> None:
    """The loaded head drafts what the trainer's forward drafts from the same weights (as
    written, BF16) and the target's own captured rows, but at near-ties."""
    shape = target_shape(model.config)
    d = head_dims(shape)
    ids = _draft_ids(opts.out)
    params = {k: jnp.asarray(v) for k, v in read_eagle3(opts.out, d, len(AUX), ids).items()}
    weights = read_target_weights(opts.target)
    frozen = {"embed": jnp.asarray(weights.embed), "draft_ids": jnp.asarray(ids, jnp.int32)}
    cache = HiddenCache(opts.cache, str(opts.target), shape.hidden)
    seq = max(cache.split("train"), key=lambda s: s.length)
    tokens_all, _ = cache.open_arrays()
    tokens = [int(t) for t in tokens_all[seq.offset : seq.offset + seq.length]]
    stack = model.hidden_states(tokens, layers=[1, 2, 3])  # [n, 3H], as the engine captures
    final = model.hidden_states(tokens)
    row = 3 * HIDDEN
    stack_ptr = gpu.upload(stack, dtype="bf16")
    final_ptr = gpu.upload(final, dtype="bf16")
    ctx = specdraft.ForwardContext(gpu, model.config, target_hidden_stack=stack_ptr)
    steps, compared, agreed = 3, 0, 0
    try:
        for base in (8, 20, len(tokens) - 4):
            state = head.alloc_state_for(gpu, 256)
            assert head.prefill_drafter(tokens[:base], final_ptr, state, ctx) == base - 1
            drafts = head.propose(
                tokens[base],
                final_ptr.offset((base - 1) * HIDDEN * 2),
                base,
                steps,
                state,
                ctx,
                target_hidden_stack=stack_ptr.offset((base - 1) * row * 2),
            )
            last = np.asarray(head.last_logits(gpu))
            head.free_state(gpu, state)
            w = base + 1 + steps
            rows = np.concatenate([from_bf16_bits(_bits(stack)), final], axis=1)[: w - 1]
            logits = unroll(
                params,
                frozen,
                d,
                rows_from_window(jnp.asarray(np.asarray(tokens[:w], np.int32)[None]), steps),
                rows_from_window(jnp.arange(w, dtype=jnp.int32)[None], steps),
                jnp.asarray(rows[None]),
                steps,
                feed_drafts=True,
                rows=EAGLE3_ROWS,
            )
            for j, lg in enumerate(logits):
                lg = np.asarray(lg[0, base - 1])
                want = int(ids[int(np.argmax(lg))])
                top2 = np.sort(lg)[-2:]
                # The head rounds activations to BF16, the trainer keeps float32: a draft
                # may differ only at a top-2 margin inside that rounding.
                if top2[1] - top2[0] > 0.03 * np.abs(lg).max():
                    assert drafts[j] == want, f"base {base} step {j}: {drafts} vs {want}"
                    compared += 1
                if drafts[j] != want:
                    break
            else:
                # Both chains fed the same drafts: the last step's logits agree too (the
                # stated tolerance: 3% of their scale, BF16 against float32).
                lg = np.asarray(logits[-1][0, base - 1])
                assert np.abs(last - lg).max() <= 0.03 * np.abs(lg).max(), f"base {base}"
                agreed += 1
    finally:
        gpu.free(stack_ptr)
        gpu.free(final_ptr)
    assert compared >= 3 and agreed >= 1, "too few drafts outside near-ties to compare"


@needs_capture
def test_a_resumed_run_equals_an_uninterrupted_one(run, tmp_path):
    opts, first = run
    part = replace(opts, out=tmp_path / "head", max_steps=4)
    assert train_head(part, conversations=_conversations(120))["steps"] == 4
    assert (tmp_path / "head" / "checkpoint" / "draft_ids.npy").exists()
    rest = train_head(replace(part, max_steps=None, resume=True), conversations=_conversations(120))
    assert rest["steps"] == first["steps"]
    a = read_safetensors(opts.out / "model.safetensors")
    b = read_safetensors(tmp_path / "head" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


def _patched_corpus(monkeypatch):
    convs = _conversations(120)
    monkeypatch.setattr(
        data, "read_conversations", lambda name: convs if name == "chitchat" else []
    )


def test_train_mtp_is_train_method_mtp(tmp_path, monkeypatch):
    """The two commands run the same options to the same report (but its timings)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_chat_gguf(path)
    _patched_corpus(monkeypatch)
    common = [
        "--model", str(path), "--data", "chitchat", "--tokens", "600", "--draft-vocab", "200",
        "--seq-len", "64", "--max-steps", "3", "--eval-prompts", "2", "--eval-new-tokens", "8",
    ]  # fmt: skip
    reports = []
    for i, argv in enumerate([["train-mtp"], ["train", "--method", "mtp"]]):
        out, cache = tmp_path / f"out{i}", tmp_path / f"cache{i}"
        assert main([*argv, *common, "--out", str(out), "--cache", str(cache)]) == 0
        report = json.loads((out / "report.json").read_text())
        reports.append({k: v for k, v in report.items() if not k.endswith("_seconds")})
    assert reports[0] == reports[1]
    assert reports[0]["method"] == "mtp" and reports[0]["steps"] == 3


def test_the_two_commands_parse_to_the_same_options():
    parser = build_parser()
    alias = vars(parser.parse_args(["train-mtp"]))
    general = vars(parser.parse_args(["train", "--method", "mtp"]))
    assert alias.pop("command") == "train-mtp" and general.pop("command") == "train"
    assert alias.pop("run").__name__ == "run_train_mtp"
    assert general.pop("run").__name__ == "run_train"
    assert alias == general
    args = parser.parse_args(["train", "--method", "eagle3", "--aux-layers", "2,15,27"])
    assert (args.method, args.aux_layers, args.draft_vocab) == ("eagle3", (2, 15, 27), 16384)
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--method", "medusa"])
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--aux-layers", "2,x"])


def test_the_help_gives_the_methods_and_the_caches_disk_footprint(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ["--method", "--aux-layers", "--draft-vocab", "--unroll", "--init-from"]:
        assert option in text
    assert "{mtp,eagle3,dflash}" in text
    assert "1.1 KB for SmolLM2" in text and "(4.6 KB)" in text
