"""Chat templates rendered the way Hugging Face transformers renders them, in jinja2's sandbox.

A chat template is Jinja text that came inside a model file, so it is untrusted: with a
plain ``jinja2.Environment`` a template can walk from any object to Python's internals
(``cycler.__init__.__globals__.os``) and run shell commands. Templates here compile only in
``jinja2.sandbox.ImmutableSandboxedEnvironment`` (what transformers and llama-cpp-python
use), with transformers' options (``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension and the ``{% generation %}`` tag), helpers (``raise_exception``, ``strftime_now``)
and ``tojson`` filter (JSON without HTML escaping), so real templates render exactly as they
do there.

Two layers refuse a template that reaches for internals, and both raise
:class:`UnsafeTemplateError` naming the model file:

- before anything renders, the compiled syntax tree is searched for attribute or item
  names starting with ``_`` and for names starting with ``__`` (``__import__``), so a
  payload hidden in a branch the current conversation does not take is still found;
- while rendering, the sandbox refuses every unsafe attribute and call; jinja2 would turn
  an unsafe attribute into an empty value that fails only when used, here it fails at once.

Rendering time and memory are not bounded: a hostile template can loop or build large
strings, as under transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from specdraft._core import CheckpointError

__all__ = ["CompiledTemplate", "UnsafeTemplateError"]


class UnsafeTemplateError(CheckpointError):
    """A chat template tried to reach Python internals; nothing it asked for ran."""


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates need the plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_ENVIRONMENT: Any = None


def _environment() -> Any:
    """The one sandboxed environment every template compiles in (built on first use)."""
    global _ENVIRONMENT
    if _ENVIRONMENT is not None:
        return _ENVIRONMENT
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, modifies_known_mutable

    class Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            # A mutating method (list.append) keeps jinja2's deferred failure, as under
            # transformers, so a dict key that happens to be called "pop" stays usable in a test.
            if modifies_known_mutable(obj, attribute):
                return super().unsafe_undefined(obj, attribute)
            raise SecurityError(
                f"access to attribute {attribute!r} of a {type(obj).__name__} object"
            )

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``, transformers' training-mask tag.

        For rendering it is its body.
        """

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    _ENVIRONMENT = env
    return env


def _first_unsafe_name(tree: Any) -> tuple[str, int] | None:
    """The first ``_``-prefixed attribute, constant item or ``__`` name in ``tree``."""
    from jinja2 import nodes

    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Name)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
            unsafe = name.startswith("_")
        elif isinstance(node, nodes.Getitem):
            arg = node.arg
            name = arg.value if isinstance(arg, nodes.Const) else None
            unsafe = isinstance(name, str) and name.startswith("_")
        else:
            name = node.name
            unsafe = name.startswith("__")
        if unsafe:
            return str(name), node.lineno
    return None


class CompiledTemplate:
    """A chat template compiled in the sandbox; :meth:`render` it with a conversation."""

    def __init__(self, text: str, source: str) -> None:
        """Compiles ``text``; ``source`` (the model file) is named in every error."""
        import jinja2

        self.text = text
        self.source = source
        env = _environment()
        try:
            tree = env.parse(text)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(
                f"{source}: the chat template does not compile (line {e.lineno}: {e.message})"
            ) from e
        unsafe = _first_unsafe_name(tree)
        if unsafe is not None:
            name, line = unsafe
            raise UnsafeTemplateError(
                f"{source}: the chat template is unsafe: line {line} reaches for {name!r}, "
                "a Python internal; it was not rendered"
            )
        self._template = env.from_string(tree)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        bos_token: str,
        eos_token: str,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The conversation as text, with the variables transformers passes."""
        from jinja2.sandbox import SecurityError

        variables: dict[str, Any] = dict(extra)
        variables.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
        if tools is not None:
            variables["tools"] = tools
        try:
            return str(self._template.render(**variables))
        except SecurityError as e:
            raise UnsafeTemplateError(
                f"{self.source}: the chat template is unsafe: {e}; rendering stopped there"
            ) from e
