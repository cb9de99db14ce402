"""An independent numpy forward of a llama GGUF (SmolLM2), from the ``gguf`` package's
dequantized weights: the reference the Rust target model is checked against.

It shares nothing with the Rust code: weights come from ``gguf.quants.dequantize``, the
q/k rows llama.cpp permuted are un-permuted here, RoPE is Hugging Face's rotate-half, and
everything runs in float32 (float64 for the attention softmax).

Run as a script it prints JSON: ``{"tokens": [...], "positions": [...], "logits": [[...]]}``.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def tokenizer_from_gguf(reader):
    """SmolLM2's byte-level BPE tokenizer, rebuilt from the GGUF vocab and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    vocab = {tok: i for i, tok in enumerate(strings("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _field(reader, key):
    return reader.fields[key].contents()


def load_weights(reader):
    from gguf.quants import dequantize

    weights = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        weights[t.name] = (
            w.reshape([int(d) for d in reversed(t.shape)])
            if w.ndim == 1 and len(t.shape) > 1
            else w
        )
    return weights


def unpermute(w, heads):
    """Undoes llama.cpp's q/k row permutation: adjacent pairs back to rotate-half halves."""
    rows, cols = w.shape
    hd = rows // heads
    return w.reshape(heads, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def rms_norm(x, w, eps):
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def forward(reader, weights, tokens):
    """Logits (float32 [len(tokens), vocab]) of a causal forward over ``tokens``."""
    hidden = int(_field(reader, "llama.embedding_length"))
    layers = int(_field(reader, "llama.block_count"))
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    eps = float(_field(reader, "llama.attention.layer_norm_rms_epsilon"))
    theta = float(_field(reader, "llama.rope.freq_base"))
    hd = hidden // heads
    n = len(tokens)
    x = weights["token_embd.weight"][np.asarray(tokens)]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.outer(np.arange(n, dtype=np.float64), inv)
    cos = np.concatenate([np.cos(ang)] * 2, axis=1).astype(np.float32)
    sin = np.concatenate([np.sin(ang)] * 2, axis=1).astype(np.float32)

    def rope(v):  # v: [n, h, hd]
        half = hd // 2
        rot = np.concatenate([-v[..., half:], v[..., :half]], axis=-1)
        return v * cos[:, None, :] + rot * sin[:, None, :]

    mask = np.triu(np.full((n, n), -np.inf), k=1)
    for i in range(layers):
        p = f"blk.{i}."
        h = rms_norm(x, weights[p + "attn_norm.weight"], eps)
        q = h @ unpermute(weights[p + "attn_q.weight"], heads).T
        k = h @ unpermute(weights[p + "attn_k.weight"], kv_heads).T
        v = h @ weights[p + "attn_v.weight"].T
        q = rope(q.reshape(n, heads, hd))
        k = rope(k.reshape(n, kv_heads, hd))
        v = v.reshape(n, kv_heads, hd)
        group = heads // kv_heads
        out = np.empty((n, heads, hd), dtype=np.float32)
        for hh in range(heads):
            kk, vv = k[:, hh // group], v[:, hh // group]
            s = (q[:, hh].astype(np.float64) @ kk.T.astype(np.float64)) / np.sqrt(hd) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            out[:, hh] = (s @ vv.astype(np.float64)).astype(np.float32)
        x = x + out.reshape(n, heads * hd) @ weights[p + "attn_output.weight"].T
        h = rms_norm(x, weights[p + "ffn_norm.weight"], eps)
        g = h @ weights[p + "ffn_gate.weight"].T
        u = h @ weights[p + "ffn_up.weight"].T
        x = x + (g / (1.0 + np.exp(-g)) * u) @ weights[p + "ffn_down.weight"].T
    x = rms_norm(x, weights["output_norm.weight"], eps)
    head = weights.get("output.weight", weights["token_embd.weight"])
    return x @ head.T


def main(argv):
    from gguf import GGUFReader

    path = argv[1]
    default = "The capital of France is Paris, and the capital of Italy is"
    prompt = argv[2] if len(argv) > 2 else default
    reader = GGUFReader(path)
    tokens = tokenizer_from_gguf(reader).encode(prompt).ids
    logits = forward(reader, load_weights(reader), tokens)
    positions = sorted({0, 1, len(tokens) // 2, len(tokens) - 1})
    json.dump(
        {
            "tokens": tokens,
            "positions": positions,
            "logits": [logits[p].tolist() for p in positions],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main(sys.argv)
