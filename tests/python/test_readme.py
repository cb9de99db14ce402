"""The README's Python examples run as written: the proposer passes the conformance check,
and the engine example (slow: the real SmolLM2 model) answers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


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
