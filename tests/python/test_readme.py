"""The README's Python proposer example runs as written and passes the conformance check."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_proposer_example_runs_and_conforms(capsys) -> None:
    block = next(b for b in python_blocks() if "class RepeatLast" in b)
    namespace: dict[str, object] = {}
    exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "RepeatLast: all" in out and "checks passed" in out
