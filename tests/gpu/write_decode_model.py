"""Writes a random checkpoint with SmolLM2-135M's shape (BF16 safetensors and config.json)
for the decode benchmark on a machine that cannot fetch the real model.

The benchmark measures speed, which depends only on the shapes, so random weights of the
right sizes stand in for the real ones. Only the standard library is used (the GPU machine
may have no numpy): random bytes become BF16 values of magnitude 2^-7..2^-5 by fixing the
high exponent bits of every second byte; norm weights are exactly 1.

    python3 tests/gpu/write_decode_model.py DIR
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 576, 1536, 30, 9, 3, 49152
HEAD_DIM = HIDDEN // HEADS
ONE_BF16 = b"\x80\x3f"
# High byte of a BF16 value (sign, 7 exponent bits): keep the sign, exponent 0x78 or 0x79.
HIGH_BYTE = bytes((b & 0x80) | 0x3C for b in range(256))


def random_bf16(n: int) -> bytes:
    """``n`` random BF16 values of small magnitude, little-endian."""
    data = bytearray(os.urandom(2 * n))
    data[1::2] = data[1::2].translate(HIGH_BYTE)
    return bytes(data)


def tensors() -> list[tuple[str, list[int], bytes]]:
    """Every tensor of the model in Hugging Face names (tied embeddings: no lm_head)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN], random_bf16(VOCAB * HIDDEN))]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", [HIDDEN], ONE_BF16 * HIDDEN),
            (p + "self_attn.q_proj.weight", [q, HIDDEN], random_bf16(q * HIDDEN)),
            (p + "self_attn.k_proj.weight", [kv, HIDDEN], random_bf16(kv * HIDDEN)),
            (p + "self_attn.v_proj.weight", [kv, HIDDEN], random_bf16(kv * HIDDEN)),
            (p + "self_attn.o_proj.weight", [HIDDEN, q], random_bf16(HIDDEN * q)),
            (p + "post_attention_layernorm.weight", [HIDDEN], ONE_BF16 * HIDDEN),
            (p + "mlp.gate_proj.weight", [FFN, HIDDEN], random_bf16(FFN * HIDDEN)),
            (p + "mlp.up_proj.weight", [FFN, HIDDEN], random_bf16(FFN * HIDDEN)),
            (p + "mlp.down_proj.weight", [HIDDEN, FFN], random_bf16(HIDDEN * FFN)),
        ]
    out.append(("model.norm.weight", [HIDDEN], ONE_BF16 * HIDDEN))
    return out


def write(folder: Path) -> None:
    """Writes ``config.json`` and ``model.safetensors`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    parts = tensors()
    header, offset = {}, 0
    for name, shape, data in parts:
        end = offset + len(data)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, end]}
        offset = end
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, _, data in parts:
            f.write(data)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    write(Path(sys.argv[1]))
