"""The server's parameter checks and its text filters, without a model: what each OpenAI
parameter becomes, which are refused by name and with what status, and stop strings cut
across pushes."""

from __future__ import annotations

import pytest
from specdraft.serve.errors import ApiError
from specdraft.serve.params import ServeContext, parse
from specdraft.serve.text import StopFilter, TextDecoder


class Chars:
    """A tokenizer with one id a character (its code point)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


CTX = ServeContext("m", Chars(), max_seq_len=64, default_max_tokens=32)


def refused(kind, body, status=400):
    with pytest.raises(ApiError) as e:
        parse(kind, body, CTX)
    assert e.value.status == status
    return e.value


def test_parameters_become_the_engine_request():
    p = parse(
        "chat",
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_k": -1,
            "seed": 3,
            "stop": "x",
            "n": 1,
            "presence_penalty": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        CTX,
    )
    assert p.prompt == Chars().encode("<user>hi<assistant>")
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop) == (7, 0.0, 0, 3, ["x"])
    assert p.stream and p.include_usage and p.grammar is None
    assert parse("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}],
                          "max_completion_tokens": 0}, CTX).max_tokens == 0  # fmt: skip
    # Without max_tokens: the server's default, within the context left after the prompt.
    p = parse("completion", {"model": "m", "prompt": "x" * 40}, CTX)
    assert (p.max_tokens, p.temperature) == (24, 1.0)
    assert parse("completion", {"model": "m", "prompt": [[1, 2]]}, CTX).prompt == [1, 2]
    assert parse("completion", {"model": "m", "prompt": ["ab"]}, CTX).prompt == [97, 98]


def test_each_refusal_names_its_parameter():
    ok = {"model": "m", "prompt": "hi"}
    assert refused("completion", {**ok, "logit_bias": {}}).param == "logit_bias"
    assert refused("completion", {**ok, "messages": []}).code == "unsupported_parameter"
    assert refused("completion", {**ok, "n": 3}).param == "n"
    assert refused("completion", {**ok, "frequency_penalty": 0.5}).param == "frequency_penalty"
    assert refused("completion", {**ok, "max_tokens": -1}).param == "max_tokens"
    assert refused("completion", {**ok, "max_tokens": "9"}).param == "max_tokens"
    assert refused("completion", {**ok, "temperature": "hot"}).param == "temperature"
    assert refused("completion", {**ok, "stream_options": {"include_usage": True}}).param == (
        "stream_options"
    )
    assert refused("completion", {**ok, "stop": [""]}).param == "stop"
    assert refused("completion", {**ok, "prompt": ["a", "b"]}).param == "prompt"
    assert refused("completion", {"prompt": "hi"}).param == "model"
    assert refused("completion", {**ok, "model": "other"}, 404).code == "model_not_found"
    assert refused("completion", [ok]).param is None
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert refused("chat", {"model": "m", "messages": [image]}).param == "messages"
    assert refused("chat", {"model": "m", "messages": []}).param == "messages"
    fmt = {"type": "json_schema", "json_schema": {"name": "x"}}
    assert refused("chat", {"model": "m", "messages": [{"role": "user", "content": "a"}],
                            "response_format": fmt}).param == "response_format"  # fmt: skip


def test_stop_strings_cut_across_pushes_and_hold_back_only_what_could_begin_one():
    f = StopFilter(["END", "xy"])
    assert f.push("abcE") == "ab"  # "cE" could be the start of "END" (held: 2 characters)
    assert f.push("N") == "c"
    assert f.push("Dtail") == ""
    assert f.stopped and f.push("more") == ""
    f = StopFilter(["END"])
    assert f.push("abE") + f.push("Q", final=True) == "abEQ"
    assert not f.stopped
    f = StopFilter([])
    assert f.push("abc") == "abc"


def test_text_decoder_deltas_add_up_to_the_whole_decoding():
    class Bytes:
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    d = TextDecoder(Bytes())
    data = "aé€😀b".encode()
    parts = [d.push([b]) for b in data[:-1]] + [d.push(data[-1:], final=True)]
    assert "".join(parts) == "aé€😀b"
    assert all("\ufffd" not in p for p in parts)
