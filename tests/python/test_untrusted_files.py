"""Model files read in Python are untrusted input, as in the Rust loaders.

``read_safetensors`` (``specdraft quantize``, ``train-mtp --init-from``, Hugging Face targets
in training) checks the header length, the JSON, each tensor's dtype, shape and offsets
before reading a tensor; the trainer's GGUF reader bounds every count and length before
allocating, so a hostile file is refused quickly in little memory; and every command reports
a refused file as one line naming the file, with a non-zero exit status.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft.gguf_tensors import read_gguf_tensors
from specdraft.quantize import read_safetensors, write_safetensors
from specdraft.train.targets import read_target_weights

# ---------------------------------------------------------------------------------------------
# safetensors


def _safetensors(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    """A safetensors file of ``header`` (JSON) and ``data``; ``length`` overrides the length."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def _t(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


BAD_SAFETENSORS = [
    (
        "header-length-2^40",
        {},
        b"",
        1 << 40,
        "header length is 1099511627776, out of range: headers are at most 100000000 bytes",
    ),
    ("header-past-the-file", {}, b"", 4096, "the file holds 2 bytes after it"),
    ("header-not-json", None, b"", None, "not UTF-8 JSON"),
    ("header-a-list", [1, 2], b"", None, "not an object of tensors"),
    ("metadata-not-strings", {"__metadata__": {"a": 1}}, b"", None, "__metadata__"),
    ("dtype-unknown", {"w": _t("F33", [2], 0, 8)}, bytes(8), None, 'dtype "F33"'),
    ("shape-negative", {"w": _t("F32", [-1, 2], 0, 8)}, bytes(8), None, "shape [-1, 2]"),
    ("shape-bools", {"w": _t("F32", [True, 2], 0, 8)}, bytes(8), None, "shape [true, 2]"),
    ("offsets-negative", {"w": _t("U8", [2], -2, 0)}, bytes(2), None, "data_offsets [-2, 0]"),
    (
        "offsets-three",
        {"w": _t("U8", [2], 0, 2) | {"data_offsets": [0, 1, 2]}},
        bytes(2),
        None,
        "data_offsets [0, 1, 2]",
    ),
    ("end-before-begin", {"w": _t("U8", [0], 4, 2)}, bytes(4), None, "before it begins at 4"),
    ("past-the-end", {"w": _t("U8", [1 << 40], 0, 1 << 40)}, bytes(8), None, "is truncated"),
    (
        "shape-against-bytes",
        {"w": _t("F32", [4], 0, 8)},
        bytes(8),
        None,
        "needs 16 bytes, but its data_offsets give 8",
    ),
    ("shape-huge", {"w": _t("F32", [1 << 62, 1 << 62], 0, 8)}, bytes(8), None, "overflows 64 bits"),
    ("half-bytes", {"w": _t("F4", [3], 0, 2)}, bytes(2), None, "needs 1.5 bytes"),
    (
        "overlapping",
        {"a": _t("U8", [4], 0, 4), "b": _t("U8", [4], 2, 6)},
        bytes(6),
        None,
        "'b' begins at byte 2 of the data section and overlaps tensor 'a', which ends at 4",
    ),
    (
        "gap",
        {"a": _t("U8", [4], 0, 4), "b": _t("U8", [4], 6, 10)},
        bytes(10),
        None,
        "leaves a gap after tensor 'a'",
    ),
    (
        "not-from-zero",
        {"a": _t("U8", [4], 2, 6)},
        bytes(6),
        None,
        "leaves a gap after the start of the data section",
    ),
    (
        "bytes-left-over",
        {"a": _t("U8", [4], 0, 4)},
        bytes(6),
        None,
        "the data section holds 6 bytes, but its tensors end at byte 4",
    ),
]


