"""Tokenizers for the target models, with their chat templates.

A tokenizer is rebuilt from a GGUF file's metadata, or read from a Hugging Face
``tokenizer.json``.

SmolLM2 (and the other llama-family GGUFs with ``tokenizer.ggml.model == "gpt2"``) use a
byte-level BPE: ``tokenizers.models.BPE(vocab, merges)`` with merges split on the first
space, a ``ByteLevel`` pre-tokenizer without a prefix space and a ``ByteLevel`` decoder.
Control tokens (GGUF token type 3, e.g. ``<|im_start|>``) become special tokens so the chat
template's markers encode to one id each. The chat template is the Jinja text in
``tokenizer.chat_template``, rendered in jinja2's sandbox by :mod:`specdraft.chat_template`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from specdraft.chat_template import CompiledTemplate

__all__ = ["Tokenizer", "load_tokenizer"]

_CONTROL = 3  # GGUF token type of control tokens


class Tokenizer:
    """Encode, decode and apply the chat template; wraps a ``tokenizers.Tokenizer``."""

    def __init__(
        self,
        hf: Any,  # noqa: ANN401 - tokenizers.Tokenizer, imported lazily
        chat_template: str | None,
        eos_token_id: int | None,
        bos_token: str = "",
        eos_token: str = "",
        source: str | None = None,
    ) -> None:
        """Wraps ``hf``; ``source`` (the model file) is named in errors about the template."""
        self.hf = hf
        self.chat_template = chat_template
        self.eos_token_id = eos_token_id
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.source = source or "the chat template given to Tokenizer"
        self._compiled: CompiledTemplate | None = None

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, special tokens included."""
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS added; chat templates add their own markers)."""
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; special tokens are kept so chat markers stay visible."""
        return str(self.hf.decode(list(ids), skip_special_tokens=False))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_vars: Any,
    ) -> str:
        """``messages`` (``{"role", "content"}`` dicts) rendered with the model's template.

        The template renders in jinja2's sandbox with the variables and helpers transformers
        gives it (see :mod:`specdraft.chat_template`); one that reaches for Python internals
        raises :class:`~specdraft.chat_template.UnsafeTemplateError` and runs nothing.
        Without a template, the plain contents joined by newlines.
        """
        if not self.chat_template:
            return "\n".join(m["content"] for m in messages)
        if self._compiled is None or self._compiled.text != self.chat_template:
            self._compiled = CompiledTemplate(self.chat_template, self.source)
        return self._compiled.render(
            messages,
            add_generation_prompt,
            self.bos_token,
            self.eos_token,
            tools=tools,
            **template_vars,
        )

    def to_str(self) -> str:
        """The ``tokenizer.json`` text (what llguidance's ``LLTokenizer`` takes)."""
        return str(self.hf.to_str())


def _gguf_field(reader: Any, name: str) -> Any:  # noqa: ANN401 - gguf's field values
    field = reader.fields.get(name)
    if field is None:
        return None
    values = [field.parts[i] for i in field.data]
    if field.types and field.types[0].name == "ARRAY":
        if field.types[-1].name == "STRING":
            return [bytes(v).decode("utf-8", errors="replace") for v in values]
        return [v.tolist()[0] for v in values]
    if field.types and field.types[0].name == "STRING":
        return bytes(values[0]).decode("utf-8", errors="replace")
    return values[0].tolist()[0]


def _from_gguf(path: Path) -> Tokenizer:
    import gguf
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HfTokenizer

    reader = gguf.GGUFReader(str(path))
    kind = _gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported"
        )
    tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
    merges_raw: list[str] = _gguf_field(reader, "tokenizer.ggml.merges") or []
    types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    hf = HfTokenizer(models.BPE(vocab, merges, fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return Tokenizer(
        hf,
        _gguf_field(reader, "tokenizer.chat_template"),
        int(eos) if eos is not None else None,
        bos_token=tokens[int(bos)] if bos is not None else "",
        eos_token=tokens[int(eos)] if eos is not None else "",
        source=str(path),
    )


def _from_dir(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HfTokenizer

    hf = HfTokenizer.from_file(str(path / "tokenizer.json"))
    template = None
    eos_id = None
    eos = bos = ""
    cfg_path = path / "tokenizer_config.json"
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        template = cfg.get("chat_template")

        def text(v: Any) -> str:  # noqa: ANN401 - a string or {"content": ...}
            return v.get("content", "") if isinstance(v, dict) else (v or "")

        eos, bos = text(cfg.get("eos_token")), text(cfg.get("bos_token"))
        if eos:
            eos_id = hf.token_to_id(eos)
    return Tokenizer(hf, template, eos_id, bos_token=bos, eos_token=eos, source=str(cfg_path))


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model: a ``.gguf`` file or a directory with ``tokenizer.json``."""
    p = Path(path)
    if p.is_dir():
        if not (p / "tokenizer.json").exists():
            raise FileNotFoundError(f"{p}: no tokenizer.json in the model directory")
        return _from_dir(p)
    if p.suffix == ".gguf":
        return _from_gguf(p)
    raise ValueError(f"{p}: expected a .gguf file or a directory with tokenizer.json")
