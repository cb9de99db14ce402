"""A random tiny llama written as a real GGUF file by the ``gguf`` package, for tests.

The q/k rows are permuted as llama.cpp's converter permutes them, so loaders meet the
layout real files have.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (the inverse of ``smollm2_reference.unpermute``)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_tiny_llama(
    path: Path,
    *,
    vocab: int,
    seed: int = 0,
    context_length: int = 256,
    metadata: Callable[[object], None] | None = None,
    layers: int = LAYERS,
) -> None:
    """Write a tiny random llama with ``vocab`` tokens and ``layers`` layers to ``path``.

    ``metadata(writer)`` adds tokenizer keys; without it the file only names EOS id 2.
    """
    import gguf

    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(context_length)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    if metadata is None:
        w.add_eos_token_id(2)
    else:
        metadata(w)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, HIDDEN)).astype(np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm())
        w.add_tensor(p + "attn_q.weight", permute_qk(mat(HEADS * hd, HIDDEN), HEADS))
        w.add_tensor(p + "attn_k.weight", permute_qk(mat(KV_HEADS * hd, HIDDEN), KV_HEADS))
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
