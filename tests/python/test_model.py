"""The target model from Python: loading by path and by name, and agreement with an
independent numpy forward on a tiny llama GGUF written by the ``gguf`` package itself."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import specdraft
import specdraft.models

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).parent))
import smollm2_reference as ref  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 80


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (the inverse of ``ref.unpermute``)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write_tiny_gguf(path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm())
        w.add_tensor(p + "attn_q.weight", _permute(mat(HEADS * hd, HIDDEN), HEADS))
        w.add_tensor(p + "attn_k.weight", _permute(mat(KV_HEADS * hd, HIDDEN), KV_HEADS))
        w.add_tensor(p + "attn_v.weight", mat(KV_HEADS * hd, HIDDEN))
        w.add_tensor(p + "attn_output.weight", mat(HIDDEN, HEADS * hd))
        w.add_tensor(p + "ffn_norm.weight", norm())
        w.add_tensor(p + "ffn_gate.weight", mat(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", mat(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", mat(HIDDEN, FFN))
    w.add_tensor("output_norm.weight", norm())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gguf_matches_the_numpy_reference(tmp_path: Path) -> None:
    """Logits at every position agree with the independent numpy forward."""
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    gpu = specdraft.CpuBackend()
    model = specdraft.load_model(path, gpu=gpu, max_rows=32, max_seq_len=64, kv_blocks=8)
    assert model.vocab_size == VOCAB
    assert model.config.hidden_size == HIDDEN
    tokens = [1, 7, 33, 2, 79, 40, 40, 5, 12, 64, 3, 17, 21, 8, 70, 9, 11, 30]
    got = model.logits(tokens).reshape(len(tokens), VOCAB)
    reader = gguf.GGUFReader(str(path))
    want = ref.forward(reader, ref.load_weights(reader), tokens)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.03 * scale
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.9
    assert model.kv_blocks_free == 8, "logits() returns the KV blocks it used"
    out = model.generate_greedy(tokens[:4], max_new_tokens=3)
    assert len(out) <= 3 and all(0 <= t < VOCAB for t in out)
    assert out[0] == int(want[3].argmax())
    del model
    assert gpu.live_allocs == 0


def test_unknown_names_and_bad_files_raise_clear_errors(tmp_path: Path) -> None:
    """A name that is neither a path nor known lists the known names; a bad file names itself."""
    with pytest.raises(specdraft.ConfigError, match="smollm2"):
        specdraft.load_model("no-such-model")
    tiny = tmp_path / "tiny.gguf"
    _write_tiny_gguf(tiny)
    with pytest.raises(specdraft.ConfigError, match="tokenizer model None"):
        specdraft.models.load_tokenizer(tiny)
    meta = specdraft._core.gguf_metadata(str(tiny), ["llama.block_count", "nope"])
    assert meta == {"llama.block_count": LAYERS}
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(specdraft.CheckpointError, match="bad.gguf"):
        specdraft.load_model(bad)
