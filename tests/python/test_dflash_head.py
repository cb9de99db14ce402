"""`specdraft.DFlashHead` from Python, beside a tiny four-layer llama target: drafts and block
logits against the numpy reference in `dflash_reference.py` (random checkpoints in z-lab's
layout, GQA 4:1, two draft layers, γ 4 and 8), one sequence at a time and in batches (each
sequence's rows in `ForwardContext(target_hidden_stacks=...)`, its confidences the
reference's softmax probabilities), the conformance check, greedy output through the engine,
and the errors of bad checkpoints and missing captured rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft.quantize import write_safetensors

gguf = pytest.importorskip("gguf")
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
from tiny_gguf import HIDDEN, write_tiny_llama  # noqa: E402

_spec = importlib.util.spec_from_file_location("dflash_reference", _HERE / "dflash_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

H, HEADS, KVH, HD, FFN, VOCAB = HIDDEN, 4, 1, 16, 96, 96
TARGET_LAYERS, TAPS, MASK = 4, (1, 3), VOCAB - 1
ROW = len(TAPS) * H  # one captured row: the tapped layers' hiddens side by side
# The layers' output projections are scaled up so that their updates outweigh the mask
# token's embedding: with the target's tied LM head, a block row that stays near it drafts
# the mask token itself, the same draft at every row (so at 1x every draft here was the
# mask token; at 16x they differ by row and by token, the top two logits of a row at least
# 1.3% of the largest apart, over three times the tolerance below).
OUT_SCALE = 16.0


def _bf16_bytes(a) -> bytes:
    return (
        ref.bf16(np.asarray(a, np.float32)).view(np.uint32).__rshift__(16).astype("<u2").tobytes()
    )


def write_checkpoint(
    folder: Path,
    *,
    block_size: int = 4,
    seed: int = 0,
    config: dict | None = None,
    drop: tuple[str, ...] = (),
    fc_in: int | None = None,
    hidden: int = H,
    heads: int = HEADS,
    kv_heads: int = KVH,
    ffn: int = FFN,
    vocab: int = VOCAB,
    target_layers: int = TARGET_LAYERS,
    taps: tuple[int, ...] = TAPS,
) -> Path:
    """A random DFlash head in z-lab's layout; `config` overrides keys of `config.json`,
    `drop` leaves tensors out and `fc_in` sets the width of `fc`'s input (the taps' width by
    default). The shape defaults to this module's target; the mask token is the last id."""
    rng = np.random.default_rng(seed)
    t = {}
    H, HEADS, KVH, FFN, HD = hidden, heads, kv_heads, ffn, hidden // heads
    fc_in = len(taps) * H if fc_in is None else fc_in

    def put(name, shape, scale, base=0.0):
        t[name] = ("BF16", list(shape), _bf16_bytes(base + rng.uniform(-scale, scale, shape)))

    s = lambda fan: 1.5 / np.sqrt(fan)  # noqa: E731
    put("fc.weight", [H, fc_in], s(fc_in))
    put("hidden_norm.weight", [H], 0.2, 1.0)
    for i in range(2):
        p = f"layers.{i}."
        put(p + "input_layernorm.weight", [H], 0.2, 1.0)
        put(p + "self_attn.q_proj.weight", [HEADS * HD, H], s(H))
        put(p + "self_attn.k_proj.weight", [KVH * HD, H], s(H))
        put(p + "self_attn.v_proj.weight", [KVH * HD, H], s(H))
        put(p + "self_attn.o_proj.weight", [H, HEADS * HD], OUT_SCALE * s(HEADS * HD))
        put(p + "self_attn.q_norm.weight", [HD], 0.2, 1.0)
        put(p + "self_attn.k_norm.weight", [HD], 0.2, 1.0)
        put(p + "post_attention_layernorm.weight", [H], 0.2, 1.0)
        put(p + "mlp.gate_proj.weight", [FFN, H], s(H))
        put(p + "mlp.up_proj.weight", [FFN, H], s(H))
        put(p + "mlp.down_proj.weight", [H, FFN], OUT_SCALE * s(FFN))
    put("norm.weight", [H], 0.2, 1.0)
    for name in drop:
        del t[name]
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", t)
    cfg = {
        "model_type": "qwen3",
        "architectures": ["DFlashDraftModel"],
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KVH,
        "head_dim": HD,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "num_target_layers": target_layers,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": vocab - 1},
    }
    cfg.update(config or {})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def target_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dflash") / "tiny4.gguf"
    write_tiny_llama(path, vocab=VOCAB, seed=6, layers=TARGET_LAYERS)
    return path


