"""Tokenizers for the target models, with their chat templates.

A tokenizer is rebuilt from a GGUF file's metadata, or read from a Hugging Face
``tokenizer.json``. :func:`load_tokenizer` is the one way to get a model's tokenizer;
``specdraft.load_model`` attaches the same one to the model it loads (``model.tokenizer``).

SmolLM2 (and the other llama-family GGUFs with ``tokenizer.ggml.model == "gpt2"``) use a
byte-level BPE: ``tokenizers.models.BPE(vocab, merges)`` with merges split on the first
space, a ``ByteLevel`` pre-tokenizer without a prefix space and a ``ByteLevel`` decoder.
Control tokens (GGUF token type 3, e.g. ``<|im_start|>``) become special tokens so the chat
template's markers encode to one id each. The chat template is the Jinja text in
``tokenizer.chat_template``, rendered with ``jinja2``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "load_tokenizer"]


def _config_error(message: str) -> Exception:
    from specdraft import ConfigError

    return ConfigError(message)


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
    ) -> None:
        self.hf = hf
        self.chat_template = chat_template
        self.eos_token_id = eos_token_id
        self.bos_token = bos_token
        self.eos_token = eos_token

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
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """``messages`` (``{"role", "content"}`` dicts) rendered with the model's template.

        Without a template, the plain contents joined by newlines.
        """
        if not self.chat_template:
            return "\n".join(m["content"] for m in messages)
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def to_str(self) -> str:
        """The ``tokenizer.json`` text (what llguidance's ``LLTokenizer`` takes)."""
        return str(self.hf.to_str())


def _from_gguf(path: Path) -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HfTokenizer

    from specdraft._core import gguf_metadata

    keys = [
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.chat_template",
    ]
    meta = gguf_metadata(str(path), keys)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2" or "tokenizer.ggml.tokens" not in meta:
        raise _config_error(
            f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', is)"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    hf = HfTokenizer(models.BPE(vocab, merges, fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return Tokenizer(
        hf,
        meta.get("tokenizer.chat_template"),
        int(eos) if eos is not None else None,
        bos_token=tokens[int(bos)] if bos is not None else "",
        eos_token=tokens[int(eos)] if eos is not None else "",
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
    return Tokenizer(hf, template, eos_id, bos_token=bos, eos_token=eos)


def load_tokenizer(path_or_name: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model, with its chat template.

    ``path_or_name`` is a ``.gguf`` file, a folder with ``tokenizer.json``, or a known model
    name (``"smollm2"``, fetched on first use). Raises ``ConfigError`` when the model
    carries no tokenizer specdraft can read, saying why.
    """
    from specdraft.models import resolve_model

    p = resolve_model(path_or_name)
    if p.is_dir():
        if not (p / "tokenizer.json").exists():
            raise _config_error(f"{p}: no tokenizer.json in the model folder")
        return _from_dir(p)
    if p.suffix == ".gguf":
        return _from_gguf(p)
    raise _config_error(f"{p}: expected a .gguf file or a folder with tokenizer.json")


def _tokenizer_or_none(path: str | os.PathLike[str]) -> Tokenizer | None:
    """:func:`load_tokenizer`, or None when the model carries none specdraft can read.

    This is what ``load_model`` attaches as ``model.tokenizer``.
    """
    from specdraft import ConfigError

    try:
        return load_tokenizer(path)
    except ConfigError:
        return None
