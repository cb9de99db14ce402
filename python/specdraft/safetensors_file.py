"""One safetensors file read as raw tensors, its header checked before anything is read.

A checkpoint is untrusted input. The checks are the Rust loader's (``rust/model/
hf_checkpoint.rs`` and the ``safetensors`` crate it calls), so a file one refuses the
other refuses too:

- the 8-byte header length is at most :data:`MAX_HEADER_BYTES` and inside the file;
- the header is UTF-8 JSON, an object of tensors (plus an optional ``__metadata__`` of
  strings), with no name twice;
- each tensor has a known dtype (:data:`DTYPE_BITS`), a shape of non-negative integers and
  two non-negative integer offsets, and holds exactly the bytes its shape and dtype need;
- in order of their offsets, the tensors lie back to back from the start of the data
  section to its end: none overlaps another, none reaches past the file, no byte is left over.

Every refusal is a ``CheckpointError`` whose message starts with the file's path. Nothing
beyond the header is read until the whole header has passed.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from specdraft._core import CheckpointError

__all__ = ["DTYPE_BITS", "MAX_HEADER_BYTES", "read_safetensors"]

#: The longest JSON header read (the ``safetensors`` format's own limit, the Rust loader's too).
MAX_HEADER_BYTES = 100_000_000
#: Bits per element of each dtype the format defines.
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}


def _shown(value: Any) -> str:  # noqa: ANN401 - any JSON value
    """``value`` for a message, cut short: a hostile header's values can be huge."""
    text = json.dumps(value) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{_shown(key)} appears twice")
        out[key] = value
    return out


def _is_count(value: Any) -> bool:  # noqa: ANN401 - any JSON value
    return type(value) is int and value >= 0


#: The most elements a tensor may have (the Rust loader counts them in 64 bits).
_MAX_ELEMENTS = (1 << 64) - 1


def _numel(shape: list[int], limit: int) -> int | None:
    """The product of ``shape``, or None once it passes ``limit`` (when no dim is zero)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > limit:
            return None
    return n


class _Check:
    """Refusals naming the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def tensor(
        self,
        name: str,
        info: Any,  # noqa: ANN401 - a JSON value
        data_len: int,
    ) -> tuple[str, list[int], int, int]:
        """``(dtype, shape, begin, end)`` of one header entry, checked on its own."""
        if not isinstance(info, dict):
            raise self.error(f"tensor {name!r} is {_shown(info)}, not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise self.error(
                f"tensor {name!r} has dtype {_shown(dtype)}; known: {', '.join(DTYPE_BITS)}"
            )
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise self.error(
                f"tensor {name!r} has shape {_shown(shape)}; expected a list of non-negative "
                "integers"
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
            raise self.error(
                f"tensor {name!r} has data_offsets {_shown(offsets)}; expected two non-negative "
                "integers"
            )
        begin, end = offsets
        if end < begin:
            raise self.error(f"tensor {name!r} ends at byte {end}, before it begins at {begin}")
        if end > data_len:
            raise self.error(
                f"tensor {name!r} is truncated: it needs bytes {begin}..{end} of the data "
                f"section but the file holds {data_len}"
            )
        bits = DTYPE_BITS[dtype]
        numel = _numel(shape, _MAX_ELEMENTS)
        if numel is None:
            raise self.error(
                f"tensor {name!r} has shape {_shown(shape)}, whose element count overflows 64 bits"
            )
        if numel * bits % 8 or numel * bits // 8 != end - begin:
            need = numel * bits // 8 if numel * bits % 8 == 0 else numel * bits / 8
            raise self.error(
                f"tensor {name!r} of dtype {dtype} and shape {_shown(shape)} needs {need} "
                f"bytes, but its data_offsets give {end - begin}"
            )
        return dtype, shape, begin, end


def _header(check: _Check, f: Any, size: int) -> tuple[int, dict[str, Any]]:  # noqa: ANN401
    """The header's length and its parsed JSON object, checked as a whole."""
    if size < 8:
        raise check.error(f"the file is {size} bytes, too short for the header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:
        raise check.error(
            f"the header length is {n}, out of range: headers are at most {MAX_HEADER_BYTES} bytes"
        )
    if n > size - 8:
        raise check.error(
            f"the header length is {n}, out of range: the file holds {size - 8} bytes after it"
        )
    try:
        header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:
        raise check.error(f"the header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise check.error(f"the header is {_shown(header)}, not an object of tensors")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise check.error(f"__metadata__ is {_shown(meta)}; expected an object of strings")
    return n, header


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, tuple[str, list[int], bytes]]:
    """``{name: (dtype, shape, raw bytes)}`` of one safetensors file.

    Raises ``CheckpointError`` naming the file and what is wrong with it (see the module's
    list) before reading any tensor's bytes.
    """
    check = _Check(str(path))
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n, header = _header(check, f, size)
            data_len = size - 8 - n
            entries = sorted(
                (
                    (name, *check.tensor(name, info, data_len))
                    for name, info in header.items()
                    if name != "__metadata__"
                ),
                key=lambda e: (e[3], e[4]),
            )
            at, after = 0, "the start of the data section"
            for name, _, _, begin, end in entries:
                if begin != at:
                    gap = "overlaps" if begin < at else "leaves a gap after"
                    raise check.error(
                        f"tensor {name!r} begins at byte {begin} of the data section and "
                        f"{gap} {after}, which ends at {at}: tensors lie back to back"
                    )
                at, after = end, f"tensor {name!r}"
            if at != data_len:
                raise check.error(
                    f"the data section holds {data_len} bytes, but its tensors end at byte {at}"
                )
            # In offset order the tensors are the data section itself: read one at a time.
            out = {
                name: (dtype, shape, f.read(end - begin))
                for name, dtype, shape, begin, end in entries
            }
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from e
    for name, _, _, begin, end in entries:
        if len(out[name][2]) != end - begin:
            raise check.error(f"tensor {name!r} was cut short while the file was read")
    return out
