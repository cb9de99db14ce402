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
from tiny_gguf import HIDDEN, LAYERS, write_tiny_llama  # noqa: E402

VOCAB = 80


def _write_tiny_gguf(path: Path, seed: int = 0) -> None:
    write_tiny_llama(path, vocab=VOCAB, seed=seed)


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
    assert model.kv_blocks == (8, 8), "logits() returns the KV blocks it used"
    out = model.generate_greedy(tokens[:4], max_tokens=3)
    assert len(out) <= 3 and all(0 <= t < VOCAB for t in out)
    assert out[0] == int(want[3].argmax())
    # Greedy decoding is the engine's: the same ids as SpecEngine with no proposer.
    (plain,) = specdraft.SpecEngine(model).generate([tokens[:4]], max_tokens=3)
    assert out == list(plain.tokens)
    with pytest.raises(specdraft.RequestError, match="outside the vocabulary"):
        model.generate_greedy([VOCAB])
    del model
    assert gpu.live_allocs == 0


def test_unknown_names_and_bad_files_raise_clear_errors(tmp_path: Path) -> None:
    """A name that is neither a path nor known lists the known names; a bad file names itself."""
    with pytest.raises(specdraft.ConfigError, match="smollm2"):
        specdraft.load_model("no-such-model")
    tiny = tmp_path / "tiny.gguf"
    _write_tiny_gguf(tiny)
    with pytest.raises(specdraft.ConfigError, match="tokenizer model None"):
        specdraft.load_tokenizer(tiny)
    assert specdraft.load_model(tiny).tokenizer is None
    meta = specdraft._core.gguf_metadata(str(tiny), ["llama.block_count", "nope"])
    assert meta == {"llama.block_count": LAYERS}
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(specdraft.CheckpointError, match="bad.gguf"):
        specdraft.load_model(bad)


def test_weights_argument_reaches_the_loader_and_unknown_formats_are_refused(
    tmp_path: Path,
) -> None:
    """``weights=`` names a block format; an unknown one lists the known, and a GGUF file
    (whose weights keep their stored formats) refuses any."""
    tiny = tmp_path / "tiny.gguf"
    _write_tiny_gguf(tiny)
    with pytest.raises(specdraft.RequestError, match=r"q4_k_m.*q8_0"):
        specdraft.load_model(tiny, weights="q4_k_m")
    with pytest.raises(specdraft.RequestError, match="GGUF file"):
        specdraft.load_model(tiny, weights="q8_0")
    assert specdraft.load_model(tiny, weights=None).vocab_size == VOCAB
