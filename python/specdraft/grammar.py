"""Grammar-constrained generation backed by llguidance.

A :class:`Grammar` (JSON schema, regular expression or Lark) is compiled once for a
tokenizer; :meth:`Grammar.matcher` gives each sequence its own :class:`Matcher`, which the
engine asks for the mask of allowed next tokens (``fill_mask``) and advances with every
emitted token (``advance``). The mask format is llguidance's, which is exactly the
protocol's ``grammar_bitmask``: int32 words, token ``t`` allowed when bit ``t % 32`` of
word ``t // 32`` is set. Pass a grammar to ``SpecEngine.generate(..., grammar=g)``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = ["Grammar", "Matcher"]


def _llguidance() -> Any:  # noqa: ANN401 - the module
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - registers the numpy helpers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "grammar-constrained generation needs the llguidance package: pip install llguidance"
        ) from e
    return llguidance


class Matcher:
    """One sequence's grammar state (an ``llguidance.LLMatcher``)."""

    def __init__(self, ll_matcher: Any, n_vocab: int) -> None:  # noqa: ANN401
        self._m = ll_matcher
        self._n_vocab = n_vocab
        self._scratch = _llguidance().numpy.allocate_token_bitmask(1, n_vocab)

    def fill_mask(self, mask: np.ndarray) -> None:
        """Sets the bits of the tokens allowed next in ``mask`` (int32 words, zeroed)."""
        ll = _llguidance()
        self._scratch[:] = 0
        ll.numpy.fill_next_token_bitmask(self._m, self._scratch, 0)
        err = self._m.get_error()
        if err:
            raise ValueError(f"grammar error: {err}")
        k = min(len(mask), self._scratch.shape[1])
        mask[:k] = self._scratch[0, :k]

    def advance(self, token: int) -> None:
        """Consumes ``token``; raises ``ValueError`` if the grammar does not allow it."""
        if not self._m.consume_token(int(token)):
            raise ValueError(
                f"grammar refused token {token}: {self._m.get_error() or 'not allowed'}"
            )

    def is_finished(self) -> bool:
        """Whether the grammar has ended (after its stop token)."""
        return bool(self._m.is_stopped())

    def allowed(self) -> list[int]:
        """The token ids allowed next (for inspection and tests)."""
        mask = np.zeros(self._scratch.shape[1], dtype=np.int32)
        self.fill_mask(mask)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        return [int(t) for t in np.flatnonzero(bits[: self._n_vocab])]


class Grammar:
    """A compiled grammar for one tokenizer; make one :class:`Matcher` per sequence.

    ``tokenizer`` is a :class:`specdraft.tokenizer.Tokenizer`, a ``tokenizers.Tokenizer``
    or the text of a ``tokenizer.json``. ``kind`` is ``"json_schema"``, ``"regex"`` or
    ``"lark"``.
    """

    def __init__(self, tokenizer: Any, kind: str, text: str) -> None:  # noqa: ANN401
        ll = _llguidance()
        if kind not in ("json_schema", "regex", "lark"):
            raise ValueError(f"grammar kind {kind!r}: expected 'json_schema', 'regex' or 'lark'")
        source = tokenizer if isinstance(tokenizer, str) else tokenizer.to_str()
        eos = getattr(tokenizer, "eos_token_id", None)
        self._lltok = (
            ll.LLTokenizer(source, eos_token=eos) if eos is not None else ll.LLTokenizer(source)
        )
        self._grammar = ll.grammar_from(kind, text)
        message = ll.LLMatcher.validate_grammar(self._grammar, self._lltok)
        if message:
            raise ValueError(f"invalid {kind} grammar: {message}")
        self.kind = kind
        self.text = text

    @classmethod
    def json_schema(cls, tokenizer: Any, schema: dict[str, Any] | str) -> Grammar:  # noqa: ANN401
        """Output that is JSON valid against ``schema`` (a dict or its JSON text)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls(tokenizer, "json_schema", text)

    @classmethod
    def regex(cls, tokenizer: Any, pattern: str) -> Grammar:  # noqa: ANN401
        """Output matching the regular expression ``pattern``."""
        return cls(tokenizer, "regex", pattern)

    @classmethod
    def lark(cls, tokenizer: Any, text: str) -> Grammar:  # noqa: ANN401
        """Output of the Lark grammar ``text``."""
        return cls(tokenizer, "lark", text)

    @property
    def vocab_size(self) -> int:
        """Tokens the grammar's tokenizer knows."""
        return int(self._lltok.vocab_size)

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar."""
        ll = _llguidance()
        m = ll.LLMatcher(self._lltok, self._grammar)
        err = m.get_error()
        if err:
            raise ValueError(f"grammar error: {err}")
        return Matcher(m, self.vocab_size)
