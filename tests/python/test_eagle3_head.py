"""`specdraft.Eagle3Head` from Python, against the numpy reference in `eagle3_reference.py`,
on random checkpoints written in both EAGLE-3 layouts (speculators and the original); a batch
given each sequence's rows in `ForwardContext(target_hidden_stacks=...)` drafts what one by one
drafts."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft.quantize import write_safetensors

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("eagle3_reference", _HERE / "eagle3_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

# GQA 4 query heads over 2 KV heads; the target's hidden size is the draft's.
H, HEADS, KVH, HD, FFN, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 96, 100, 40
TARGET_LAYERS = 8
AUX = (2, 4, 5)  # vLLM's default (2, L // 2, L - 3) for 8 layers
ROW = len(AUX) * H  # one captured row: the aux layers' hiddens side by side


def _bf16_bytes(a) -> bytes:
    return (
        ref.bf16(np.asarray(a, np.float32)).view(np.uint32).__rshift__(16).astype("<u2").tobytes()
    )


def write_checkpoint(
    folder: Path,
    fmt: str,
    *,
    seed: int = 0,
    aux: tuple[int, ...] | None = AUX,
    norm_before_residual: bool = False,
    embed: bool = True,
    vocab: int = VOCAB,
    hidden: int = H,
    heads: int = HEADS,
    kv_heads: int = KVH,
) -> Path:
    """A random EAGLE-3 head: `fmt` "speculators" (`layers.0.*`, speculators config) or
    "eagle3" (`midlayer.*`, the original Llama-like config). `d2t` maps the draft ids to a
    random, sorted subset of the target vocabulary (offsets that are not all zero)."""
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    n_aux = len(aux) if aux is not None else 3
    p = "layers.0." if fmt == "speculators" else "midlayer."
    t = {}

    def put(name, shape, scale, base=0.0):
        t[name] = ("BF16", list(shape), _bf16_bytes(base + rng.uniform(-scale, scale, shape)))

    s = 1.5 / np.sqrt(2 * hidden)
    if embed:
        put("embed_tokens.weight", [vocab, hidden], 1.0)
    put("fc.weight", [hidden, n_aux * hidden], 1.5 / np.sqrt(n_aux * hidden))
    put(p + "input_layernorm.weight", [hidden], 0.2, 1.0)
    put(p + "hidden_norm.weight", [hidden], 0.2, 1.0)
    put(p + "self_attn.q_proj.weight", [heads * hd, 2 * hidden], s)
    put(p + "self_attn.k_proj.weight", [kv_heads * hd, 2 * hidden], s)
    put(p + "self_attn.v_proj.weight", [kv_heads * hd, 2 * hidden], s)
    put(p + "self_attn.o_proj.weight", [hidden, heads * hd], 1.5 / np.sqrt(hidden))
    put(p + "post_attention_layernorm.weight", [hidden], 0.2, 1.0)
    put(p + "mlp.gate_proj.weight", [FFN, hidden], 1.5 / np.sqrt(hidden))
    put(p + "mlp.up_proj.weight", [FFN, hidden], 1.5 / np.sqrt(hidden))
    put(p + "mlp.down_proj.weight", [hidden, FFN], 1.5 / np.sqrt(FFN))
    put("norm.weight", [hidden], 0.2, 1.0)
    put("lm_head.weight", [DRAFT_VOCAB, hidden], 3 / np.sqrt(hidden))
    targets = np.sort(rng.choice(vocab, DRAFT_VOCAB, replace=False)).astype(np.int64)
    d2t = targets - np.arange(DRAFT_VOCAB, dtype=np.int64)
    assert d2t.any()
    t["d2t"] = ("I64", [DRAFT_VOCAB], d2t.astype("<i8").tobytes())
    t2d = np.zeros(vocab, np.uint8)
    t2d[targets] = 1
    t["t2d"] = ("BOOL", [vocab], t2d.tobytes())
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", t)
    layer = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    if fmt == "speculators":
        cfg = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer,
            "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": norm_before_residual,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": None if aux is None else list(aux),
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "x"}},
        }
    else:
        cfg = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
        if aux is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux)
        if norm_before_residual:
            cfg["norm_before_residual"] = True
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _mask_words(allowed: set[int]) -> np.ndarray:
    mask = np.zeros((VOCAB + 31) // 32, np.int32)
    for t in allowed:
        mask[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    return mask


@pytest.mark.parametrize(
    ("fmt", "normed_residual"),
    [("speculators", False), ("eagle3", False), ("speculators", True)],
)
def test_drafts_and_logits_match_the_numpy_reference(tmp_path, gpu, fmt, normed_residual):
    folder = write_checkpoint(tmp_path / fmt, fmt, norm_before_residual=normed_residual)
    head = specdraft.Eagle3Head.from_checkpoint(folder, gpu, target_layers=TARGET_LAYERS)
    assert head.format == fmt and head.draft_vocab_size == DRAFT_VOCAB
    numpy_head = ref.Eagle3(folder)
    np.testing.assert_array_equal(head.draft_to_target, numpy_head.draft_to_target)
    rng = np.random.default_rng(1)
    stack = ref.bf16(rng.uniform(-2, 2, (64, ROW)).astype(np.float32))
    stack_ptr = gpu.upload(stack, dtype="bf16")
    # The final hidden an MTP head reads; an EAGLE-3 head must not need it.
    final = gpu.upload(np.zeros((64, H), np.float32), dtype="bf16")
    cfg = specdraft.ModelConfig.tiny(VOCAB)
    ctx = specdraft.ForwardContext(gpu, cfg, target_hidden_stack=stack_ptr)
    tokens = [int(x) for x in rng.integers(0, VOCAB, 64)]
    state = head.alloc_state_for(gpu, 200)
    P = 16
    assert head.prefill_drafter(tokens[:P], final, state, ctx) == P - 1
    for i in range(1, P):
        numpy_head.step(tokens[i], stack[i - 1], i, True, logits=False)
    pos, consumed, worst = P, P - 1, 0.0
    # Drafts per round, and the grammar mask of round 2: it forbids the draft the head
    # would make unmasked, and every target id that is not a multiple of 3.
    plan = [3, 3, 3, 0, 2, 3]
    for r, n in enumerate(plan):
        mask = None
        if r == 2:
            saved = list(numpy_head.rows)
            (first,), _ = numpy_head.draft(tokens[pos], stack[pos - 1], pos, 1)
            numpy_head.rows = saved
            mask = {t for t in range(VOCAB) if t % 3 == 0 and t != first}
        # The rows of every token committed since the last propose, the last one paired
        # with tokens[pos]: rows consumed .. pos - 1.
        drafts = head.propose(
            tokens[pos],
            final.offset((pos - 1) * H * 2),
            pos,
            n,
            state,
            ctx,
            grammar_bitmask=None if mask is None else _mask_words(mask),
            target_hidden_stack=stack_ptr.offset(consumed * ROW * 2),
        )
        numpy_head.keep_through(pos - 1)
        if n == 0:
            numpy_head.step(tokens[pos], stack[pos - 1], pos, True, logits=False)
            assert list(drafts) == []
        else:
            want, logits = numpy_head.draft(tokens[pos], stack[pos - 1], pos, n, mask)
            assert list(drafts) == want, f"round {r}"
            got = head.last_logits(gpu)
            tol = float(np.abs(logits).max()) / 256.0
            err = float(np.abs(got - logits).max())
            worst = max(worst, err / tol)
            assert err <= tol, f"round {r}: logits differ by {err} > {tol}"
        if mask is not None:
            assert all(d in mask for d in drafts) and drafts
        k = min(r % 3, n)
        head.after_verify(k, state)
        numpy_head.keep_through(pos + k)
        tokens[pos + 1 : pos + 1 + k] = drafts[:k]
        consumed = pos
        pos += k + 1
    print(f"{fmt}: worst logit difference {worst:.3f} of the tolerance")
    head.free_state(gpu, state)
    gpu.free(stack_ptr)
    gpu.free(final)
    del head


def test_a_batch_drafts_from_each_sequences_rows_what_one_by_one_drafts(tmp_path, gpu):
    folder = write_checkpoint(tmp_path / "b", "speculators")
    head = specdraft.Eagle3Head.from_checkpoint(folder, gpu, target_layers=TARGET_LAYERS)
    assert head.propose_batch_max(specdraft.BufferArena(8), specdraft.ModelConfig.tiny(VOCAB)) > 1
    rng = np.random.default_rng(5)
    seqs, length = 3, 40
    stack = ref.bf16(rng.uniform(-2, 2, (seqs * length, ROW)).astype(np.float32))
    stack_ptr = gpu.upload(stack, dtype="bf16")
    final = gpu.upload(np.zeros((seqs * length, H), np.float32), dtype="bf16")

    def rows(s: int, q: int) -> specdraft.DevicePtr:
        return stack_ptr.offset((s * length + q) * ROW * 2)

    cfg = specdraft.ModelConfig.tiny(VOCAB)
    tokens = [[int(x) for x in rng.integers(0, VOCAB, length)] for _ in range(seqs)]
    single = [head.alloc_state(gpu) for _ in range(seqs)]
    batched = [head.alloc_state(gpu) for _ in range(seqs)]
    prompt = [6, 9, 4]
    for s in range(seqs):
        ctx = specdraft.ForwardContext(gpu, cfg, target_hidden_stack=rows(s, 0))
        for states in (single, batched):
            head.prefill_drafter(tokens[s][: prompt[s]], final, states[s], ctx)
    pos, start = list(prompt), [p - 1 for p in prompt]
    plain = specdraft.ForwardContext(gpu, cfg)
    for n in (3, 2, 3):
        want = [
            head.propose(
                tokens[s][pos[s]],
                final,
                pos[s],
                n,
                single[s],
                plain,
                target_hidden_stack=rows(s, start[s]),
            )
            for s in range(seqs)
        ]
        ctx = specdraft.ForwardContext(
            gpu, cfg, target_hidden_stacks=[rows(s, start[s]) for s in range(seqs)]
        )
        got = head.propose_batch(
            [tokens[s][pos[s]] for s in range(seqs)], [final] * seqs, pos, n, batched, ctx
        )
        assert [list(d) for d in got] == [list(d) for d in want]
        for s in range(seqs):
            k = s % (len(want[s]) + 1)
            head.after_verify(k, single[s])
            head.after_verify(k, batched[s])
            start[s], pos[s] = pos[s], pos[s] + k + 1
    with pytest.raises(specdraft.ProposerError, match="ctx.target_hidden_stacks"):
        head.propose_batch(
            [tokens[s][pos[s]] for s in range(seqs)], [final] * seqs, pos, 2, batched, plain
        )
    for state in single + batched:
        head.free_state(gpu, state)
    gpu.free(stack_ptr)
    gpu.free(final)
    del head


def test_capture_layers_are_the_aux_ids_minus_one(tmp_path, gpu):
    head = specdraft.Eagle3Head.from_checkpoint(
        write_checkpoint(tmp_path / "a", "speculators", aux=(1, 3, 7)), gpu, target_layers=8
    )
    assert head.aux_layer_ids == [1, 3, 7]
    assert head.target_layer_ids() == [0, 2, 6]
    del head
    # Without ids the default is vLLM's (2, L // 2, L - 3): for 32 layers, (2, 16, 29).
    head = specdraft.Eagle3Head.from_checkpoint(
        write_checkpoint(tmp_path / "b", "eagle3", aux=None), gpu, target_layers=32
    )
    assert head.aux_layer_ids == [2, 16, 29]
    assert head.target_layer_ids() == [1, 15, 28]
    del head


def test_conformance_from_python(tmp_path, gpu):
    head = specdraft.Eagle3Head.from_checkpoint(
        write_checkpoint(tmp_path / "c", "eagle3"), gpu, target_layers=TARGET_LAYERS
    )
    report = specdraft.check_proposer(head, gpu=gpu, vocab_size=VOCAB, hidden_size=H)
    assert report.ok, report.violations
    del head


def test_matrices_can_be_quantized_at_load(tmp_path, gpu):
    folder = write_checkpoint(tmp_path / "q", "speculators")
    bf16 = specdraft.Eagle3Head.from_checkpoint(folder, gpu, target_layers=TARGET_LAYERS)
    q8 = specdraft.Eagle3Head.from_checkpoint(
        folder, gpu, target_layers=TARGET_LAYERS, quant="q8_0"
    )
    assert (bf16.projection_format, bf16.lm_head_format) == ("bf16", "bf16")
    assert (q8.projection_format, q8.lm_head_format) == ("q8_0", "q8_0")
    # Q8_0 reads 34 bytes a block of 32 weights where BF16 reads 64 (the norms stay BF16).
    assert 0.50 < q8.bytes_per_draft / bf16.bytes_per_draft < 0.60
    report = specdraft.check_proposer(q8, gpu=gpu, vocab_size=VOCAB, hidden_size=H)
    assert report.ok, report.violations
    with pytest.raises(ValueError, match='quant "q9_9" is not one of bf16, fp8, nvfp4'):
        specdraft.Eagle3Head.from_checkpoint(folder, gpu, target_layers=TARGET_LAYERS, quant="q9_9")
    del bf16, q8


def test_without_the_captured_rows_the_head_says_what_it_needs(tmp_path, gpu):
    head = specdraft.Eagle3Head.from_checkpoint(
        write_checkpoint(tmp_path / "n", "speculators"), gpu, target_layers=TARGET_LAYERS
    )
    ctx = specdraft.ForwardContext(gpu, specdraft.ModelConfig.tiny(VOCAB))
    hid = gpu.upload(np.zeros((20, H), np.float32), dtype="bf16")
    state = head.alloc_state(gpu)
    with pytest.raises(specdraft.ProposerError, match="target_hidden_stack"):
        head.prefill_drafter(list(range(10)), hid, state, ctx)
    with pytest.raises(specdraft.ProposerError, match="target_hidden_stack"):
        head.propose(3, hid, 10, 2, state, ctx)
    head.free_state(gpu, state)
    gpu.free(hid)
    del head


def _edit(folder: Path, *, drop=(), replace=None, config=None) -> Path:
    """Rewrites the checkpoint in `folder` without the tensors `drop`, with `replace`
    (name -> (dtype, shape, bytes)), and with `config` merged into its config.json."""
    from specdraft.quantize import read_safetensors

    t = read_safetensors(folder / "model.safetensors")
    for name in drop:
        del t[name]
    t.update(replace or {})
    write_safetensors(folder / "model.safetensors", t)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _d2t(values) -> tuple[str, list[int], bytes]:
    return ("I64", [DRAFT_VOCAB], np.asarray(values, "<i8").tobytes())


@pytest.mark.parametrize(
    ("fmt", "edit", "message"),
    [
        ("speculators", {"drop": ["fc.weight"]}, r'"fc\.weight" is missing'),
        ("eagle3", {"drop": ["midlayer.hidden_norm.weight"]}, r'"midlayer\.hidden_norm\.weight"'),
        (
            "speculators",
            {"replace": {"fc.weight": ("BF16", [H, 2 * H], _bf16_bytes(np.zeros((H, 2 * H))))}},
            r'"fc\.weight" .* has shape \[64, 128\], expected \[64, 192\]',
        ),
        (
            "eagle3",
            {"replace": {"d2t": _d2t([0] * (DRAFT_VOCAB - 1) + [VOCAB])}},
            r'"d2t" maps draft id 39 \(offset 100\) to target id 139, outside the target\'s '
            "vocabulary of 100",
        ),
        (
            "speculators",
            {"replace": {"d2t": _d2t([-1] + [0] * (DRAFT_VOCAB - 1))}},
            r"draft id 0 \(offset -1\) to target id -1",
        ),
        (
            "speculators",
            {"config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}},
            r"names layer 0, the hidden entering the first layer",
        ),
        (
            "eagle3",
            {"config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}},
            r"names layer 8, but the target has 8 layers",
        ),
        (
            "eagle3",
            {"drop": ["embed_tokens.weight"]},
            r"embed_tokens\.weight \(a head without its own embedding is loaded beside its target",
        ),
        (
            "speculators",
            {"config": {"norm_before_fc": True}},
            r'"norm_before_fc": is true',
        ),
    ],
)
def test_bad_checkpoints_are_refused_naming_what_is_wrong(tmp_path, gpu, fmt, edit, message):
    folder = _edit(write_checkpoint(tmp_path / "bad", fmt), **edit)
    with pytest.raises(specdraft.SpecdraftError, match=message) as caught:
        specdraft.Eagle3Head.from_checkpoint(folder, gpu, target_layers=TARGET_LAYERS)
    assert str(folder) in str(caught.value)
    del caught
    assert gpu.live_allocs == 0


def test_in_the_engine_the_head_drafts_from_the_rows_the_target_captured(tmp_path, gpu):
    """Beside a tiny target, reading the target's embedding in place: greedy output equals
    plain greedy output, and every propose's logit is the numpy head's, fed the target's
    layer-0 output (`hidden_states(..., layers=[0])`, aux id 1) at the row paired with the
    token drafted from. The head's one-row draft vocabulary always drafts the target's own
    continuation, so every draft is accepted and each propose gets four captured rows."""
    gguf = pytest.importorskip("gguf")
    from tiny_gguf import write_tiny_llama

    write_tiny_llama(tmp_path / "m.gguf", vocab=VOCAB)
    model = specdraft.load_model(tmp_path / "m.gguf", gpu=gpu, max_seq_len=256, kv_blocks=64)
    prompt = [1, 5, 9, 13, 2, 7, 7, 30, 41]
    (plain,) = specdraft.SpecEngine(model, None).generate([prompt], max_tokens=24)
    assert len(set(plain.tokens)) == 1, "the tiny target repeats one token"
    folder = write_checkpoint(tmp_path / "h", "speculators", aux=(1,), embed=False)
    from specdraft.quantize import read_safetensors

    first_row = read_safetensors(folder / "model.safetensors")["lm_head.weight"][2][: 2 * H]
    _edit(
        folder,
        replace={
            "lm_head.weight": ("BF16", [1, H], first_row),
            "d2t": ("I64", [1], np.asarray([plain.tokens[0]], "<i8").tobytes()),
        },
        config={"draft_vocab_size": 1},
    )

    class Recording(specdraft.Eagle3Head):
        def __init__(self, *args, **kwargs) -> None:
            self.log: list[tuple[int, int, list[int], float | None]] = []

        def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, *a, **kw):
            d = super().propose(
                last_token, target_hidden, position, num_drafts, state, ctx, *a, **kw
            )
            logit = float(self.last_logits(gpu)[0]) if d else None
            self.log.append((position, last_token, list(d), logit))
            return d

    own = specdraft.Eagle3Head.from_checkpoint(
        write_checkpoint(tmp_path / "own", "eagle3", aux=(1,)), gpu, target=model
    )
    assert not own.shares_target, "a head with its own embedding reads none of the target's"
    del own
    head = Recording.from_checkpoint(folder, gpu, target=model)
    assert head.shares_target and head.target_layer_ids() == [0]
    engine = specdraft.SpecEngine(model, head, num_drafts=3, draft_policy="fixed")
    (spec,) = engine.generate([prompt], max_tokens=24)
    assert spec.finish_reason == "length", spec.error
    assert list(spec.tokens) == list(plain.tokens)
    seq = prompt + list(spec.tokens)
    captured = np.asarray(model.hidden_states(seq, layers=[0]))
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    (embed,) = [x for x in reader.tensors if x.name == "token_embd.weight"]
    numpy_head = ref.Eagle3(folder, embed=ref.bf16(np.asarray(embed.data).reshape(VOCAB, H)))
    for i in range(1, len(prompt)):
        numpy_head.step(seq[i], captured[i - 1], i, True, logits=False)
    assert len(head.log) >= 5 and all(len(d) == 3 for _, _, d, _ in head.log[:-1])
    for pos, last, drafts, logit in head.log:
        assert seq[pos] == last
        numpy_head.keep_through(pos - 1)
        want, logits = numpy_head.draft(last, captured[pos - 1], pos, len(drafts))
        assert drafts == want and drafts == seq[pos + 1 : pos + 1 + len(drafts)]
        tol = abs(float(logits[0])) / 256.0
        assert abs(logit - float(logits[0])) <= tol, (pos, logit, logits[0])
        numpy_head.keep_through(pos + len(drafts))
    del engine, head, model
