"""Chat templates render in jinja2's sandbox: real templates give exactly the text their
model defines (expected strings written out by hand from reading each template), identical
to the plain environment used before; templates that reach for Python internals raise an
error naming the model file, and the command they carry never runs."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import chat_templates as T
import jinja2
import pytest
import specdraft
from specdraft.chat_template import UnsafeTemplateError
from specdraft.tokenizer import Tokenizer, load_tokenizer

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
NO_SYSTEM = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "add", "description": "x < y & y > z"}}

CHATML = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n"
    "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
LLAMA_TURNS = (
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
LLAMA_BOS, DEEPSEEK_BOS = "<|begin_of_text|>", "<｜begin▁of▁sentence｜>"

# (name, template, messages, bos, extra template variables, expected text)
CASES = [
    ("smollm2", T.SMOLLM2, CHAT, "", {}, CHATML),
    (
        "smollm2-default-system",
        T.SMOLLM2,
        NO_SYSTEM,
        "",
        {},
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ),
    ("qwen2", T.QWEN2, CHAT, "", {}, CHATML),
    (
        "qwen2-default-system",
        T.QWEN2,
        NO_SYSTEM,
        "",
        {},
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ),
    ("qwen2.5", T.QWEN2_5, CHAT, "", {}, CHATML),
    (
        "qwen2.5-default-system",
        T.QWEN2_5,
        NO_SYSTEM,
        "",
        {},
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        "qwen2.5-tool-call",
        T.QWEN2_5,
        [
            {"role": "user", "content": "What is 2+2?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 2}}}],
            },
            {"role": "tool", "content": "4"},
        ],
        "",
        {},
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    ("mimo", T.MIMO, CHAT, "", {}, CHATML),
    (
        "mimo-default-system",
        T.MIMO,
        NO_SYSTEM,
        "",
        {},
        "<|im_start|>system\nYou are MiMo, an AI assistant developed by Xiaomi.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ),
    ("qwen3", T.QWEN3, CHAT, "", {}, CHATML),
    (
        "qwen3-no-thinking",
        T.QWEN3,
        CHAT,
        "",
        {"enable_thinking": False},
        CHATML + "<think>\n\n</think>\n\n",
    ),
    (
        "qwen3-reasoning-kept-after-the-last-query",
        T.QWEN3,
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        ],
        "",
        {},
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    (
        "llama3",
        T.LLAMA3,
        CHAT,
        LLAMA_BOS,
        {},
        LLAMA_BOS
        + "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        + LLAMA_TURNS,
    ),
    (
        "llama3.2",
        T.LLAMA3_2,
        CHAT,
        LLAMA_BOS,
        {"date_string": "26 Jul 2024"},
        LLAMA_BOS + "<|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are terse.<|eot_id|>" + LLAMA_TURNS,
    ),
    (
        "deepseek-v3",
        T.DEEPSEEK_V3,
        CHAT,
        DEEPSEEK_BOS,
        {},
        DEEPSEEK_BOS + "You are terse.<｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>"
        "<｜User｜>And 3+3?<｜Assistant｜>",
    ),
    (
        "glm-4.5",
        T.GLM4_5,
        CHAT,
        "",
        {},
        "[gMASK]<sop><|system|>\nYou are terse.<|user|>\nWhat is 2+2?"
        "<|assistant|>\n<think></think>\n4<|user|>\nAnd 3+3?<|assistant|>",
    ),
    (
        "glm-4.5-no-thinking",
        T.GLM4_5,
        CHAT,
        "",
        {"enable_thinking": False},
        "[gMASK]<sop><|system|>\nYou are terse.<|user|>\nWhat is 2+2?/nothink"
        "<|assistant|>\n<think></think>\n4<|user|>\nAnd 3+3?/nothink<|assistant|>\n<think></think>",
    ),
]


def _tokenizer(template: str, bos: str = "", source: str | None = None) -> Tokenizer:
    return Tokenizer(None, template, None, bos_token=bos, eos_token="</s>", source=source)


def _plain_render(template: str, messages: list, bos: str, extra: dict) -> str:
    """What the unsandboxed renderer specdraft used before gave for the same call."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token="</s>", **extra
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_real_templates_render_what_they_define(case: tuple) -> None:
    _, template, messages, bos, extra, expected = case
    assert _tokenizer(template, bos).apply_chat_template(messages, **extra) == expected


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_real_templates_render_byte_identically_to_the_plain_environment(case: tuple) -> None:
    _, template, messages, bos, extra, _ = case
    rendered = _tokenizer(template, bos).apply_chat_template(messages, **extra)
    assert rendered.encode() == _plain_render(template, messages, bos, extra).encode()


def test_the_default_models_template_is_smollm2s() -> None:
    from specdraft.models import fetch_default_model

    tok = load_tokenizer(fetch_default_model())
    assert tok.chat_template == T.SMOLLM2
    assert tok.apply_chat_template(CHAT) == CHATML


def test_tojson_keeps_html_characters_as_transformers_does() -> None:
    # jinja2's own filter would write \u003c for "<" and \u0026 for "&".
    rendered = _tokenizer(T.QWEN2_5).apply_chat_template(CHAT[:2], tools=[TOOL])
    assert rendered == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        "<tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "description": "x < y & y > z"}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_2_puts_indented_tools_in_the_first_user_message() -> None:
    tok = _tokenizer(T.LLAMA3_2, LLAMA_BOS)
    rendered = tok.apply_chat_template(CHAT[:2], tools=[TOOL], date_string="26 Jul 2024")
    tool_json = (
        '{\n    "type": "function",\n    "function": {\n        "name": "add",\n'
        '        "description": "x < y & y > z"\n    }\n}'
    )
    assert rendered == (
        LLAMA_BOS + "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "You are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}.Do not use variables.\n\n" + tool_json + "\n\n"
        "What is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_strftime_now_gives_todays_date() -> None:
    before = datetime.now()
    rendered = _tokenizer(T.LLAMA3_2, LLAMA_BOS).apply_chat_template(CHAT)
    after = datetime.now()
    # The day may turn while rendering: either date is right.
    dates = {before.strftime("%d %b %Y"), after.strftime("%d %b %Y")}
    assert any(f"Today Date: {d}\n\n" in rendered for d in dates), rendered