@pytest.mark.parametrize(
    "header,data,length,message",
    [c[1:] for c in BAD_SAFETENSORS],
    ids=[c[0] for c in BAD_SAFETENSORS],
)
def test_a_malformed_safetensors_file_is_refused_naming_file_and_fault(
    tmp_path: Path, header: object, data: bytes, length: int | None, message: str
) -> None:
    path = tmp_path / "model.safetensors"
    if header is None:
        path.write_bytes(struct.pack("<Q", 6) + b"{nope}")
    else:
        _safetensors(path, header, data, length)
    with pytest.raises(specdraft.CheckpointError) as info:
        read_safetensors(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), info.value


def test_a_name_twice_and_a_short_file_are_refused(tmp_path: Path) -> None:
    twice = tmp_path / "twice.safetensors"
    entry = b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'
    text = b"{" + entry + b"," + entry.replace(b"[0,1]", b"[1,2]") + b"}"
    twice.write_bytes(struct.pack("<Q", len(text)) + text + bytes(2))
    with pytest.raises(specdraft.CheckpointError, match='"a" appears twice'):
        read_safetensors(twice)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(specdraft.CheckpointError, match="2 bytes, too short"):
        read_safetensors(short)


def test_a_valid_file_reads_back_every_tensor_exactly(tmp_path: Path) -> None:
    tensors = {
        "b": ("F32", [2, 2], np.arange(4, dtype="<f4").tobytes()),
        "a": ("BF16", [3], bytes([1, 2, 3, 4, 5, 6])),
        "empty": ("I64", [0, 7], b""),
        "scalar": ("U8", [], b"\x09"),
        "nibbles": ("F4", [4], b"\xab\xcd"),
    }
    path = tmp_path / "ok.safetensors"
    write_safetensors(path, tensors)
    assert read_safetensors(path) == tensors
    # The format lets a writer put its tensors in any order in the header.
    header = {"__metadata__": {"format": "pt"}, "y": _t("U8", [2], 3, 5), "x": _t("U8", [3], 0, 3)}
    path = _safetensors(tmp_path / "order.safetensors", header, b"abcde")
    assert read_safetensors(path) == {"x": ("U8", [3], b"abc"), "y": ("U8", [2], b"de")}


def test_a_hugging_face_target_with_a_malformed_file_is_refused_for_training(
    tmp_path: Path,
) -> None:
    _safetensors(tmp_path / "model.safetensors", {}, b"", 1 << 40)
    with pytest.raises(specdraft.CheckpointError, match="header length is 1099511627776"):
        read_target_weights(tmp_path)


# ---------------------------------------------------------------------------------------------
# GGUF


