"""The parameters of ``/v1/chat/completions`` and ``/v1/completions``, checked.

Only what the engine honours is accepted; anything else is refused by name (a parameter the
server would silently ignore changes what a client gets without telling it). Parameters that
OpenAI clients send with their neutral value (``n: 1``, zero penalties, no log
probabilities) are accepted at that value only; ``top_k`` and ``ignore_eos`` are vLLM's
extensions. Range checks of the sampling values are the
engine's own, made when the request is submitted.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from specdraft.serve.errors import ApiError, bad_request

Kind = Literal["chat", "completion"]

_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "response_format",
    "user",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "ignore_eos",
}
_ALLOWED: dict[Kind, set[str]] = {
    "chat": _COMMON | {"messages", "max_completion_tokens"},
    "completion": _COMMON | {"prompt"},
}
#: Parameters accepted only at these (neutral) values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logprobs": (None, False),
}


@dataclass
class ServeContext:
    """What parsing needs to know of the server."""

    model_name: str
    tokenizer: Any
    max_seq_len: int
    default_max_tokens: int


@dataclass
class Completion:
    """One checked request, ready for the engine."""

    kind: Kind
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    grammar: Any = None
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


def _int(body: dict[str, Any], name: str, minimum: int = 0) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{name} must be an integer, got {json.dumps(v)}", name)
    if v < minimum:
        raise bad_request(f"{name} must be at least {minimum}, got {v}", name)
    return v


def _float(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad_request(f"{name} must be a number, got {json.dumps(v)}", name)
    return float(v)


def _stops(v: object) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    return list(stops)


def _grammar(v: object, tokenizer: Any) -> Any:  # noqa: ANN401 - a specdraft.grammar.Grammar
    if v is None:
        return None
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise bad_request("response_format must be an object with a type", "response_format")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request(
                "response_format json_schema needs json_schema.schema, an object",
                "response_format",
            )
        schema = spec["schema"]
    else:
        raise bad_request(
            f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
            "response_format",
        )
    try:
        from specdraft.grammar import Grammar

        return Grammar.json_schema(tokenizer, schema)
    except ImportError as e:
        raise ApiError(
            400,
            f"response_format needs the grammar extra (pip install 'specdraft[grammar]'): {e}",
            param="response_format",
        ) from e
    except Exception as e:  # noqa: BLE001 - the grammar compiler's refusal of the schema
        raise bad_request(f"response_format: {e}", "response_format") from e


def _content(message: object, i: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"messages[{i}] must be an object with a role", "messages")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"messages[{i}]: only text content parts are supported", "messages"
                )
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string", "messages")
    extra = set(message) - {"role", "content", "name"}
    if extra:
        name = sorted(extra)[0]
        raise bad_request(f"messages[{i}].{name} is not supported", "messages")
    return {"role": message["role"], "content": content}


def _prompt_ids(kind: Kind, body: dict[str, Any], tokenizer: Any) -> list[int]:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages must be a non-empty list", "messages")
        checked = [_content(m, i) for i, m in enumerate(messages)]
        try:
            text = tokenizer.apply_chat_template(checked)
        except Exception as e:  # noqa: BLE001 - the template's refusal of the conversation
            raise bad_request(f"messages: the chat template refused them: {e}", "messages") from e
        return list(tokenizer.encode(text))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return list(prompt)
    raise bad_request(
        "prompt must be a string or a list of token ids (one prompt a request)", "prompt"
    )


def parse(kind: Kind, body: object, ctx: ServeContext) -> Completion:
    """The checked request of ``body``; an :class:`ApiError` says what was wrong."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in sorted(set(body) - _ALLOWED[kind]):
        raise bad_request(
            f"parameter {name!r} is not supported by this server", name, "unsupported_parameter"
        )
    for name, ok in _NEUTRAL.items():
        if body.get(name) not in ok:
            raise bad_request(
                f"{name}={json.dumps(body[name])} is not supported (only {ok[1]!r})",
                name,
                "unsupported_parameter",
            )
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("model is required (a string)", "model")
    if model != ctx.model_name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )
    stream = body.get("stream") or False
    ignore_eos = body.get("ignore_eos") or False
    for name, v in (("stream", stream), ("ignore_eos", ignore_eos)):
        if not isinstance(v, bool):
            raise bad_request(f"{name} must be a boolean", name)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad_request("stream_options supports include_usage only", "stream_options")
        include_usage = bool(options.get("include_usage"))
    max_tokens = _int(body, "max_tokens")
    if kind == "chat":
        completion = _int(body, "max_completion_tokens")
        max_tokens = completion if completion is not None else max_tokens
    top_k = body.get("top_k")
    if top_k == -1:  # vLLM's spelling of "no top-k"
        top_k = 0
    seed = _int(body, "seed")
    prompt = _prompt_ids(kind, body, ctx.tokenizer)
    if max_tokens is None:
        max_tokens = max(min(ctx.default_max_tokens, ctx.max_seq_len - len(prompt)), 1)
    return Completion(
        kind=kind,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0),
        top_k=_int({"top_k": top_k}, "top_k") or 0,
        seed=seed if seed is not None else secrets.randbits(63),
        stop=_stops(body.get("stop")),
        grammar=_grammar(body.get("response_format"), ctx.tokenizer),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=ignore_eos,
    )