def test_raise_exception_raises_the_templates_message() -> None:
    tok = _tokenizer(T.LLAMA3_2, LLAMA_BOS)
    with pytest.raises(jinja2.TemplateError, match="no first user message"):
        tok.apply_chat_template(CHAT[:1], tools=[TOOL], date_string="26 Jul 2024")


def test_transformers_tags_and_loop_controls_render() -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    assert _tokenizer(template).apply_chat_template(CHAT) == "[You are terse.][What is 2+2?]"


def test_a_template_error_names_the_model_file() -> None:
    tok = _tokenizer("{% for m in messages %}", source="/models/broken.gguf")
    with pytest.raises(specdraft.CheckpointError, match=r"/models/broken\.gguf.*line 1"):
        tok.apply_chat_template(CHAT)


# Payloads that would create MARKER if they ran. Those marked "runtime" hide the internal
# name from the syntax tree (built at render time), so the sandbox itself must refuse them.
PAYLOADS = [
    ("cycler-globals-os", "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}"),
    ("joiner-globals-os", "{{ joiner.__init__.__globals__.os.popen('touch MARKER').read() }}"),
    (
        "namespace-globals-os",
        "{{ namespace.__init__.__globals__.os.popen('touch MARKER').read() }}",
    ),
    ("lipsum-globals-os", "{{ lipsum.__globals__['os'].popen('touch MARKER').read() }}"),
    (
        "subclasses-subprocess",
        "{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
        "{% if c.__name__ == 'Popen' %}{{ c(['touch', 'MARKER']).wait() }}{% endif %}{% endfor %}",
    ),
    ("import", "{{ __import__('os').system('touch MARKER') }}"),
    ("builtins-open", "{{ lipsum.__globals__.__builtins__.open('MARKER', 'w').write('x') }}"),
    (
        "template-self-globals",
        "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch MARKER') }}",
    ),
    (
        "helper-globals",
        "{{ strftime_now.__globals__.__builtins__.open('MARKER', 'w').write('x') }}",
    ),
    (
        "hidden-in-an-untaken-branch",
        "{% if messages|length > 99 %}"
        "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}{% endif %}ok",
    ),
    (
        "runtime-attr-filter",
        "{% set u = '_' * 2 %}"
        "{{ (cycler|attr(u ~ 'init' ~ u)|attr(u ~ 'globals' ~ u))['os']"
        ".popen('touch MARKER').read() }}",
    ),
    (
        "runtime-item-lookup",
        "{% set u = '_' * 2 %}{% set g = cycler[u ~ 'init' ~ u][u ~ 'globals' ~ u] %}"
        "{{ g['os'].popen('touch MARKER').read() }}",
    ),
    (
        "runtime-format-string",
        "{% set u = '_' * 2 %}"
        "{{ ('{0.' ~ u ~ 'init' ~ u ~ '.' ~ u ~ 'globals' ~ u ~ '[os]}').format(cycler) }}"
        "{{ lipsum|attr(u ~ 'globals' ~ u) }}",
    ),
]


@pytest.mark.parametrize("payload", [p[1] for p in PAYLOADS], ids=[p[0] for p in PAYLOADS])
def test_a_template_reaching_python_internals_is_refused_and_runs_nothing(
    payload: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    template = payload.replace("MARKER", str(marker))
    tok = _tokenizer(template, source="/models/evil.gguf")
    with pytest.raises(UnsafeTemplateError) as info:
        tok.apply_chat_template(CHAT)
    message = str(info.value)
    assert "unsafe" in message and "/models/evil.gguf" in message, message
    assert isinstance(info.value, specdraft.CheckpointError)
    assert isinstance(info.value, specdraft.UnsafeTemplateError)
    assert not marker.exists()


def test_the_unsandboxed_renderer_would_have_run_the_payload(tmp_path: Path) -> None:
    # The marker check above is only meaningful if the payload does run without a sandbox.
    marker = tmp_path / "pwned"
    template = PAYLOADS[0][1].replace("MARKER", str(marker))
    _plain_render(template, CHAT, "", {})
    assert marker.exists()


def _write_tokenizer_gguf(path: Path, template: str) -> None:
    """A GGUF file holding only a two-token tokenizer and a chat template."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "<|im_end|>"])
    w.add_token_types([1, 3])
    w.add_token_merges([])
    w.add_eos_token_id(1)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_unsafe_template_in_a_gguf_file_names_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.gguf"
    _write_tokenizer_gguf(path, PAYLOADS[0][1].replace("MARKER", str(marker)))
    tok = load_tokenizer(path)
    with pytest.raises(UnsafeTemplateError, match=str(path)):
        tok.apply_chat_template(CHAT)
    assert not marker.exists()


def test_an_unsafe_template_in_tokenizer_config_names_the_file(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models

    marker = tmp_path / "pwned"
    HfTokenizer(models.BPE({"a": 0}, [])).save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": PAYLOADS[0][1].replace("MARKER", str(marker)), "eos_token": "a"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    with pytest.raises(UnsafeTemplateError, match=str(tmp_path / "tokenizer_config.json")):
        tok.apply_chat_template(CHAT)
    assert not marker.exists()
