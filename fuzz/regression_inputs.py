"""The hand-made regression inputs of the loader fuzz targets, written into ``tests/fuzz_inputs/``.

Each is a small hostile file that reached a dangerous path of a loader before the loaders
checked sizes: a count, length or size near 2^40, 2^60 or 2^64 that a loader would have looped
over or allocated for, an offset past the end of the file, a product of dims that overflows,
JSON nested past the parser's recursion, a field of the wrong type. Each is named after what
it exercises; the regression tests (``tests/fuzz_regressions.rs`` for the Rust targets,
``tests/python/test_tokenizer_files.py`` for ``tokenizer_gguf``) replay every file in the
folder and check the refusal each is kept for, so a new file needs its expected outcome
there too.

The files are written byte by byte here (no GGUF or safetensors writer), so that each header
says exactly what its name says. Running the script again writes the same bytes.
``checkpoint/hidden-size-2^40`` was cut from the Rust tests' tiny model and is not written
here.

Usage: python fuzz/regression_inputs.py [OUT]   (default: tests/fuzz_inputs)
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

NEAR_2_60 = (1 << 60) + 12345
TWO_60 = 1 << 60
TWO_40 = 1 << 40
U64_MAX = (1 << 64) - 1

# --- GGUF -----------------------------------------------------------------------------

# GGUF value types.
U8, U32, I32, F32, BOOL, STRING, ARRAY, U64 = 0, 4, 5, 6, 7, 8, 9, 10
# ggml tensor types.
GGML_F32, GGML_Q8_0 = 0, 8


def u32(n: int) -> bytes:
    """A little-endian u32."""
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    """A little-endian u64."""
    return struct.pack("<Q", n)


def gstr(s: str | bytes) -> bytes:
    """A GGUF string: its length (u64), then its bytes."""
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw)) + raw


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    """A GGUF header: magic, version, tensor count, metadata count."""
    return b"GGUF" + u32(version) + u64(n_tensors) + u64(n_kv)


def kv(key: str, ty: int, payload: bytes) -> bytes:
    """One metadata entry: key, value type, the value's bytes as given."""
    return gstr(key) + u32(ty) + payload


def kv_str(key: str, value: str | bytes) -> bytes:
    """A string entry."""
    return kv(key, STRING, gstr(value))


def kv_u32(key: str, value: int) -> bytes:
    """A u32 entry."""
    return kv(key, U32, u32(value))


def kv_u64(key: str, value: int) -> bytes:
    """A u64 entry."""
    return kv(key, U64, u64(value))


def array(inner: int, items: list[bytes], count: int | None = None) -> bytes:
    """An array value: element type, count (the items' unless given), the items' bytes."""
    return u32(inner) + u64(len(items) if count is None else count) + b"".join(items)


def kv_strings(key: str, values: list[str | bytes]) -> bytes:
    """An array of strings entry."""
    return kv(key, ARRAY, array(STRING, [gstr(v) for v in values]))


def kv_ints(key: str, ty: int, values: list[int]) -> bytes:
    """An array of integers entry (``ty`` is U32 or I32)."""
    fmt = "<I" if ty == U32 else "<i"
    return kv(key, ARRAY, array(ty, [struct.pack(fmt, v) for v in values]))


def tensor_info(name: str, dims: list[int], ggml_type: int, offset: int) -> bytes:
    """One tensor info: name, dims count, dims (innermost first), type, data offset."""
    return (
        gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ggml_type) + u64(offset)
    )


def padded(b: bytes, tail: int = 64) -> bytes:
    """``b`` zero-padded to the next multiple of 32 bytes, plus ``tail`` zero bytes."""
    return b + bytes(-len(b) % 32 + tail)


def one_tensor(dims: list[int], ggml_type: int = GGML_F32, offset: int = 0) -> bytes:
    """A file of one tensor info (``blk.0.attn_q.weight``) and a little data after it."""
    return padded(header(1, 0) + tensor_info("blk.0.attn_q.weight", dims, ggml_type, offset))


