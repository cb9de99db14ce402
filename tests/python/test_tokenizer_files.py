"""Tokenizers from untrusted files: the GGUF metadata is read by specdraft's bounded parser
and every field is checked (a bad one is a ``CheckpointError`` naming the file, the key and
the value); ``tokenizer.json`` and ``tokenizer_config.json`` get the same treatment; every
input a fuzzer found that once broke the GGUF tokenizer loader is replayed."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import specdraft
from specdraft.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab"]


def _write(path: Path, **fields: object) -> Path:
    """A GGUF file holding a six-token tokenizer; ``fields`` replace its keys by name
    (``__`` for ``.``; ``None`` drops a key; a ``(value, type)`` pair sets the GGUF type)."""
    w = gguf.GGUFWriter(str(path), "llama")
    values = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [3, 3, 3, 1, 1, 1],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    values.update({k.replace("__", "."): v for k, v in fields.items()})
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, tuple):  # (value, explicit GGUF type)
            w.add_key_value(key, value[0], value[1])
        elif isinstance(value, list):
            sub = gguf.GGUFValueType.get_type(value[0]) if value else gguf.GGUFValueType.STRING
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_valid_file_gives_the_tokenizer_it_describes(tmp_path: Path) -> None:
    tok = load_tokenizer(_write(tmp_path / "t.gguf"))
    assert tok.encode("ab<|im_end|>") == [5, 2]
    assert (tok.eos_token_id, tok.eos_token, tok.bos_token) == (2, "<|im_end|>", "<|im_start|>")


def test_the_default_models_tokenizer_matches_an_independent_reader() -> None:
    import smollm2_reference as ref
    from specdraft.models import fetch_default_model

    path = fetch_default_model()
    reference = ref.tokenizer_from_gguf(gguf.GGUFReader(str(path)))
    tok = load_tokenizer(path)
    text = "The quick brown fox, naïvely: 12345 — done."
    assert tok.encode(text) == reference.encode(text).ids
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert (tok.eos_token_id, tok.eos_token) == (2, "<|im_end|>")


BAD_FIELDS = [
    ("tokens-not-strings", {"tokenizer__ggml__tokens": [1, 2, 3]}, "list of strings"),
    ("no-tokens", {"tokenizer__ggml__tokens": None}, "tokenizer.ggml.tokens"),
    ("types-length", {"tokenizer__ggml__token_type": [1, 1]}, "expected 6 entries"),
    ("eos-range", {"tokenizer__ggml__eos_token_id": 6}, "tokenizer.ggml.eos_token_id is 6"),
    (
        "bos-range",
        {"tokenizer__ggml__bos_token_id": (1 << 40, gguf.GGUFValueType.UINT64)},
        "1099511627776",
    ),
    ("merge-no-space", {"tokenizer__ggml__merges": ["ab"]}, "merges[0] is 'ab'"),
    ("merge-unknown", {"tokenizer__ggml__merges": ["a zz"]}, "do not fit"),
    ("template-type", {"tokenizer__chat_template": 7}, "tokenizer.chat_template is 7"),
]


@pytest.mark.parametrize(
    "fields,message", [b[1:] for b in BAD_FIELDS], ids=[b[0] for b in BAD_FIELDS]
)
def test_a_bad_field_is_an_error_naming_file_key_and_value(
    tmp_path: Path, fields: dict, message: str
) -> None:
    path = _write(tmp_path / "bad.gguf", **fields)
    with pytest.raises(specdraft.CheckpointError) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value) and message in str(info.value), str(info.value)


def test_a_tokenizer_kind_it_cannot_build_is_a_config_error(tmp_path: Path) -> None:
    # A SentencePiece ('llama') vocabulary is a valid file that specdraft cannot tokenize:
    # ConfigError (the model loads without a tokenizer), not a broken-file CheckpointError.
    path = _write(tmp_path / "spm.gguf", tokenizer__ggml__model="llama")
    with pytest.raises(specdraft.ConfigError) as info:
        load_tokenizer(path)
    assert not isinstance(info.value, specdraft.CheckpointError)
    assert str(path) in str(info.value) and "'llama'" in str(info.value), str(info.value)


def _header(n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


BOMBS = [
    (
        "tokens-count-2^60",
        _header(1) + _key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 1 << 60) + bytes(64),
        'the length of array "tokenizer.ggml.tokens" is 1152921504606846976',
    ),
    (
        "template-length-2^60",
        _header(1) + _key("tokenizer.chat_template") + struct.pack("<IQ", 8, 1 << 60) + bytes(64),
        "1152921504606846976",
    ),
    (
        "token-types-of-16MiB",
        _header(1)
        + _key("tokenizer.ggml.token_type")
        + struct.pack("<IIQ", 9, 0, 16 << 20)
        + bytes(16 << 20),
        "size in memory",
    ),
]


@pytest.mark.parametrize("data,message", [b[1:] for b in BOMBS], ids=[b[0] for b in BOMBS])
def test_gguf_bombs_are_refused_quickly_in_bounded_memory(
    tmp_path: Path, data: bytes, message: str
) -> None:
    # In a fresh process, so its peak resident memory measures this load alone.
    path = tmp_path / "bomb.gguf"
    path.write_bytes(data)
    script = textwrap.dedent(
        f"""
        import resource, time, specdraft
        from specdraft.tokenizer import load_tokenizer
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        try:
            load_tokenizer({str(path)!r})
        except specdraft.CheckpointError as e:
            took = time.perf_counter() - start
            grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
            print(took, grew, str(e), sep="\\n")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    took, grew_kib, error = out.stdout.split("\n", 2)
    assert message in error and str(path) in error, error
    assert float(took) < 1.0, f"{took} s"
    assert int(grew_kib) < 64 << 10, f"peak memory grew by {grew_kib} KiB"


