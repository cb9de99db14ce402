"""Named tensors of a GGUF file, as float32 arrays, read through a bounded header parser.

A model file is untrusted input, and the ``gguf`` package's ``GGUFReader`` trusts every
count and length it reads (a string length of 2^60 costs it minutes and gigabytes). The
bindings expose only the Rust parser's metadata (``gguf_metadata``), not its tensors, and
exposing them would grow the extension's surface for the one reader that needs float32
copies of a few tensors (the trainer); so this is a small parser of its own, written to the
Rust reader's rules (``rust/model/gguf_reader.rs``, ``rust/model/gguf.rs``):

- every read is checked against the end of the file before it is made;
- a count (key/values, tensors, array elements) is refused when the rest of the file could
  not hold that many entries of the smallest size such an entry has;
- the walk over the metadata is charged to the Rust reader's memory budget
  (:data:`HEADER_MEMORY_LIMIT`), at no more than the Rust reader charges, so it ends in a
  bounded number of steps and every file the model loader reads passes here;
- nothing is kept but the alignment and the infos of the tensors asked for, so memory does
  not grow with the header; a tensor asked for must appear once, with at most four dims, a
  type whose block size is known, a whole number of blocks, and an aligned byte range inside
  the file. Only then is its range memory-mapped and dequantized by ``gguf.quants``.

What the Rust reader refuses and this one need not (a repeated metadata key, a tensor not
asked for that lies outside the file) is left to the model loader, which reads the same file.

Every refusal is a ``CheckpointError`` whose message starts with the file's path.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdraft._core import CheckpointError

__all__ = ["HEADER_MEMORY_LIMIT", "read_gguf_tensors"]

#: The Rust reader's budget for a parsed header (``gguf_reader::HEADER_MEMORY_LIMIT``).
HEADER_MEMORY_LIMIT = 256 << 20
#: The longest key or tensor name (the GGUF specification caps keys at 65,535 bytes).
MAX_NAME_BYTES = 65_535
#: How deep metadata arrays may nest, and how many dims a tensor may have (ggml's limit).
MAX_ARRAY_DEPTH, MAX_DIMS = 4, 4
#: Fewest bytes one key/value and one tensor info take in the file.
MIN_KV_BYTES, MIN_TENSOR_INFO_BYTES = 14, 24
#: What the Rust reader charges for one metadata value (``size_of::<GgufValue>()``), for one
#: key/value beyond its key and value, and at least for one tensor info beyond its name.
VALUE_BYTES, KV_BYTES, TENSOR_INFO_BYTES = 32, 72, 64
#: The largest ``general.alignment`` accepted.
MAX_ALIGNMENT = 1 << 30
#: Encoded size of each fixed-size value type; strings (8) and arrays (9) are walked.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: Smallest encoding of a value of each type (a string's length field, an array's header).
_MIN_SIZE = {**_FIXED, 8: 8, 9: 12}
_INTEGER_TYPES = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


@dataclass(frozen=True)
class _TensorInfo:
    dims: tuple[int, ...]  # innermost first, as stored
    ggml_type: int
    offset: int


class _Header:
    """A cursor over the mapped file; each read is checked against the end first."""

    def __init__(self, data: mmap.mmap, path: str) -> None:
        self.data, self.path, self.pos = data, path, 0
        self.budget = HEADER_MEMORY_LIMIT

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")

    def out_of_range(self, field: str, value: object, reason: str) -> CheckpointError:
        return self.error(f"{field} is {value}, out of range: {reason}")

    @property
    def left(self) -> int:
        return len(self.data) - self.pos

    def charge(self, nbytes: int, what: str) -> None:
        if nbytes > self.budget:
            used = HEADER_MEMORY_LIMIT - self.budget
            raise self.out_of_range(
                f"the header's size in memory at {what}",
                f"{used + nbytes} bytes",
                f"a GGUF header may take at most {HEADER_MEMORY_LIMIT} bytes",
            )
        self.budget -= nbytes

    def skip(self, n: int, what: str) -> int:
        """Moves past ``n`` bytes; returns where they start."""
        if n > self.left:
            raise self.error(
                f"the file ends at byte {len(self.data)} while reading {what} "
                f"({n} bytes at {self.pos})"
            )
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        start = self.skip(struct.calcsize(fmt), what)
        value: int = struct.unpack_from(fmt, self.data, start)[0]
        return value

    def count(self, what: str, min_bytes: int) -> int:
        n = self.unpack("<Q", what)
        most = self.left // min_bytes
        if n > most:
            raise self.out_of_range(
                what,
                n,
                f"the {self.left} bytes left in the file hold at most {most} entries of "
                f"{min_bytes} bytes",
            )
        return n

    def string(self, what: str, max_bytes: int | None = None) -> bytes:
        field = f"the length of {what} at byte {self.pos}"
        n = self.unpack("<Q", field)
        if n > self.left or (max_bytes is not None and n > max_bytes):
            rule = "" if max_bytes is None else f"; names are at most {max_bytes} bytes"
            raise self.out_of_range(field, n, f"{self.left} bytes are left in the file{rule}")
        self.charge(n, what)
        start = self.skip(n, what)
        return bytes(self.data[start : start + n])

    def name(self, what: str) -> str:
        return self.string(what, MAX_NAME_BYTES).decode("utf-8", "replace")

    def skip_value(self, ty: int, key: str, depth: int = 0) -> None:
        """Moves past one value of type ``ty`` without keeping it."""
        what = f"the value of {key!r}"
        if ty in _FIXED:
            self.skip(_FIXED[ty], what)
        elif ty == 8:
            field = f"the length of {what} at byte {self.pos}"
            n = self.unpack("<Q", field)
            if n > self.left:
                raise self.out_of_range(field, n, f"{self.left} bytes are left in the file")
            self.charge(n, what)
            self.skip(n, what)
        elif ty == 9:
            self.skip_array(key, depth)
        else:
            raise self.out_of_range(f"the type of {key!r}", ty, "GGUF value types are 0 to 12")

    def skip_array(self, key: str, depth: int) -> None:
        if depth >= MAX_ARRAY_DEPTH:
            raise self.out_of_range(
                f"the nesting of arrays in {key!r}",
                depth + 1,
                f"arrays nest at most {MAX_ARRAY_DEPTH} deep",
            )
        inner = self.unpack("<I", f"the element type of {key!r}")
        if inner not in _MIN_SIZE:
            raise self.out_of_range(
                f"the element type of {key!r}", inner, "GGUF value types are 0 to 12"
            )
        n = self.count(f"the length of array {key!r}", _MIN_SIZE[inner])
        self.charge(n * VALUE_BYTES, key)
        if inner in _FIXED:
            # The count was checked against the bytes left, so this stays inside the file.
            self.skip(n * _FIXED[inner], f"the value of {key!r}")
            return
        if inner == 8:
            self.skip_strings(n, key)
            return
        for _ in range(n):
            self.skip_value(inner, key, depth + 1)

    def skip_strings(self, n: int, key: str) -> None:
        """Moves past an array of ``n`` strings, with :meth:`skip_value`'s checks.

        One tight loop: a vocabulary is the longest part of a header (100,000 strings and more).
        """
        data, end, pos, total = self.data, len(self.data), self.pos, 0
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(n):
            if pos + 8 > end:
                self.pos = pos
                self.skip(8, f"the length of the value of {key!r} at byte {pos}")
            (length,) = unpack(data, pos)
            pos += 8
            if length > end - pos:
                self.pos = pos
                raise self.out_of_range(
                    f"the length of the value of {key!r} at byte {pos - 8}",
                    length,
                    f"{end - pos} bytes are left in the file",
                )
            pos += length
            total += length
        self.pos = pos
        self.charge(total, f"the value of {key!r}")

    def tensor_info(self) -> tuple[str, _TensorInfo]:
        name = self.name("a tensor name")
        n_dims = self.unpack("<I", f"the dims count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise self.out_of_range(
                f"the dims count of tensor {name!r}",
                n_dims,
                f"GGUF tensors have at most {MAX_DIMS} dims",
            )
        dims = tuple(self.unpack("<Q", f"a dim of tensor {name!r}") for _ in range(n_dims))
        ggml_type = self.unpack("<I", f"the type of tensor {name!r}")
        offset = self.unpack("<Q", f"the data offset of tensor {name!r}")
        return name, _TensorInfo(dims, ggml_type, offset)


def _alignment(h: _Header, ty: int) -> int:
    if ty not in _INTEGER_TYPES:
        h.skip_value(ty, "general.alignment")
        raise h.error(f"metadata 'general.alignment' has value type {ty}, not an integer")
    align = h.unpack(_INTEGER_TYPES[ty], "the value of 'general.alignment'")
    if align <= 0 or align & (align - 1) or align > MAX_ALIGNMENT:
        raise h.out_of_range(
            "metadata 'general.alignment'",
            align,
            f"a power of two up to {MAX_ALIGNMENT} is expected",
        )
    return align


def _parse(h: _Header, wanted: set[str]) -> tuple[dict[str, _TensorInfo], int]:
    """The infos of the ``wanted`` tensors present, and where the data section starts."""
    if len(h.data) < 4 or h.data[:4] != b"GGUF":
        raise h.error("not a GGUF file (it does not start with the GGUF magic)")
    h.pos = 4
    version = h.unpack("<I", "the version")
    if version not in (2, 3):
        raise h.out_of_range("the version", version, "versions 2 and 3 are read")
    n_tensors = h.count("the tensor count", MIN_TENSOR_INFO_BYTES)
    n_kv = h.count("the metadata count", MIN_KV_BYTES)
    align = None
    for _ in range(n_kv):
        key = h.name("a metadata key")
        ty = h.unpack("<I", f"the type of {key!r}")
        if key == "general.alignment":
            if align is not None:
                raise h.error(f"metadata key {key!r} appears twice")
            align = _alignment(h, ty)
        else:
            h.skip_value(ty, key)
        h.charge(KV_BYTES, key)
    align = align or 32
    found: dict[str, _TensorInfo] = {}
    for _ in range(n_tensors):
        name, info = h.tensor_info()
        h.charge(TENSOR_INFO_BYTES + 8 * len(info.dims), name)
        if name in wanted:
            if name in found:
                raise h.error(f"tensor {name!r} appears twice")
            found[name] = info
    data_start = -(-h.pos // align) * align
    for name, info in found.items():
        if info.offset % align:
            raise h.out_of_range(
                f"the data offset of tensor {name!r}",
                info.offset,
                f"offsets are multiples of the alignment, {align}",
            )
    return found, data_start


def _type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


def _dequantized(
    data: mmap.mmap, path: str, name: str, info: _TensorInfo, start: int
) -> np.ndarray:
    """The float32 values of one tensor whose info the parse accepted, shape outermost first."""
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    numel = 1
    for d in info.dims:
        numel *= d
    try:
        qtype = GGMLQuantizationType(info.ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise CheckpointError(
            f"{path}: tensor {name!r} has {_type_name(info.ggml_type)}, which is not a type "
            "this reader knows"
        ) from None
    if numel % block:
        raise CheckpointError(
            f"{path}: tensor {name!r} has shape {list(reversed(info.dims))} ({numel} elements), "
            f"not a whole number of {qtype.name} blocks of {block}"
        )
    nbytes = numel // block * type_size
    end = start + nbytes
    if end > len(data):
        raise CheckpointError(
            f"{path}: tensor {name!r} is truncated: it needs bytes {start}..{end} but the file "
            f"has {len(data)}"
        )
    raw = np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=start)
    try:
        values = gguf.quants.dequantize(raw, qtype)
    except NotImplementedError:
        raise CheckpointError(
            f"{path}: tensor {name!r} has type {qtype.name}, which cannot be read as float"
        ) from None
    out = values.reshape(tuple(reversed(info.dims)))  # GGUF lists dims innermost first
    # F32 comes back as a read-only view of the mapping: the caller gets its own copy.
    return out.copy() if np.may_share_memory(out, raw) else out


def read_gguf_tensors(path: str | os.PathLike[str], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The float32 arrays of the tensors ``names`` that the GGUF file ``path`` holds.

    Shapes are outermost first (numpy's order); a name the file lacks is left out. Raises
    ``CheckpointError`` naming the file when its header or a requested tensor is malformed,
    before anything is allocated for it.
    """
    p = str(Path(path))
    try:
        with open(p, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise CheckpointError(f"{p}: not a GGUF file (it is empty)")
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read: {e.strerror or e}") from e
    # The map is not closed by hand: it closes when the last view of it goes, and an error's
    # traceback may hold one.
    found, data_start = _parse(_Header(data, p), set(names))
    return {
        name: _dequantized(data, p, name, info, data_start + info.offset)
        for name, info in found.items()
    }
