"""An independent numpy forward of a llama GGUF (SmolLM2), from the ``gguf`` package's
dequantized weights: the reference the Rust target model is checked against.

It shares nothing with the Rust code: weights come from ``gguf.quants.dequantize``, the
q/k rows llama.cpp permuted are un-permuted here, and RoPE is Hugging Face's rotate-half.

It emulates the roundings the CPU backend makes by design, so that what is left between the
two is arithmetic order alone: every activation between ops is rounded to BF16 (round to
nearest even), norm weights and float weights are BF16, and each input row of a linear with
a block-format weight is quantized to 8-bit blocks (32 elements for the legacy formats, 256
for the K-quants; ``d = amax / 127``, ``q = round_half_even(x * (1 / d))`` in float32)
before a float64 product with the dequantized weight. Sums and softmax run in float64.

Run as a script it prints JSON: ``{"tokens", "positions", "logits", "hidden_after_1_layer"}``:
the prompt's tokens, the logits at four positions, and the residual stream of every position
after the first layer.
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


def bf16(x):
    """Rounds to the nearest BF16 value (ties to even), returned as float32."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)


def q8(x, block):
    """The 8-bit blocks a linear's input row is quantized to, dequantized (float64)."""
    n, cols = x.shape
    b = np.asarray(x, dtype=np.float32).reshape(n, cols // block, block)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.rint((b * inv).astype(np.float32))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(n, cols)


def rms_norm(x, w, eps):
    x = x.astype(np.float32)
    ms = (np.sum(x.astype(np.float64) ** 2, axis=-1, keepdims=True) / x.shape[-1]).astype(
        np.float32
    )
    inv = (np.float32(1) / np.sqrt(ms + np.float32(eps))).astype(np.float32)
    return bf16(x * inv * bf16(w))


#: Transposed weights in the accumulation type, made once per (array, type, permutation);
#: each entry keeps its source array, so an id is never reused while cached.
_CAST: dict = {}


def forward(reader, weights, tokens, eps_scale=1.0, accumulate=np.float64, depth=None):
    """Logits (float32 [len(tokens), vocab]) of a causal forward over ``tokens``, emulating
    the backend's roundings (module doc); ``accumulate`` is the type products and sums run
    in, ``eps_scale`` multiplies the file's RMSNorm epsilon (to show what a wrong one does).
    With ``depth``, only the first ``depth`` layers run and the residual stream after them
    (BF16 values, ``[len(tokens), hidden]``) is returned instead.
    """
    from gguf import GGMLQuantizationType

    k_quants = {
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
    types = {t.name: t.tensor_type for t in reader.tensors}
    hidden = int(_field(reader, "llama.embedding_length"))
    layers = int(_field(reader, "llama.block_count"))
    heads = int(_field(reader, "llama.attention.head_count"))
    kv_heads = int(_field(reader, "llama.attention.head_count_kv"))
    eps = float(_field(reader, "llama.attention.layer_norm_rms_epsilon")) * eps_scale
    theta = float(_field(reader, "llama.rope.freq_base"))
    hd = hidden // heads
    n = len(tokens)
    acc = accumulate

    floats = {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
    }

    def linear(x, name, permute_heads=None):
        # Float weights are BF16 on the device and meet the input unquantized; block formats
        # meet 8-bit input blocks.
        w = weights[name]
        key = (id(w), acc, permute_heads)
        if key not in _CAST:
            t = w if permute_heads is None else unpermute(w, permute_heads)
            t = bf16(t) if types[name] in floats else t
            _CAST[key] = (w, np.ascontiguousarray(t.T, dtype=acc))
        if types[name] in floats:
            xq = np.asarray(x, dtype=np.float64)
        else:
            xq = q8(x, 256 if types[name] in k_quants else 32)
        return (xq.astype(acc) @ _CAST[key][1]).astype(np.float32)

    x = bf16(weights["token_embd.weight"][np.asarray(tokens)])
    inv = (
        np.float32(1)
        / np.float32(theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))
    ).astype(np.float32)
    ang = np.outer(np.arange(n, dtype=np.float32), inv).astype(np.float32)
    cos = np.concatenate([np.cos(ang.astype(np.float64))] * 2, axis=1).astype(np.float32)
    sin = np.concatenate([np.sin(ang.astype(np.float64))] * 2, axis=1).astype(np.float32)

    def rope(v):  # v: [n, h, hd]
        half = hd // 2
        rot = np.concatenate([-v[..., half:], v[..., :half]], axis=-1)
        return bf16(v * cos[:, None, :] + rot * sin[:, None, :])

    mask = np.triu(np.full((n, n), -np.inf), k=1)
    for i in range(layers if depth is None else depth):
        p = f"blk.{i}."
        h = rms_norm(x, weights[p + "attn_norm.weight"], eps)
        q = bf16(linear(h, p + "attn_q.weight", heads))
        k = bf16(linear(h, p + "attn_k.weight", kv_heads))
        v = bf16(linear(h, p + "attn_v.weight"))
        q = rope(q.reshape(n, heads, hd))
        k = rope(k.reshape(n, kv_heads, hd))
        v = v.reshape(n, kv_heads, hd)
        group = heads // kv_heads
        out = np.empty((n, heads, hd), dtype=np.float32)
        for hh in range(heads):
            kk, vv = k[:, hh // group].astype(acc), v[:, hh // group].astype(acc)
            s = (q[:, hh].astype(acc) @ kk.T) / acc(np.sqrt(hd)) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            out[:, hh] = (s @ vv).astype(np.float32)
        o = bf16(linear(bf16(out).reshape(n, heads * hd), p + "attn_output.weight"))
        x = bf16(x + o)
        h = rms_norm(x, weights[p + "ffn_norm.weight"], eps)
        g = bf16(linear(h, p + "ffn_gate.weight"))
        u = bf16(linear(h, p + "ffn_up.weight"))
        a = bf16(g / (np.float32(1) + np.exp(-g)) * u)
        x = bf16(x + bf16(linear(a, p + "ffn_down.weight")))
    if depth is not None:
        return x
    x = rms_norm(x, weights["output_norm.weight"], eps)
    head = "output.weight" if "output.weight" in weights else "token_embd.weight"
    return linear(x, head)


def main(argv):
    from gguf import GGUFReader

    path = argv[1]
    default = "The capital of France is Paris, and the capital of Italy is"
    prompt = argv[2] if len(argv) > 2 else default
    reader = GGUFReader(path)
    tokens = tokenizer_from_gguf(reader).encode(prompt).ids
    weights = load_weights(reader)
    logits = forward(reader, weights, tokens)
    hidden1 = forward(reader, weights, tokens, depth=1)
    positions = sorted({0, 1, len(tokens) // 2, len(tokens) - 1})
    json.dump(
        {
            "tokens": tokens,
            "positions": positions,
            "logits": [logits[p].tolist() for p in positions],
            "hidden_after_1_layer": hidden1.tolist(),
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main(sys.argv)