def test_tokenizer_json_padding_and_truncation_are_ignored(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models

    hf = HfTokenizer(models.BPE({"a": 0, "b": 1}, []))
    # A file may ask every encoding to be padded to any length (2^40 would take terabytes).
    hf.enable_padding(length=1_000_000)
    hf.enable_truncation(max_length=1)
    hf.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).encode("abab") == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "config,message",
    [
        ("{", "not JSON"),
        ("[1, 2]", "not an object"),
        ('{"chat_template": 5}', "chat_template is 5"),
        ('{"eos_token": 5}', "eos_token is 5"),
        ('{"chat_template": [{"name": "tool_use", "template": "x"}]}', None),
    ],
)
def test_a_bad_tokenizer_config_is_an_error_naming_the_file(
    tmp_path: Path, config: str, message: str | None
) -> None:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models

    HfTokenizer(models.BPE({"a": 0}, [])).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(config)
    if message is None:  # a list of named templates without "default": no template
        assert load_tokenizer(tmp_path).chat_template is None
        return
    with pytest.raises(specdraft.CheckpointError) as info:
        load_tokenizer(tmp_path)
    text = str(info.value)
    assert str(tmp_path / "tokenizer_config.json") in text and message in text, text


def test_named_templates_pick_the_default(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models

    HfTokenizer(models.BPE({"a": 0}, [])).save(str(tmp_path / "tokenizer.json"))
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_tokenizer(tmp_path).apply_chat_template([]) == "D"


#: What each input under ``tests/fuzz_inputs/tokenizer_gguf/`` must come to: refused with
#: that error class and a message holding that text (and the file's path), or loaded (None).
#: The hand-made inputs are written by ``fuzz/regression_inputs.py``.
TOKENIZER_REGRESSIONS: dict[str, tuple[type[Exception], str] | None] = {
    "tokens-count-2^60": (
        specdraft.CheckpointError,
        'the length of array "tokenizer.ggml.tokens" is 1152921504606846976, out of range',
    ),
    "token-string-length-2^60": (
        specdraft.CheckpointError,
        'the length of the value of "tokenizer.ggml.tokens" at byte 113 is 1152921504606846976',
    ),
    "template-length-2^60": (
        specdraft.CheckpointError,
        'the length of the value of "tokenizer.chat_template" at byte 450 is 1152921504606846976',
    ),
    "merges-of-type-u32": (
        specdraft.CheckpointError,
        "tokenizer.ggml.merges is [1, 2]; expected a list of strings",
    ),
    "merges-of-type-string": (
        specdraft.CheckpointError,
        "tokenizer.ggml.merges is 'a b'; expected a list of strings",
    ),
    "merge-without-a-space": (
        specdraft.CheckpointError,
        "tokenizer.ggml.merges[0] is 'ab'; expected two tokens separated by a space",
    ),
    "merge-of-unknown-tokens": (
        specdraft.CheckpointError,
        "the BPE vocabulary and merges do not fit",
    ),
    "tokens-of-type-u32": (
        specdraft.CheckpointError,
        "tokenizer.ggml.tokens is [1, 2, 3]; expected a list of strings",
    ),
    "no-tokens": (specdraft.CheckpointError, "tokenizer.ggml.tokens is []; expected 1 to"),
    "token-types-2-for-6-tokens": (
        specdraft.CheckpointError,
        "tokenizer.ggml.token_type is [1, 1]; expected 6 entries, one per token, found 2",
    ),
    "eos-token-id-2^40": (
        specdraft.CheckpointError,
        "tokenizer.ggml.eos_token_id is 1099511627776; expected a token id below",
    ),
    "template-of-type-u32": (
        specdraft.CheckpointError,
        "tokenizer.chat_template is 7; expected a string",
    ),
    "tokenizer-model-llama": (specdraft.ConfigError, "tokenizer model 'llama' is not supported"),
    "header-ends-after-the-version": (
        specdraft.CheckpointError,
        "the file ends at byte 8 while reading the tensor count",
    ),
    "file-ends-inside-the-tokens": (
        specdraft.CheckpointError,
        'the length of the value of "tokenizer.ggml.tokens" at byte 154 is 10, out of range',
    ),
    "token-with-invalid-utf8": None,
}


def test_every_input_that_once_broke_the_gguf_tokenizer_loader_now_loads_or_is_refused(
    tmp_path: Path,
) -> None:
    sys.path.insert(0, str(ROOT / "fuzz"))
    try:
        import tokenizer_gguf
    finally:
        sys.path.pop(0)
    folder = ROOT / "tests" / "fuzz_inputs" / "tokenizer_gguf"
    inputs = sorted(folder.glob("*")) if folder.is_dir() else []
    assert inputs, f"{folder} holds no regression inputs: replaying nothing checks nothing"
    assert sorted(p.name for p in inputs) == sorted(TOKENIZER_REGRESSIONS), (
        "every input needs an entry in TOKENIZER_REGRESSIONS, and every entry its input"
    )
    for source in inputs:
        path = tmp_path / f"{source.name}.gguf"
        path.write_bytes(source.read_bytes())
        expected = TOKENIZER_REGRESSIONS[source.name]
        if expected is None:
            assert load_tokenizer(path).vocab_size > 0, source.name
        else:
            kind, message = expected
            with pytest.raises(specdraft.SpecdraftError) as info:
                load_tokenizer(path)
            # ConfigError and CheckpointError are siblings: the class tells a file specdraft
            # cannot use from a broken one.
            assert type(info.value) is kind, (source.name, info.value)
            assert message in str(info.value) and str(path) in str(info.value), (
                source.name,
                str(info.value),
            )
        # The fuzz target's own contract: load and use it, or a SpecdraftError, nothing else.
        tokenizer_gguf.load(source.read_bytes())
