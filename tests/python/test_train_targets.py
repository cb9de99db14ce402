"""What the trainer reads from the target: ``TargetModel.hidden_states`` (the hiddens
before the final norm, computed in chunks of ``max_rows``) and the frozen output weights
read from the GGUF file, checked together against the independent numpy forward."""

from __future__ import annotations

import numpy as np
import pytest
import specdraft

gguf = pytest.importorskip("gguf")
import smollm2_reference as ref  # noqa: E402
from specdraft.train.targets import read_target_weights  # noqa: E402
from tiny_gguf import HIDDEN, write_tiny_llama  # noqa: E402

VOCAB = 80


def test_hidden_states_through_the_final_norm_and_head_give_the_reference_logits(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, vocab=VOCAB, seed=0)
    gpu = specdraft.CpuBackend()
    # 18 tokens through forwards of at most 8 rows: three chunks of one sequence.
    model = specdraft.load_model(path, gpu=gpu, max_rows=8, max_seq_len=64, kv_blocks=8)
    tokens = [1, 7, 33, 2, 79, 40, 40, 5, 12, 64, 3, 17, 21, 8, 70, 9, 11, 30]
    hidden = model.hidden_states(tokens)
    assert hidden.shape == (len(tokens), HIDDEN) and hidden.dtype == np.float32
    assert model.kv_blocks[1] == 8, "hidden_states() returns the KV blocks it used"
    w = read_target_weights(path)
    eps = model.config.rms_norm_eps
    normed = hidden / np.sqrt(np.mean(hidden * hidden, axis=-1, keepdims=True) + eps)
    got = (normed * w.final_norm) @ w.lm_head.T
    reader = gguf.GGUFReader(str(path))
    want = ref.forward(reader, ref.load_weights(reader), tokens)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.03 * scale
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.9
    assert model.hidden_states([]).shape == (0, HIDDEN)
    with pytest.raises(specdraft.SpecdraftError, match="outside the vocabulary"):
        model.hidden_states([3, VOCAB])
    assert model.kv_blocks[1] == 8
    del model
    assert gpu.live_allocs == 0
