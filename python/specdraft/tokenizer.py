"""Tokenizers for the target models, with their chat templates.

A tokenizer is rebuilt from a GGUF file's metadata, or read from a Hugging Face
``tokenizer.json``. :func:`load_tokenizer` is the one way to get a model's tokenizer;
``specdraft.load_model`` attaches the same one to the model it loads (``model.tokenizer``).
Both are untrusted input: the GGUF header is read by specdraft's bounded
parser and every field is checked before use, and a bad value is a ``CheckpointError``
naming the file, the field and the value.

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

from specdraft._core import CheckpointError
from specdraft.chat_template import CompiledTemplate

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


#: The GGUF keys a tokenizer is built from.
_GGUF_KEYS = [
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.chat_template",
]
#: The most tokens a vocabulary may have (the model loader's limit too).
_MAX_VOCAB = 1 << 26


def _shown(value: Any) -> str:  # noqa: ANN401 - any metadata value
    """``value`` for a message, cut short: a hostile file's values can be huge."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Fields:
    """The tokenizer's GGUF metadata, each value checked on access.

    A bad one is a ``CheckpointError`` naming the file, the key and the value.
    """

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.meta = path, meta

    def bad(self, key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {key} is {_shown(self.meta.get(key))}; {what}")

    def string_list(self, key: str) -> list[str]:
        value = self.meta.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.bad(key, "expected a list of strings")
        return value

    def int_list(self, key: str, length: int) -> list[int]:
        value = self.meta.get(key)
        if value is None:
            return [0] * length
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            raise self.bad(key, "expected a list of integers")
        if len(value) != length:
            raise self.bad(key, f"expected {length} entries, one per token, found {len(value)}")
        return value

    def token_id(self, key: str, vocab: int) -> int | None:
        value = self.meta.get(key)
        if value is not None and not (type(value) is int and 0 <= value < vocab):
            raise self.bad(key, f"expected a token id below the vocabulary size {vocab}")
        return value


def _from_gguf(path: Path) -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HfTokenizer

    from specdraft._core import gguf_metadata

    # specdraft's own GGUF parser reads the header: it bounds every count and length and the
    # memory the header takes, which the gguf package's reader does not.
    fields = _Fields(path, gguf_metadata(str(path), _GGUF_KEYS))
    kind = fields.meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise _config_error(
            f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', is)"
        )
    tokens = fields.string_list("tokenizer.ggml.tokens")
    if not 0 < len(tokens) <= _MAX_VOCAB:
        raise fields.bad("tokenizer.ggml.tokens", f"expected 1 to {_MAX_VOCAB} tokens")
    merges_raw = fields.string_list("tokenizer.ggml.merges")
    types = fields.int_list("tokenizer.ggml.token_type", len(tokens))
    eos = fields.token_id("tokenizer.ggml.eos_token_id", len(tokens))
    bos = fields.token_id("tokenizer.ggml.bos_token_id", len(tokens))
    template = fields.meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise fields.bad("tokenizer.chat_template", "expected a string")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, m in enumerate(merges_raw):
        pair = m.split(" ", 1)
        if len(pair) != 2:
            raise CheckpointError(
                f"{path}: tokenizer.ggml.merges[{i}] is {_shown(m)}; expected two tokens "
                "separated by a space"
            )
        merges.append((pair[0], pair[1]))
    try:
        hf = HfTokenizer(models.BPE(vocab, merges, fuse_unk=False))
    except Exception as e:
        raise CheckpointError(f"{path}: the BPE vocabulary and merges do not fit: {e}") from e
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t == _CONTROL]
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(
        hf,
        template,
        eos,
        bos_token=tokens[bos] if bos is not None else "",
        eos_token=tokens[eos] if eos is not None else "",
        source=str(path),
    )


def _from_dir(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HfTokenizer

    file = path / "tokenizer.json"
    try:
        hf = HfTokenizer.from_file(str(file))
    except Exception as e:
        raise CheckpointError(f"{file}: not a tokenizer the tokenizers library reads: {e}") from e
    # specdraft never pads or truncates a prompt; a file's padding to a huge fixed length
    # would otherwise make every encode allocate that much.
    hf.no_padding()
    hf.no_truncation()
    template = None
    eos_id = None
    eos = bos = ""
    cfg_path = path / "tokenizer_config.json"
    if cfg_path.exists():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{cfg_path}: not JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{cfg_path}: the top level is {_shown(cfg)}, not an object")
        template = _config_template(cfg_path, cfg.get("chat_template"))

        def text(key: str) -> str:
            v = cfg.get(key)
            v = v.get("content", "") if isinstance(v, dict) else v
            if v is not None and not isinstance(v, str):
                raise CheckpointError(f"{cfg_path}: {key} is {_shown(v)}; expected a string")
            return v or ""

        eos, bos = text("eos_token"), text("bos_token")
        if eos:
            eos_id = hf.token_to_id(eos)
    return Tokenizer(hf, template, eos_id, bos_token=bos, eos_token=eos, source=str(cfg_path))


def _config_template(cfg_path: Path, value: Any) -> str | None:  # noqa: ANN401 - JSON
    """The template of a ``chat_template`` entry.

    The entry is one template, or transformers' list of named ones (``default`` is used).
    """
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise CheckpointError(
            f"{cfg_path}: chat_template is {_shown(value)}; expected a string or a list of "
            "named templates with a 'default'"
        )
    return value


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
