"""The README's Python examples run as written: the proposer passes the conformance check,
and the engine example (slow: the real SmolLM2 model) answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


WORDS = {
    "three": 3,
    "twenty": 20,
    "twenty-one": 21,
    "twenty-two": 22,
    "twenty-three": 23,
    "twenty-four": 24,
}


def test_the_protocol_method_count_is_the_modules() -> None:
    import specdraft

    m = re.search(
        r"\((\S+) required methods, (\S+) provided ones", " ".join(README.read_text().split())
    )
    assert m, "the README no longer counts the protocol's methods"
    required, provided = (WORDS[w] for w in m.groups())
    methods = specdraft.PROTOCOL_METHODS
    assert (required, provided) == (3, len(methods) - 3), methods


def test_proposer_example_runs_and_conforms(capsys) -> None:
    block = next(b for b in python_blocks() if "class RepeatLast" in b)
    namespace: dict[str, object] = {}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "RepeatLast: all" in out and "checks passed" in out


@pytest.mark.slow
def test_engine_example_runs(capsys) -> None:
    block = next(b for b in python_blocks() if "engine.conversation()" in b)
    namespace: dict[str, object] = {}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "Paris" in out and "Rome" in out, out
