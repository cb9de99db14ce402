"""Fuzz target: the tokenizer specdraft builds from a GGUF file's metadata.

Each input is written as a ``.gguf`` file and loaded with ``specdraft.tokenizer.load_tokenizer``;
a tokenizer that loads then encodes and decodes a sample. Whatever the bytes, the load must
succeed or raise ``specdraft.SpecdraftError`` (a ``CheckpointError`` naming the file): any
other exception, a crash, a hang or memory beyond the cap is a finding.

It runs under atheris (coverage-guided, libFuzzer's engine and flags) when atheris is
installed, else under a built-in structured mutator with a fixed seed: bit flips, byte and
word overwrites with boundary values, boundary values written into the length and count
fields of a seed, truncation, splices between seeds. Either way it prints libFuzzer's
``stat::number_of_executed_units`` line at the end, saves failing inputs under the artifact
folder and the slowest input under ``$SPECDRAFT_FUZZ_SLOWEST``.

Usage: tokenizer_gguf.py SEEDS ARTIFACTS [--seconds S] [--runs N] [--seed K] [--builtin]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import resource
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

SAMPLE = "Hello, world! <|im_start|>user\nÇa va? 1234<|im_end|>"
TIMEOUT_S = 10
MEMORY_CAP = 4 << 30

_WORK = Path(tempfile.mkdtemp(prefix="specdraft-fuzz-tok-"))
_SLOWEST = [0.0, 0]  # seconds of CPU, runs so far


def load(data: bytes) -> None:
    """The target: load ``data`` as a GGUF tokenizer and use it."""
    import specdraft
    from specdraft.tokenizer import load_tokenizer

    path = _WORK / "input.gguf"
    path.write_bytes(data)
    try:
        tok = load_tokenizer(path)
    except specdraft.SpecdraftError:
        return
    ids = tok.encode(SAMPLE)
    tok.decode(ids)
    assert tok.vocab_size > 0


def timed(data: bytes) -> None:
    """:func:`load`, keeping the slowest input under ``$SPECDRAFT_FUZZ_SLOWEST``."""
    # CPU time: on a shared machine, wall time measures the neighbours as much as the input.
    start = time.process_time()
    load(data)
    took = time.process_time() - start
    _SLOWEST[1] += 1
    # The first run also pays for one-time imports and setup.
    if _SLOWEST[1] > 1 and took > _SLOWEST[0]:
        _SLOWEST[0] = took
        folder = os.environ.get("SPECDRAFT_FUZZ_SLOWEST")
        if folder:
            Path(folder, "tokenizer_gguf.bin").write_bytes(data)
            line = f"{int(took * 1e6)} us cpu, {len(data)} bytes\n"
            Path(folder, "tokenizer_gguf.txt").write_text(line)


# --- the built-in structured mutator -------------------------------------------------

BOUNDARY = [0, 1, 0x7F, 0x80, 0xFF, 2**31 - 1, 2**31, 2**32 - 1, 2**60, 2**63, 2**64 - 1]


def length_fields(data: bytes) -> list[int]:
    """Offsets of the u64 count and length fields of a GGUF header, as far as it parses."""
    fields: list[int] = []
    pos = 24
    if len(data) < pos or data[:4] != b"GGUF":
        return fields
    fields += [8, 16]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string() -> None:
        nonlocal pos
        fields.append(pos)
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(ty: int) -> None:
        nonlocal pos
        if ty == 8:
            string()
        elif ty == 9:
            (inner,) = struct.unpack_from("<I", data, pos)
            fields.append(pos + 4)
            (n,) = struct.unpack_from("<Q", data, pos + 4)
            pos += 12
            for _ in range(min(n, 1 << 16)):
                value(inner)
        else:
            pos += sizes[ty]

    try:
        for _ in range(min(n_kv, 1 << 12)):
            string()
            (ty,) = struct.unpack_from("<I", data, pos)
            pos += 4
            value(ty)
        for _ in range(min(n_tensors, 1 << 12)):
            string()
            (n_dims,) = struct.unpack_from("<I", data, pos)
            fields += [pos + 4 + 8 * i for i in range(n_dims)]
            pos += 4 + 8 * n_dims + 4
            fields.append(pos)
            pos += 8
    except (struct.error, KeyError):
        pass
    return [f for f in fields if f + 8 <= len(data)]


def mutate(data: bytes, seeds: list[bytes], fields: list[int], rng: random.Random) -> bytes:
    """One to four random structured edits of ``data``."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not b:
            b = bytearray(rng.choice(seeds))
        op = rng.randrange(7)
        i = rng.randrange(len(b))
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            b[i] = rng.choice(BOUNDARY) & 0xFF
        elif op == 2 and i + 8 <= len(b):
            b[i : i + 8] = struct.pack("<Q", rng.choice(BOUNDARY))
        elif op == 3 and fields:
            f = rng.choice(fields)
            if f + 8 <= len(b):
                b[f : f + 8] = struct.pack("<Q", rng.choice(BOUNDARY))
        elif op == 4:
            del b[i:]
        elif op == 5:
            other = rng.choice(seeds)
            j = rng.randrange(len(other))
            b[i:] = other[j : j + rng.randrange(1, 4096)]
        else:
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randrange(1, 256)]
    return bytes(b)