def _str(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def _gguf(
    kvs: Sequence[bytes] = (), infos: Sequence[bytes] = (), data: bytes = b"", **counts: int
) -> bytes:
    """A GGUF v3 file of the given key/values and tensor infos; ``counts`` override theirs."""
    n_tensors = counts.get("n_tensors", len(infos))
    n_kv = counts.get("n_kv", len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % 32) + data if data else head


def _info(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    """A tensor info; ``dims`` innermost first, as stored."""
    packed = struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
    return _str(name) + packed + struct.pack("<IQ", ggml_type, offset)


EMBD = "token_embd.weight"
F32_8x4 = _info(EMBD, [4, 8], 0, 0)

BAD_GGUF = [
    ("empty", b"", "it is empty"),
    ("magic", b"GGML" + bytes(64), "does not start with the GGUF magic"),
    (
        "ends-inside-the-version",
        b"GGUF\x03\x00",
        "the file ends at byte 6 while reading the version",
    ),
    ("version-4", b"GGUF" + struct.pack("<IQQ", 4, 0, 0), "the version is 4"),
    (
        "tensor-count-2^60",
        _gguf(n_tensors=1 << 60) + bytes(64),
        "the tensor count is 1152921504606846976",
    ),
    (
        "metadata-count-2^60",
        _gguf(n_kv=1 << 60) + bytes(64),
        "the metadata count is 1152921504606846976",
    ),
    (
        "key-length-2^60",
        _gguf(n_kv=1) + struct.pack("<Q", 1 << 60) + bytes(64),
        "the length of a metadata key at byte 24 is 1152921504606846976",
    ),
    (
        "string-length-2^60",
        _gguf([_str("general.name") + struct.pack("<IQ", 8, 1 << 60)]) + bytes(64),
        "the length of the value of 'general.name' at byte 48 is 1152921504606846976",
    ),
    (
        "array-count-2^60",
        _gguf([_str("a") + struct.pack("<IIQ", 9, 4, 1 << 60)]) + bytes(64),
        "the length of array 'a' is 1152921504606846976",
    ),
    (
        "string-element-2^60",
        _gguf(
            [_str("tokens") + struct.pack("<IIQ", 9, 8, 2) + _str("x") + struct.pack("<Q", 1 << 60)]
        )
        + bytes(64),
        "the length of the value of 'tokens' at byte 63 is 1152921504606846976",
    ),
    (
        "array-of-16MiB-bytes",
        _gguf([_str("t") + struct.pack("<IIQ", 9, 0, 16 << 20) + bytes(16 << 20)]),
        "size in memory",
    ),
    (
        "arrays-nested-5-deep",
        _gguf([_str("n") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5]) + bytes(64),
        "arrays nest at most 4 deep",
    ),
    (
        "value-type-13",
        _gguf([_str("v") + struct.pack("<I", 13)]) + bytes(64),
        "GGUF value types are 0 to 12",
    ),
    (
        "alignment-48",
        _gguf([_str("general.alignment") + struct.pack("<II", 4, 48)]),
        "'general.alignment' is 48",
    ),
    (
        "tensor-name-length-2^60",
        _gguf(n_tensors=1) + struct.pack("<Q", 1 << 60) + bytes(64),
        "the length of a tensor name at byte 24 is 1152921504606846976",
    ),
    ("dims-count-5", _gguf([], [_info(EMBD, [1] * 5)]), "GGUF tensors have at most 4 dims"),
    (
        "offset-not-aligned",
        _gguf([], [_info(EMBD, [4, 8], 0, 8)], bytes(128)),
        "offsets are multiples of the alignment, 32",
    ),
    (
        "f32-past-the-end",
        _gguf([], [_info(EMBD, [1 << 40, 1 << 20], 0, 0)], bytes(128)),
        "'token_embd.weight' is truncated: it needs bytes 96..4611686018427388000 "
        "but the file has 224",
    ),
    (
        "q8_0-33-elements",
        _gguf([], [_info(EMBD, [33], 8, 0)], bytes(64)),
        "not a whole number of Q8_0 blocks of 32",
    ),
    ("type-99", _gguf([], [_info(EMBD, [4], 99, 0)], bytes(64)), "ggml type 99"),
    ("embedding-twice", _gguf([], [F32_8x4, F32_8x4], bytes(128)), "appears twice"),
]


@pytest.mark.parametrize("data,message", [c[1:] for c in BAD_GGUF], ids=[c[0] for c in BAD_GGUF])
def test_a_malformed_gguf_is_refused_naming_file_and_fault(
    tmp_path: Path, data: bytes, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(specdraft.CheckpointError) as info:
        read_target_weights(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), info.value


def test_gguf_bombs_are_refused_by_the_train_reader_quickly_in_bounded_memory(
    tmp_path: Path,
) -> None:
    # Every bomb in one fresh process: its peak resident memory measures these reads alone,
    # and the address space is capped, so a reader that trusts a count fails instead of
    # swapping the machine.
    paths = []
    for name, data, _ in BAD_GGUF:
        paths.append(tmp_path / f"{name}.gguf")
        paths[-1].write_bytes(data)
    script = textwrap.dedent(
        f"""
        import resource, time, specdraft
        from specdraft.train.targets import read_target_weights
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, hard))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for path in {[str(p) for p in paths]!r}:
            start = time.perf_counter()
            try:
                read_target_weights(path)
                print(path, "was read")
            except specdraft.CheckpointError:
                print(path, time.perf_counter() - start)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    *lines, grew_kib = out.stdout.splitlines()
    assert len(lines) == len(paths), out.stdout
    for line in lines:
        path, took = line.rsplit(" ", 1)
        assert took != "read" and float(took) < 2.0, line
    assert int(grew_kib) < 64 << 10, f"peak memory grew by {grew_kib} KiB"


def test_a_cut_short_model_is_refused(tmp_path: Path) -> None:
    from tiny_gguf import write_tiny_llama

    whole = tmp_path / "tiny.gguf"
    write_tiny_llama(whole, vocab=80)
    data = whole.read_bytes()
    for cut in (len(data) // 20, len(data) // 2, len(data) - 4):
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(specdraft.CheckpointError, match=str(path)):
            read_target_weights(path)


def test_gguf_tensors_match_the_written_values_and_an_independent_reader(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(5)
    embed = rng.standard_normal((6, 64)).astype(np.float32)
    head = rng.standard_normal((6, 64)).astype(np.float32)
    norm = rng.standard_normal(64).astype(np.float32)
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_token_list(["a", "bb", "ccc"])
    w.add_array("nested", [[1, 2], [3]])
    w.add_tensor(EMBD, embed)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("output.weight", gguf.quants.quantize(head, q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", norm)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_target_weights(path)
    assert np.array_equal(got.embed, embed) and np.array_equal(got.final_norm, norm)
    assert got.lm_head.shape == (6, 64) and np.abs(got.lm_head - head).max() < 0.02
    # The parse, checked against gguf's own reader: the same bytes at the same offsets.
    reader = gguf.GGUFReader(str(path))
    want = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    assert np.array_equal(got.lm_head.ravel(), want["output.weight"].ravel())
    assert read_gguf_tensors(path, ["absent"]) == {}
    assert got.embed.flags.writeable and got.embed.flags.owndata


# ---------------------------------------------------------------------------------------------
# The command line

_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 80,
    "rms_norm_eps": 1e-5,
}


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    gguf_bomb = tmp_path / "bomb.gguf"
    gguf_bomb.write_bytes({c[0]: c[1] for c in BAD_GGUF}["string-length-2^60"])
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_CONFIG))
    _safetensors(folder / "model.safetensors", {}, b"", 1 << 40)
    return {"gguf": gguf_bomb, "safetensors": folder}


GENERATE = ["generate", "--device", "cpu", "--prompt", "hi", "--model", "{model}"]
COMMANDS = [
    ("quantize", "safetensors", ["quantize", "--nvfp4", "{model}", "{tmp}/out"]),
    ("generate", "gguf", GENERATE),
    ("generate", "safetensors", GENERATE),
    ("bench", "gguf", ["bench", "--device", "cpu", "--model", "{model}"]),
    ("bench", "safetensors", ["bench", "--device", "cpu", "--model", "{model}"]),
    ("train-mtp", "gguf", ["train-mtp", "--model", "{model}", "--out", "{tmp}/head"]),
    ("train-mtp", "safetensors", ["train-mtp", "--model", "{model}", "--out", "{tmp}/head"]),
]


@pytest.mark.parametrize("command,kind,argv", COMMANDS, ids=[f"{c[0]}-{c[1]}" for c in COMMANDS])
def test_each_command_reports_a_refused_file_in_one_line(
    tmp_path: Path, command: str, kind: str, argv: list[str]
) -> None:
    if command == "train-mtp":
        pytest.importorskip("jax")  # without the extra the command only names the extra
    model = _bad_inputs(tmp_path)[kind]
    args = [a.format(model=model, tmp=tmp_path) for a in argv]
    out = subprocess.run(
        [sys.executable, "-m", "specdraft.cli", *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    # The model commands say what they load first; nothing else comes before the error.
    lines = [line for line in out.stderr.splitlines() if not line.startswith("loading ")]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"specdraft {command}: {model}"), lines[0]
    assert "out of range" in lines[0], lines[0]
    assert "quantized" not in out.stdout
    # Nothing is written for a refused file.
    assert not (tmp_path / "out").exists() and not (tmp_path / "head").exists()
