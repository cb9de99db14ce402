"""`specdraft.MtpHead` from Python, against the numpy reference in `mtp_reference.py`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft.quantize import read_safetensors, write_safetensors

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("mtp_reference", _HERE / "mtp_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

H, HEADS, KVH, HD, FFN, VOCAB = 64, 4, 2, 16, 96, 100


def _bf16_bytes(a):
    return (
        ref.bf16(np.asarray(a, np.float32)).view(np.uint32).__rshift__(16).astype("<u2").tobytes()
    )


def write_checkpoint(folder: Path, layout: str, seed: int = 0) -> Path:
    """A tiny random checkpoint with the real tensor names of `layout`."""
    rng = np.random.default_rng(seed)
    zc = layout == "qwen3_next"
    module, layer, names = ref.LAYOUTS[layout]
    module, layer = module.format(L=1), layer.format(L=1)
    t = {}

    def put(name, shape, scale, base=0.0):
        t[name] = ("BF16", list(shape), _bf16_bytes(base + rng.uniform(-scale, scale, shape)))

    def norm(name, n=H):
        put(name, [n], 0.2, 0.0 if zc else 1.0)

    put("model.embed_tokens.weight", [VOCAB, H], 1.0)
    norm("model.norm.weight")
    put("lm_head.weight", [VOCAB, H], 3 / np.sqrt(H))
    norm(f"{module}{names[0]}.weight")
    norm(f"{module}{names[1]}.weight")
    put(f"{module}{names[2]}.weight", [H, 2 * H], 1 / np.sqrt(2 * H))
    norm(f"{module}{names[3]}.weight")
    s = 1.5 / np.sqrt(H)
    norm(layer + "input_layernorm.weight")
    norm(layer + "post_attention_layernorm.weight")
    put(layer + "self_attn.q_proj.weight", [(2 if zc else 1) * HEADS * HD, H], s)
    put(layer + "self_attn.k_proj.weight", [KVH * HD, H], s)
    put(layer + "self_attn.v_proj.weight", [KVH * HD, H], s)
    put(layer + "self_attn.o_proj.weight", [H, HEADS * HD], s)
    if zc:
        norm(layer + "self_attn.q_norm.weight", HD)
        norm(layer + "self_attn.k_norm.weight", HD)
    put(layer + "mlp.gate_proj.weight", [FFN, H], s)
    put(layer + "mlp.up_proj.weight", [FFN, H], s)
    put(layer + "mlp.down_proj.weight", [H, FFN], 1.5 / np.sqrt(FFN))
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / "model.safetensors", t)
    cfg = {
        "model_type": layout,
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KVH,
        "head_dim": HD,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    if zc:
        cfg["partial_rotary_factor"] = 0.25
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("layout", ["deepseek_v3", "mimo", "qwen3_next"])
def test_drafts_and_logits_match_the_numpy_reference(tmp_path, gpu, layout):
    folder = write_checkpoint(tmp_path / layout, layout)
    head = specdraft.MtpHead.from_checkpoint(folder, gpu)
    assert head.layout == ("deepseek_v3" if layout == "deepseek_v3" else layout)
    ctx = specdraft.ForwardContext(gpu, specdraft.ModelConfig.from_file(folder / "config.json"))
    rng = np.random.default_rng(1)
    hid = ref.bf16(rng.uniform(-2, 2, (64, H)).astype(np.float32))
    ptr = gpu.upload(hid, dtype="bf16")
    tokens = [int(x) for x in rng.integers(0, VOCAB, 40)]
    numpy_head = ref.Head(
        {
            "checkpoint": str(folder),
            "layout": layout,
            "quant": "bf16",
            "mtp_vocab_size": 0,
            "levers": {
                "mtp_kv_exact": False,
                "mtp_target_postnorm": False,
                "mtp_chain_postnorm": False,
            },
        }
    )
    state = head.alloc_state_for(gpu, 200)
    P = 16
    assert head.prefill_drafter(tokens[:P], ptr, state, ctx) == P - 1
    for i in range(1, P):
        numpy_head.step(tokens[i], hid[i - 1], i, True, want_logits=False)
    pos = P
    for r in range(4):
        drafts = head.propose(tokens[pos], ptr.offset((pos - 1) * H * 2), pos, 3, state, ctx)
        numpy_head.trim(pos - 2)
        token, hidden, want = tokens[pos], hid[pos - 1], []
        for j in range(3):
            logits, hidden = numpy_head.step(token, hidden, pos + j, j == 0)
            token = int(np.argmax(logits))
            want.append(token)
        np.testing.assert_array_equal(head.last_logits(gpu), logits)  # the last step's logits
        assert list(drafts) == want, f"round {r}"
        k = r % 3
        head.after_verify(k, state)
        numpy_head.trim(pos - 1 + k)
        tokens[pos + 1 : pos + 1 + k] = drafts[:k]
        pos += k + 1
    head.free_state(gpu, state)
    gpu.free(ptr)
    del head


def test_conformance_from_python(tmp_path, gpu):
    head = specdraft.MtpHead.from_checkpoint(write_checkpoint(tmp_path / "c", "mimo"), gpu)
    report = specdraft.check_proposer(head, gpu=gpu, vocab_size=VOCAB, hidden_size=H)
    assert report.ok, report.violations
    del head


class CountingHead(specdraft.MtpHead):
    """A Python subclass of MtpHead that counts its proposes (and drafts with the head)."""

    def __init__(self, *args, **kwargs) -> None:
        self.proposes = 0

    def propose(self, *args, **kwargs):
        self.proposes += 1
        return super().propose(*args, **kwargs)


def test_from_checkpoint_on_a_subclass_returns_the_subclass(tmp_path, gpu):
    folder = write_checkpoint(tmp_path / "c", "deepseek_v3")
    head = CountingHead.from_checkpoint(folder, gpu, mtp_vocab_size=50)
    assert type(head) is CountingHead and head.proposes == 0
    assert head.draft_vocab_size == 50 and head.layout == "deepseek_v3"
    report = specdraft.check_proposer(head, gpu=gpu, vocab_size=VOCAB, hidden_size=H)
    assert report.ok, report.violations
    assert head.proposes > 0, "the check ran the subclass's propose"
    assert type(specdraft.MtpHead.from_checkpoint(folder, gpu)) is specdraft.MtpHead
    del head


def test_checking_a_head_on_another_backend_says_to_pass_gpu(tmp_path, gpu):
    head = specdraft.MtpHead.from_checkpoint(write_checkpoint(tmp_path / "c", "mimo"), gpu)
    other = specdraft.CpuBackend()
    for kwargs, where in [({}, "no gpu= was given"), ({"gpu": other}, "passed as gpu=")]:
        with pytest.raises(specdraft.RequestError) as caught:
            specdraft.check_proposer(head, vocab_size=VOCAB, hidden_size=H, **kwargs)
        message = str(caught.value)
        assert "MtpHead's weights live on the cpu backend it was loaded on" in message
        assert where in message and "check_proposer(proposer, gpu=" in message
        del caught  # its traceback holds this frame, and so the head
    assert other.live_allocs == 0
    del head


def test_a_folder_without_a_module_raises_with_what_it_holds(tmp_path, gpu):
    folder = write_checkpoint(tmp_path / "x", "deepseek_v3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(specdraft.SpecdraftError, match="no MTP module"):
        specdraft.MtpHead.from_checkpoint(folder, gpu)


def test_a_reference_runner_made_in_python_drafts_what_numpy_drafts_under_a_mask(tmp_path, gpu):
    folder = write_checkpoint(tmp_path / "runner", "deepseek_v3", seed=3)
    head = specdraft.MtpHead.from_checkpoint(folder, gpu)
    runner = specdraft.ReferenceDraftRunner()
    assert isinstance(runner, specdraft.DraftRunner)
    ctx = specdraft.ForwardContext(gpu, specdraft.ModelConfig.from_file(folder / "config.json"))
    rng = np.random.default_rng(2)
    hid = ref.bf16(rng.uniform(-2, 2, (32, H)).astype(np.float32))
    ptr = gpu.upload(hid, dtype="bf16")
    tokens = [int(x) for x in rng.integers(0, VOCAB, 32)]
    allowed = [t for t in range(VOCAB) if t % 3 == 0]
    mask = np.zeros((VOCAB + 31) // 32, np.int32)
    for t in allowed:
        mask[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    numpy_head = ref.Head(
        {
            "checkpoint": str(folder),
            "layout": "deepseek_v3",
            "quant": "bf16",
            "mtp_vocab_size": 0,
            "levers": {
                "mtp_kv_exact": False,
                "mtp_target_postnorm": False,
                "mtp_chain_postnorm": False,
            },
        }
    )
    P = 12
    for i in range(1, P):
        numpy_head.step(tokens[i], hid[i - 1], i, True, want_logits=False)
    token, hidden, want = tokens[P], hid[P - 1], []
    for j in range(4):
        logits, hidden = numpy_head.step(token, hidden, P + j, j == 0)
        token = allowed[int(np.argmax(logits[allowed]))]
        want.append(token)

    def propose(bitmask, h=head):
        state = h.alloc_state_for(gpu, 200)
        h.prefill_drafter(tokens[:P], ptr, state, ctx)
        drafts = h.propose(
            tokens[P], ptr.offset((P - 1) * H * 2), P, 4, state, ctx, grammar_bitmask=bitmask
        )
        rows = h.drafter_rows(state)
        h.free_state(gpu, state)
        return list(drafts), rows

    own = propose(mask)
    head.set_circuit_draft(runner)
    through_runner = propose(mask)
    # A mask that allows nothing in the vocabulary: no drafts, the verified token's row kept.
    assert propose(np.zeros_like(mask)) == ([], P)
    head.set_circuit_draft(None)
    assert own == through_runner == (want, P + 3)
    assert repr(runner) == "ReferenceDraftRunner()"
    gpu.free(ptr)
    del head


def test_quant_names_a_block_format_and_a_bad_name_lists_the_known(tmp_path, gpu):
    folder = write_checkpoint(tmp_path / "q", "deepseek_v3")
    head = specdraft.MtpHead.from_checkpoint(folder, gpu, quant="q8_0")
    assert head.projection_format == "q8_0"
    assert specdraft.MtpHead.from_checkpoint(folder, gpu).projection_format == "bf16"
    report = specdraft.check_proposer(head, gpu=gpu, vocab_size=VOCAB, hidden_size=H)
    assert report.ok, report.violations
    for bad in ("int4", "q2_k"):
        with pytest.raises(ValueError, match=f'quant "{bad}".*bf16, fp8, nvfp4.*q8_0'):
            specdraft.MtpHead.from_checkpoint(folder, gpu, quant=bad)
    del head


def test_a_head_with_latent_attention_is_refused_naming_it(tmp_path, gpu):
    """A layer with MLA tensors under a config without the MLA sizes (kv_lora_rank, ...) is
    refused naming MLA: it cannot be read as the attention its tensors describe."""
    folder = write_checkpoint(tmp_path / "mla", "deepseek_v3")
    path = folder / "model.safetensors"
    tensors = dict(read_safetensors(path))
    module = ref.LAYOUTS["deepseek_v3"][1].format(L=1)
    tensors[f"{module}self_attn.kv_a_proj_with_mqa.weight"] = (
        "BF16",
        [HD + 8, H],
        _bf16_bytes(np.zeros((HD + 8, H))),
    )
    write_safetensors(path, tensors)
    with pytest.raises(specdraft.CheckpointError, match="multi-head latent attention"):
        specdraft.MtpHead.from_checkpoint(folder, gpu)
    assert gpu.live_allocs == 0


def test_a_deepseek_v3_target_is_refused_naming_latent_attention(tmp_path, gpu):
    """A DeepSeek-V3 target config without its latent attention sizes (kv_lora_rank, ...)
    is refused naming MLA, not the mixture of experts, which loads."""
    folder = write_checkpoint(tmp_path / "moe", "deepseek_v3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(specdraft.CheckpointError, match=r"multi-head latent attention \(MLA\)"):
        specdraft.load_model(folder, gpu=gpu)
    assert gpu.live_allocs == 0


def test_a_batch_of_trees_is_each_sequences_lone_tree(tmp_path, gpu):
    folder = write_checkpoint(tmp_path / "t", "deepseek_v3")
    head = specdraft.MtpHead.from_checkpoint(folder, gpu)
    ctx = specdraft.ForwardContext(gpu, specdraft.ModelConfig.from_file(folder / "config.json"))
    rng = np.random.default_rng(2)
    hid = ref.bf16(rng.uniform(-2, 2, (64, H)).astype(np.float32))
    ptr = gpu.upload(hid, dtype="bf16")
    tokens = [int(x) for x in rng.integers(0, VOCAB, 40)]
    starts = [9, 16, 23]
    batched = [head.alloc_state_for(gpu, 200) for _ in starts]
    alone = [head.alloc_state_for(gpu, 200) for _ in starts]
    for p, a, b in zip(starts, alone, batched, strict=True):
        head.prefill_drafter(tokens[:p], ptr, a, ctx)
        head.prefill_drafter(tokens[:p], ptr, b, ctx)
    rows = [ptr.offset((p - 1) * H * 2) for p in starts]
    last = [tokens[p] for p in starts]
    trees = head.propose_tree_batch(last, rows, starts, 6, batched, ctx)
    assert trees is not None and len(trees) == len(starts)
    for i, (p, st) in enumerate(zip(starts, alone, strict=True)):
        assert trees[i] == head.propose_tree(tokens[p], rows[i], p, 6, st, ctx), i
        tokens_, parents, probs = trees[i]
        assert len(tokens_) == 6 and parents[0] == -1 and all(0 < q <= 1 for q in probs)
    assert any(parents[k] != k - 1 for _, parents, _ in trees for k in range(1, 6)), trees
    for st in batched + alone:
        head.free_state(gpu, st)
    gpu.free(ptr)
    del head