def _load(path: Path, gpu) -> specdraft.TargetModel:
    return specdraft.load_model(path, gpu=gpu, max_rows=16, max_seq_len=128, kv_blocks=32)


def _embedding(path: Path) -> np.ndarray:
    """The target's embedding as the target holds it: the file's f32 values in BF16."""
    reader = gguf.GGUFReader(str(path))
    (t,) = [t for t in reader.tensors if t.name == "token_embd.weight"]
    return ref.bf16(np.asarray(t.data, np.float32).reshape(VOCAB, H))


def _mask_words(allowed: set[int]) -> np.ndarray:
    mask = np.zeros((VOCAB + 31) // 32, np.int32)
    for t in allowed:
        mask[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


@pytest.mark.parametrize(("gamma", "draft_vocab"), [(4, None), (8, None), (8, 40)])
def test_drafts_and_logits_match_the_numpy_reference(
    tmp_path, gpu, target_path, gamma, draft_vocab
):
    model = _load(target_path, gpu)
    folder = write_checkpoint(tmp_path / f"g{gamma}", block_size=gamma, seed=gamma)
    head = specdraft.DFlashHead.from_checkpoint(folder, gpu, target=model, draft_vocab=draft_vocab)
    assert head.block_size == gamma and head.block_gamma() == gamma
    assert head.target_layer_ids() == list(TAPS) and head.mask_token_id == MASK
    assert head.draft_vocab_size == (draft_vocab or VOCAB)
    embed = _embedding(target_path)
    numpy_head = ref.DFlash(folder, embed, embed, draft_vocab)  # the target's LM head is tied
    rng = np.random.default_rng(gamma)
    stack = ref.bf16(rng.uniform(-2, 2, (64, ROW)).astype(np.float32))
    stack_ptr = gpu.upload(stack, dtype="bf16")
    # The final hidden: a DFlash head must not need it.
    final = gpu.upload(np.zeros((64, H), np.float32), dtype="bf16")
    ctx = specdraft.ForwardContext(gpu, model.config, target_hidden_stack=stack_ptr)
    plain = specdraft.ForwardContext(gpu, model.config)
    tokens = [int(x) for x in rng.integers(0, VOCAB - 1, 64)]
    state = head.alloc_state_for(gpu, 64)
    P = 12
    assert head.prefill_drafter(tokens[:P], final, state, ctx) == P - 1
    assert head.drafter_rows(state) == P - 1
    numpy_head.add_context(stack[: P - 1], 0)
    # (drafts asked, drafts accepted) per round: accepting 0 makes the next stack one row,
    # accepting 2 makes it three; round 3 is masked, round 4 asks for more than γ - 1.
    plan = [(gamma - 1, 0), (2, 2), (gamma - 1, 2), (gamma - 1, 0), (50, 1), (0, 0), (1, 0)]
    pos, start, worst, ks, seen = P, P - 1, 0.0, [], set()
    for r, (n, accept) in enumerate(plan):
        k = pos - start
        ks.append(k)
        numpy_head.keep_before(start)
        numpy_head.add_context(stack[start:pos], start)
        mask = None
        if r == 3:
            (first, *_), _ = numpy_head.block(tokens[pos], pos)
            mask = {t for t in range(VOCAB) if t % 3 != 1 and t != first}
        want, logits = numpy_head.block(tokens[pos], pos, mask)
        want = want[: min(n, gamma - 1)]
        # Twice from the same point (no after_verify between): the rows from `start` are
        # rewritten, so the drafts are the same.
        for attempt in range(2):
            drafts = head.propose(
                tokens[pos],
                final.offset((pos - 1) * H * 2),
                pos,
                n,
                state,
                plain,
                grammar_bitmask=None if mask is None else _mask_words(mask),
                target_hidden_stack=stack_ptr.offset(start * ROW * 2),
            )
            assert list(drafts) == want, f"round {r}, attempt {attempt}"
            for j in range(len(want)):
                got = head.last_logits(gpu, j)
                tol = float(np.abs(logits[j]).max()) / 256.0
                err = float(np.abs(got - logits[j]).max())
                worst = max(worst, err / tol)
                assert err <= tol, f"round {r}, row {j}: logits differ by {err} > {tol}"
        assert head.drafter_rows(state) == pos, "context rows end before the block"
        seen.update(drafts)
        if mask is not None:
            assert drafts and all(d in mask for d in drafts)
        a = min(accept, len(drafts))
        head.after_verify(a, state)
        tokens[pos + 1 : pos + 1 + a] = drafts[:a]
        start, pos = pos, pos + a + 1
    assert 1 in ks and 3 in ks, ks
    assert len(seen) >= 3, f"drafts too alike to test much: {seen}"
    print(f"gamma {gamma}: worst logit difference {worst:.3f} of the tolerance; drafts {seen}")
    head.free_state(gpu, state)
    assert head.kv_blocks[0] == head.kv_blocks[1]
    gpu.free(stack_ptr)
    gpu.free(final)
    del head, model


def test_a_batch_drafts_what_the_numpy_reference_drafts_for_each_sequence(
    tmp_path, gpu, target_path
):
    gamma, seqs, length = 4, 3, 40
    model = _load(target_path, gpu)
    folder = write_checkpoint(tmp_path / "batch", block_size=gamma, seed=gamma)
    head = specdraft.DFlashHead.from_checkpoint(folder, gpu, target=model)
    embed = _embedding(target_path)
    refs = [ref.DFlash(folder, embed, embed) for _ in range(seqs)]
    rng = np.random.default_rng(11)
    stack = ref.bf16(rng.uniform(-2, 2, (seqs * length, ROW)).astype(np.float32))
    stack_ptr = gpu.upload(stack, dtype="bf16")
    final = gpu.upload(np.zeros((seqs, H), np.float32), dtype="bf16")

    def rows(s: int, q: int) -> specdraft.DevicePtr:
        return stack_ptr.offset((s * length + q) * ROW * 2)

    tokens = [[int(x) for x in rng.integers(0, VOCAB - 1, length)] for _ in range(seqs)]
    prompts = [6, 11, 9]
    states = [head.alloc_state(gpu) for _ in range(seqs)]
    for s in range(seqs):
        ctx = specdraft.ForwardContext(gpu, model.config, target_hidden_stack=rows(s, 0))
        head.prefill_drafter(tokens[s][: prompts[s]], final, states[s], ctx)
        refs[s].add_context(stack[s * length : s * length + prompts[s] - 1], 0)
    pos, start, drafted = list(prompts), [p - 1 for p in prompts], 0
    for r, n in enumerate((gamma - 1, 2, 0, gamma - 1, gamma - 1)):
        want, probs = [], []
        for s in range(seqs):
            refs[s].keep_before(start[s])
            first = s * length
            refs[s].add_context(stack[first + start[s] : first + pos[s]], start[s])
            drafts, logits = refs[s].block(tokens[s][pos[s]], pos[s])
            want.append(list(drafts[:n]))
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs.append([float(e[j, d] / e[j].sum()) for j, d in enumerate(want[-1])])
        ctx = specdraft.ForwardContext(
            gpu, model.config, target_hidden_stacks=[rows(s, start[s]) for s in range(seqs)]
        )
        conf: list[list[float]] = []
        got = head.propose_batch(
            [tokens[s][pos[s]] for s in range(seqs)], [final] * seqs, pos, n, states, ctx, 0, conf
        )
        assert [list(g) for g in got] == want, f"round {r}"
        # The logits agree within BF16 rounding (see the test above), so the probabilities
        # agree within a few tenths of a percent (9e-4 at worst measured).
        for c, p in zip(conf, probs, strict=True):
            assert c == pytest.approx(p, abs=5e-3), f"round {r}"
        for s in range(seqs):
            a = (r + s) % (len(got[s]) + 1)
            head.after_verify(a, states[s])
            tokens[s][pos[s] + 1 : pos[s] + 1 + a] = got[s][:a]
            start[s], pos[s] = pos[s], pos[s] + a + 1
            drafted += len(got[s])
    assert drafted >= 20
    for st in states:
        head.free_state(gpu, st)
    assert head.kv_blocks[0] == head.kv_blocks[1]
    gpu.free(stack_ptr)
    gpu.free(final)
    del head, model


def test_the_conformance_check_passes(tmp_path, gpu, target_path):
    model = _load(target_path, gpu)
    head = specdraft.DFlashHead.from_checkpoint(
        write_checkpoint(tmp_path / "c", block_size=8), gpu, target=model
    )
    report = specdraft.check_proposer(
        head, gpu=gpu, vocab_size=VOCAB, hidden_size=H, num_drafts=7, steps=8
    )
    assert report.ok, str(report)
    del head, model


def test_greedy_output_through_the_engine_is_plain_greedy_output(tmp_path, gpu, target_path):
    model = _load(target_path, gpu)
    head = specdraft.DFlashHead.from_checkpoint(
        write_checkpoint(tmp_path / "e", block_size=4), gpu, target=model
    )
    prompts = [[1, 7, 33, 2, 79, 40, 40, 5, 12], [64, 3, 17]]
    plain = specdraft.SpecEngine(model).generate(prompts, max_tokens=16)
    engine = specdraft.SpecEngine(model, head, num_drafts=2, draft_policy="fixed")
    assert engine.num_drafts == 3, "block_gamma sets the draft count"
    results = engine.generate(prompts, max_tokens=16)
    for a, b in zip(results, plain, strict=True):
        assert a.error is None and list(a.tokens) == list(b.tokens)
    assert engine.last_metrics["drafted"] > 0
    del engine, head, model


@pytest.mark.parametrize(
    ("edit", "error", "says"),
    [
        (
            {"drop": ("layers.1.self_attn.k_norm.weight",)},
            specdraft.CheckpointError,
            "layers.1.self_attn.k_norm.weight",
        ),
        ({"fc_in": 3 * H}, specdraft.CheckpointError, "fc.weight"),
        (
            {"config": {"dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": VOCAB}}},
            specdraft.ConfigError,
            "mask_token_id.*is 96, outside the vocabulary of 96",
        ),
        (
            {"config": {"dflash_config": {"target_layer_ids": [0, 4], "mask_token_id": 5}}},
            specdraft.ConfigError,
            "names layer 4, but the target has 4 layers",
        ),
        (
            {"config": {"dflash_config": {"target_layer_ids": [0, 2]}}},
            specdraft.ConfigError,
            'missing required key "dflash_config.mask_token_id"',
        ),
    ],
)
def test_bad_checkpoints_are_refused_naming_what_is_wrong(
    tmp_path, gpu, target_path, edit, error, says
):
    model = _load(target_path, gpu)
    live = gpu.live_allocs
    with pytest.raises(error, match=says):
        specdraft.DFlashHead.from_checkpoint(
            write_checkpoint(tmp_path / "x", **edit), gpu, target=model
        )
    assert gpu.live_allocs == live, "a refused load leaked"
    del model


def test_a_head_needs_its_target_and_the_captured_rows(tmp_path, gpu, target_path):
    model = _load(target_path, gpu)
    folder = write_checkpoint(tmp_path / "n")
    with pytest.raises(TypeError, match="target"):
        specdraft.DFlashHead.from_checkpoint(folder, gpu)
    with pytest.raises(specdraft.ProposerError, match="draft_vocab=97"):
        specdraft.DFlashHead.from_checkpoint(folder, gpu, target=model, draft_vocab=97)
    head = specdraft.DFlashHead.from_checkpoint(folder, gpu, target=model)
    state = head.alloc_state(gpu)
    hidden = gpu.upload(np.zeros((1, H), np.float32), dtype="bf16")
    ctx = specdraft.ForwardContext(gpu, model.config)
    with pytest.raises(specdraft.ProposerError, match="needs the target's captured layers"):
        head.propose(3, hidden, 5, 3, state, ctx)
    head.free_state(gpu, state)
    gpu.free(hidden)
    del head, model


def test_projections_can_be_quantized_at_load(tmp_path, gpu, target_path):
    model = _load(target_path, gpu)
    folder = write_checkpoint(tmp_path / "q")
    head = specdraft.DFlashHead.from_checkpoint(folder, gpu, target=model, quant="q8_0")
    assert head.projection_format == "q8_0"
    assert specdraft.DFlashHead.from_checkpoint(folder, gpu, target=model).projection_format == (
        "bf16"
    )
    report = specdraft.check_proposer(head, gpu=gpu, vocab_size=VOCAB, hidden_size=H)
    assert report.ok, str(report)
    with pytest.raises(ValueError, match='quant "fp8": a DFlashHead'):
        specdraft.DFlashHead.from_checkpoint(folder, gpu, target=model, quant="fp8")
    del head, model
