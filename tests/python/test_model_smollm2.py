"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), against the numpy reference.

Slow (downloads the model once, then runs a numpy forward of 135M parameters): marked
``slow``; CI runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft.models import fetch_default_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
sys.path.insert(0, str(Path(__file__).parent))
import smollm2_reference as ref  # noqa: E402

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.mark.slow
def test_smollm2_logits_match_the_numpy_reference() -> None:
    """Top tokens agree and logits stay within 15% of their RMS at several positions.

    The reference emulates the backend's roundings; after 30 layers flipped roundings leave
    two correct implementations 3-8% of the logit RMS apart (``tests/model_smollm2.rs``
    derives this, and checks one layer bit for bit), so this is the check against gross errors.
    """
    path = fetch_default_model()
    reader = gguf.GGUFReader(str(path))
    tokenizer = ref.tokenizer_from_gguf(reader)
    tokens = tokenizer.encode(PROMPT).ids
    ours = specdraft.load_tokenizer("smollm2")
    assert ours.encode(PROMPT) == tokens
    assert ours.decode(tokens) == PROMPT
    want = ref.forward(reader, ref.load_weights(reader), tokens)
    model = specdraft.load_model("smollm2", max_rows=64, max_seq_len=256, kv_blocks=32)
    assert model.config.num_hidden_layers == 30
    got = model.logits(tokens).reshape(len(tokens), model.vocab_size)
    for p in sorted({0, 1, len(tokens) // 2, len(tokens) - 1}):
        assert got[p].argmax() == want[p].argmax(), p
        rms = float(np.sqrt(np.mean(np.square(want[p].astype(np.float64)))))
        err = float(np.sqrt(np.mean(np.square((got[p] - want[p]).astype(np.float64)))))
        assert err <= 0.15 * rms, (p, err, rms)
    assert model.tokenizer.encode(PROMPT) == tokens, "load_model attaches the same tokenizer"
    follow = tokenizer.decode(model.generate_greedy(tokens, max_tokens=2))
    assert "Rome" in follow, follow