def llama_meta(**override: int) -> list[bytes]:
    """The metadata of a tiny llama (hidden 16, 2 heads, FFN 32, one layer, vocab 16)."""
    sizes = {
        "embedding_length": 16,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "feed_forward_length": 32,
        "block_count": 1,
        "vocab_size": 16,
        "context_length": 64,
    }
    sizes.update({k.replace("__", "."): v for k, v in override.items()})
    entries = [kv_str("general.architecture", "llama")]
    for key, value in sizes.items():
        put = kv_u64 if value >= 1 << 32 else kv_u32
        entries.append(put(f"llama.{key}", value))
    return entries


def gguf_file(meta: list[bytes], tensors: list[tuple[str, list[int], bytes]]) -> bytes:
    """A GGUF file of ``meta`` entries and F32 ``tensors`` (name, dims innermost first, data)."""
    infos, data = b"", b""
    for name, dims, values in tensors:
        infos += tensor_info(name, dims, GGML_F32, len(data))
        data += values + bytes(-len(values) % 32)
    head = header(len(tensors), len(meta)) + b"".join(meta) + infos
    return head + bytes(-len(head) % 32) + data


def f32s(n: int) -> bytes:
    """``n`` small distinct f32 values."""
    return struct.pack(f"<{n}f", *[(i % 7 - 3) / 8 for i in range(n)])


def gguf_inputs() -> dict[str, bytes]:
    """Inputs of the ``gguf`` target."""
    nested = u32(ARRAY) + u64(1)  # an array of one array, four times over, then a fifth
    deep = nested * 4 + array(U8, [b"\x01"])
    return {
        "dims-product-overflows-2^64": one_tensor([NEAR_2_60, 16]),
        "tensor-count-2^60": header(TWO_60, 0) + bytes(256),
        "metadata-count-2^60": header(0, TWO_60) + bytes(256),
        "key-length-2^60": header(0, 1) + u64(TWO_60) + b"a" * 64,
        "string-value-length-2^60": header(0, 1)
        + gstr("general.name")
        + u32(STRING)
        + u64(TWO_60)
        + b"a" * 64,
        "tensor-name-length-2^60": header(1, 0) + u64(TWO_60) + bytes(40),
        "array-count-2^60": header(0, 1)
        + kv("tokenizer.ggml.tokens", ARRAY, array(STRING, [], count=TWO_60))
        + bytes(64),
        "arrays-nested-5-deep": header(0, 1) + kv("general.nested", ARRAY, deep),
        "value-type-13": header(0, 1) + gstr("general.name") + u32(13) + bytes(16),
        "dims-count-5": one_tensor([1, 1, 1, 1, 1]),
        "f32-bytes-2^62-past-the-end": one_tensor([NEAR_2_60]),
        "data-offset-2^40-past-the-end": one_tensor([8], offset=TWO_40),
        "data-offset-8-not-aligned": one_tensor([8], offset=8),
        "alignment-48": header(0, 1) + kv_u64("general.alignment", 48),
        "alignment-2^62": header(0, 1) + kv_u64("general.alignment", 1 << 62),
        "q8_0-33-elements-not-whole-blocks": one_tensor([33], GGML_Q8_0),
        "version-4": header(0, 0, version=4) + bytes(32),
        "ends-inside-the-version": b"GGUF\x03\x00",
        "key-twice": header(0, 2) + kv_str("general.name", "a") + kv_str("general.name", "b"),
        "embedding-length-2^40": gguf_file(llama_meta(embedding_length=TWO_40), []),
        "head-count-0": gguf_file(llama_meta(attention__head_count=0), []),
        "eos-token-id-2^32+2": gguf_file(
            llama_meta() + [kv_u64("tokenizer.ggml.eos_token_id", (1 << 32) + 2)], []
        ),
        "token-embd-rows-against-vocab": gguf_file(
            llama_meta(), [("token_embd.weight", [16, 8], f32s(16 * 8))]
        ),
    }


# --- safetensors ------------------------------------------------------------------------