def builtin(
    target: Callable[[bytes], None], seeds: list[bytes], artifacts: Path, args: argparse.Namespace
) -> int:
    """Runs the structured mutator; returns the number of failing inputs."""
    import faulthandler

    import specdraft  # noqa: F401 - loaded before the memory cap

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
    rng = random.Random(args.seed)
    fields = [length_fields(s) for s in seeds]
    deadline = time.monotonic() + (args.seconds or float("inf"))
    runs = crashes = 0
    while (args.runs == 0 or runs < args.runs) and time.monotonic() < deadline:
        k = runs % len(seeds)
        data = seeds[k] if runs < len(seeds) else mutate(seeds[k], seeds, fields[k], rng)
        # A hang ends the process with the stacks printed; the input is in the work folder.
        faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
        try:
            target(data)
        except BaseException as e:  # noqa: BLE001 - every escape is a finding
            if isinstance(e, KeyboardInterrupt):
                raise
            crashes += 1
            name = "crash-" + hashlib.sha1(data).hexdigest()
            (artifacts / name).write_bytes(data)
            print(f"==crash== {artifacts / name}", file=sys.stderr)
            traceback.print_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
        runs += 1
    print(f"stat::number_of_executed_units: {runs}", file=sys.stderr)
    return crashes


def main() -> int:
    """Parses the options and fuzzes."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("seeds", type=Path)
    p.add_argument("artifacts", type=Path)
    p.add_argument("--seconds", type=int, default=0, help="stop after this long (0: no limit)")
    p.add_argument("--runs", type=int, default=0, help="stop after this many inputs (0: none)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--builtin", action="store_true", help="the structured mutator, not atheris")
    args = p.parse_args()
    args.artifacts.mkdir(parents=True, exist_ok=True)
    seeds = [f.read_bytes() for f in sorted(args.seeds.iterdir()) if f.is_file()]
    if not seeds:
        print(f"tokenizer_gguf: no seeds in {args.seeds}", file=sys.stderr)
        return 2
    try:
        import atheris
    except ImportError:
        atheris = None
    if args.builtin or atheris is None:
        return 1 if builtin(timed, seeds, args.artifacts, args) else 0
    with atheris.instrument_imports():
        import specdraft.chat_template  # noqa: F401
        import specdraft.tokenizer  # noqa: F401
    corpus = _WORK / "corpus"
    corpus.mkdir()
    flags = [
        f"-seed={args.seed}",
        f"-timeout={TIMEOUT_S}",
        "-rss_limit_mb=4096",
        "-max_len=262144",
        "-print_final_stats=1",
        f"-artifact_prefix={args.artifacts}/",
    ]
    if args.seconds:
        flags.append(f"-max_total_time={args.seconds}")
    if args.runs:
        flags.append(f"-runs={args.runs}")
    atheris.Setup([sys.argv[0], *flags, str(corpus), str(args.seeds)], timed)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