def st(header_text: str | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file: header length (that of the header unless given), header, data."""
    raw = header_text.encode() if isinstance(header_text, str) else header_text
    return u64(len(raw) if length is None else length) + raw + data


def st_header(tensors: dict[str, tuple[str, list[int], list[int]]]) -> str:
    """A safetensors JSON header of ``name: (dtype, shape, data_offsets)``."""
    return json.dumps(
        {n: {"dtype": d, "shape": s, "data_offsets": o} for n, (d, s, o) in tensors.items()},
        separators=(",", ":"),
    )


def safetensors_inputs() -> dict[str, bytes]:
    """Inputs of the ``safetensors`` target."""
    one = st_header({"a": ("F32", [1], [0, 4])})
    return {
        "header-length-2^40": st(one, bytes(4), length=TWO_40),
        "header-length-2^64-1": st(one, bytes(4), length=U64_MAX),
        "header-length-past-the-end": st(one, bytes(4), length=4096),
        "too-short-for-the-header-length": b"\x10\x00\x00\x00\x00",
        "offsets-2^40-past-the-end": st(
            st_header({"a": ("F32", [1 << 38], [0, TWO_40])}), bytes(16)
        ),
        "shape-product-overflows-2^64": st(
            st_header({"a": ("F32", [1 << 32, 1 << 32, 2], [0, 8])}), bytes(8)
        ),
        "offsets-overlap": st(
            st_header({"a": ("F32", [2], [0, 8]), "b": ("F32", [2], [4, 12])}), bytes(12)
        ),
        "offsets-reversed": st(st_header({"a": ("F32", [2], [8, 0])}), bytes(8)),
        "shape-against-offsets": st(st_header({"a": ("F32", [3], [0, 8])}), bytes(8)),
        # Loads: an empty tensor is valid, and converting it must not divide by its size.
        "zero-element-tensor": st(
            st_header({"empty": ("BF16", [0, 4], [0, 0]), "a": ("F32", [1], [0, 4])}), bytes(4)
        ),
        "f4-odd-element-count": st(st_header({"a": ("F4", [3], [0, 2])}), bytes(2)),
        "dim-2^64": st(
            '{"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}}', bytes(4)
        ),
        "header-not-utf8": st(b'{"a":"\xff\xfe"}', bytes(4)),
        # In a key the header's schema does not know: read as any value, so its nesting counts.
        "header-nested-200-deep": st(
            '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":'
            + "[" * 200
            + "]" * 200
            + "}}",
            bytes(4),
        ),
    }


# --- config.json ------------------------------------------------------------------------

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}

MOE_CONFIG = {
    **TINY_CONFIG,
    "model_type": "deepseek_v3",
    "head_dim": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "num_nextn_predict_layers": 1,
}


def config(base: dict | None = None, **override: object) -> dict:
    """The tiny config (or ``base``) with ``override``; a value of ``None`` drops the key."""
    out = {**(base or TINY_CONFIG), **override}
    return {k: v for k, v in out.items() if v is not None}


def text(value: object) -> bytes:
    """A config as JSON bytes."""
    return json.dumps(value).encode()


def config_inputs() -> dict[str, bytes]:
    """Inputs of the ``config_json`` target."""
    return {
        "hidden-size-2^40": text(config(hidden_size=TWO_40)),
        "vocab-size-2^64-1": text(config(vocab_size=U64_MAX)),
        "max-position-embeddings-2^64-1": text(config(max_position_embeddings=U64_MAX)),
        "num-hidden-layers-negative": text(config(num_hidden_layers=-1)),
        "intermediate-size-1e300": text(config(intermediate_size=1e300)),
        "num-attention-heads-0": text(config(num_attention_heads=0)),
        "num-key-value-heads-0": text(config(num_key_value_heads=0)),
        "heads-3-over-kv-heads-2": text(config(num_attention_heads=3, num_key_value_heads=2)),
        "head-dim-odd": text(config(head_dim=7)),
        "rope-theta-1e39-is-inf-in-f32": text(config(rope_theta=1e39)),
        "rms-norm-eps-negative": text(config(rms_norm_eps=-1.0)),
        "rope-scaling-factor-0": text(config(rope_scaling={"rope_type": "linear", "factor": 0})),
        "eos-token-id-2^32+2": text(config(eos_token_id=(1 << 32) + 2)),
        "experts-2^40": text(config(MOE_CONFIG, n_routed_experts=TWO_40)),
        "experts-per-token-9-of-8": text(config(MOE_CONFIG, num_experts_per_tok=9)),
        "mtp-layers-2^20": text(config(MOE_CONFIG, num_nextn_predict_layers=1 << 20)),
        "nested-200-deep": b'{"model_type": "llama", "x": ' + b"[" * 200 + b"]" * 200 + b"}",
        "top-level-array": b"[1, 2]",
        "not-utf8": b'{"model_type": "\xff"}',
        "model-type-unknown": text(config(model_type="gpt-j")),
    }


# --- checkpoint -------------------------------------------------------------------------


def tiny_weights(overrides: dict[str, tuple[str, list[int]]] | None = None) -> bytes:
    """The safetensors file of the tiny llama config, in BF16.

    ``overrides`` gives some tensors another dtype and shape.
    """
    h, ffn, q, kvd, vocab = 16, 32, 16, 8, 16
    shapes = {
        "model.embed_tokens.weight": [vocab, h],
        "model.layers.0.input_layernorm.weight": [h],
        "model.layers.0.self_attn.q_proj.weight": [q, h],
        "model.layers.0.self_attn.k_proj.weight": [kvd, h],
        "model.layers.0.self_attn.v_proj.weight": [kvd, h],
        "model.layers.0.self_attn.o_proj.weight": [h, q],
        "model.layers.0.post_attention_layernorm.weight": [h],
        "model.layers.0.mlp.gate_proj.weight": [ffn, h],
        "model.layers.0.mlp.up_proj.weight": [ffn, h],
        "model.layers.0.mlp.down_proj.weight": [h, ffn],
        "model.norm.weight": [h],
        "lm_head.weight": [vocab, h],
    }
    sizes = {"BF16": 2, "F32": 4, "F64": 8}
    entries, data = {}, b""
    for name, shape in shapes.items():
        dtype, shape = (overrides or {}).get(name, ("BF16", shape))
        n = 1
        for d in shape:
            n *= d
        size = n * sizes[dtype]
        entries[name] = (dtype, shape, [len(data), len(data) + size])
        data += (f32s(n * sizes[dtype] // 4 + 1))[:size]
    return st(st_header(entries), data)


def pack(config_json: bytes, weights: bytes) -> bytes:
    """A ``checkpoint`` input: the length of ``config.json`` (u64), it, the safetensors file."""
    return u64(len(config_json)) + config_json + weights


def checkpoint_inputs() -> dict[str, bytes]:
    """Inputs of the ``checkpoint`` target: a tiny llama checkpoint with one thing wrong."""
    weights = tiny_weights()
    return {
        "vocab-size-2^40": pack(text(config(vocab_size=TWO_40)), weights),
        "intermediate-size-2^40": pack(text(config(intermediate_size=TWO_40)), weights),
        "num-hidden-layers-2^20": pack(text(config(num_hidden_layers=1 << 20)), weights),
        "heads-0": pack(text(config(num_attention_heads=0)), weights),
        "vocab-size-64-against-16-embedding-rows": pack(text(config(vocab_size=64)), weights),
        "down-proj-shape-transposed": pack(
            text(config()),
            tiny_weights({"model.layers.0.mlp.down_proj.weight": ("BF16", [32, 16])}),
        ),
        "norm-weight-f64": pack(text(config()), tiny_weights({"model.norm.weight": ("F64", [16])})),
        "experts-2^40": pack(text(config(MOE_CONFIG, n_routed_experts=TWO_40)), weights),
    }


# --- tokenizer_gguf ---------------------------------------------------------------------

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab"]


def tokenizer(**override: bytes | None) -> bytes:
    """A GGUF file of a six-token byte-level tokenizer.

    ``override`` replaces whole metadata entries by key (``__`` for ``.``); ``None`` drops one.
    """
    entries = {
        "tokenizer.ggml.model": kv_str("tokenizer.ggml.model", "gpt2"),
        "tokenizer.ggml.tokens": kv_strings("tokenizer.ggml.tokens", TOKENS),
        "tokenizer.ggml.token_type": kv_ints("tokenizer.ggml.token_type", I32, [3, 3, 3, 1, 1, 1]),
        "tokenizer.ggml.merges": kv_strings("tokenizer.ggml.merges", ["a b"]),
        "tokenizer.ggml.bos_token_id": kv_u32("tokenizer.ggml.bos_token_id", 1),
        "tokenizer.ggml.eos_token_id": kv_u32("tokenizer.ggml.eos_token_id", 2),
    }
    entries.update({k.replace("__", "."): v for k, v in override.items()})
    kept = [v for v in entries.values() if v is not None]
    return padded(header(0, len(kept)) + b"".join(kept), tail=0)


def tokenizer_inputs() -> dict[str, bytes]:
    """Inputs of the ``tokenizer_gguf`` target."""
    tokens = "tokenizer.ggml.tokens"
    whole = tokenizer()
    return {
        "tokens-count-2^60": tokenizer(
            tokenizer__ggml__tokens=kv(tokens, ARRAY, array(STRING, [], count=TWO_60))
        ),
        "token-string-length-2^60": tokenizer(
            tokenizer__ggml__tokens=kv(tokens, ARRAY, array(STRING, [u64(TWO_60) + b"a"]))
        ),
        "template-length-2^60": tokenizer(
            tokenizer__chat_template=gstr("tokenizer.chat_template") + u32(STRING) + u64(TWO_60)
        ),
        "merges-of-type-u32": tokenizer(
            tokenizer__ggml__merges=kv_ints("tokenizer.ggml.merges", U32, [1, 2])
        ),
        "merges-of-type-string": tokenizer(
            tokenizer__ggml__merges=kv_str("tokenizer.ggml.merges", "a b")
        ),
        "merge-without-a-space": tokenizer(
            tokenizer__ggml__merges=kv_strings("tokenizer.ggml.merges", ["ab"])
        ),
        "merge-of-unknown-tokens": tokenizer(
            tokenizer__ggml__merges=kv_strings("tokenizer.ggml.merges", ["a zz"])
        ),
        "tokens-of-type-u32": tokenizer(tokenizer__ggml__tokens=kv_ints(tokens, U32, [1, 2, 3])),
        "no-tokens": tokenizer(tokenizer__ggml__tokens=kv_strings(tokens, [])),
        "token-types-2-for-6-tokens": tokenizer(
            tokenizer__ggml__token_type=kv_ints("tokenizer.ggml.token_type", I32, [1, 1])
        ),
        "eos-token-id-2^40": tokenizer(
            tokenizer__ggml__eos_token_id=kv_u64("tokenizer.ggml.eos_token_id", TWO_40)
        ),
        "template-of-type-u32": tokenizer(
            tokenizer__chat_template=kv_u32("tokenizer.chat_template", 7)
        ),
        "tokenizer-model-llama": tokenizer(
            tokenizer__ggml__model=kv_str("tokenizer.ggml.model", "llama")
        ),
        "header-ends-after-the-version": b"GGUF\x03\x00\x00\x00",
        # Inside the third token: the counts still fit what is left, its length does not.
        "file-ends-inside-the-tokens": whole[:170],
        "token-with-invalid-utf8": tokenizer(
            tokenizer__ggml__tokens=kv_strings(tokens, [*TOKENS, b"\xff\xfe"]),
            tokenizer__ggml__token_type=kv_ints(
                "tokenizer.ggml.token_type", I32, [3, 3, 3, 1, 1, 1, 1]
            ),
        ),
    }


TARGETS = {
    "gguf": gguf_inputs,
    "safetensors": safetensors_inputs,
    "config_json": config_inputs,
    "checkpoint": checkpoint_inputs,
    "tokenizer_gguf": tokenizer_inputs,
}


def main() -> int:
    """Writes every input into the folder given on the command line."""
    root = (
        Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "tests/fuzz_inputs"
    )
    for target, inputs in TARGETS.items():
        folder = root / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in inputs().items():
            (folder / name).write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
