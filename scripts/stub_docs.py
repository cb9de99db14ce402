"""Keeps the docstrings of ``python/specdraft/_core.pyi`` equal to the built module's.

A docstring of the extension module is written once, as the Rust doc comment of the
binding in ``rust/python/``; the stub carries a copy so editors show it. This script
compares every docstring in the stub with the runtime ``__doc__`` of what it describes:

    python scripts/stub_docs.py --check   # exit 1 and list each difference
    python scripts/stub_docs.py --write   # rewrite the stub's docstrings from the module

Signatures are not its business: ``python -m mypy.stubtest specdraft._core`` checks them.
Dunder methods (``__new__``, ``__int__``, ...) carry no docstring in the stub: the class
docstring documents construction.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

STUB = Path(__file__).resolve().parents[1] / "python" / "specdraft" / "_core.pyi"
MODULE = "specdraft._core"


@dataclass
class Entry:
    """One documented name of the stub and the docstring the module gives it."""

    qualname: str
    node: ast.ClassDef | ast.FunctionDef
    stub: str | None
    runtime: str | None


def _runtime_doc(obj: object) -> str | None:
    doc = getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else None


def entries(tree: ast.Module, module: object) -> list[Entry]:
    """Every class and function of the stub with its runtime counterpart's docstring."""
    out: list[Entry] = []

    def visit(nodes: list[ast.stmt], owner: object, prefix: str) -> None:
        for node in nodes:
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                continue
            if node.name.startswith("__") and node.name.endswith("__"):
                continue
            qualname = prefix + node.name
            if not hasattr(owner, node.name):
                print(f"{qualname}: in the stub but not in {MODULE} (stubtest says more)")
                continue
            obj = inspect.getattr_static(owner, node.name)
            if isinstance(obj, (staticmethod, classmethod)):
                obj = obj.__func__
            runtime = _runtime_doc(obj)
            out.append(Entry(qualname, node, ast.get_docstring(node), runtime))
            if isinstance(node, ast.ClassDef):
                visit(node.body, getattr(owner, node.name), qualname + ".")

    visit(tree.body, module, "")
    return out


def _render(doc: str, indent: str) -> list[str]:
    quote = 'r"""' if "\\" in doc else '"""'
    doc = doc.replace('"""', '\\"\\"\\"') if quote == '"""' else doc
    lines = doc.split("\n")
    if len(lines) == 1:
        return [f'{indent}{quote}{lines[0]}"""']
    body = [f"{indent}{line}" if line else "" for line in lines[1:]]
    return [f"{indent}{quote}{lines[0]}", *body, f'{indent}"""']


def _docstring_node(node: ast.ClassDef | ast.FunctionDef) -> ast.Expr | None:
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first
    return None


def rewrite(text: str, wrong: list[Entry]) -> str:
    """``text`` with the docstring of each entry in ``wrong`` replaced by the runtime one."""
    lines = text.split("\n")
    for e in sorted(wrong, key=lambda e: e.node.lineno, reverse=True):
        node = e.node
        indent = " " * (node.col_offset + 4)
        new = _render(e.runtime, indent) if e.runtime else []
        current = _docstring_node(node)
        if current is not None:
            lo, hi = current.lineno - 1, current.end_lineno or current.lineno
            if not new and len(node.body) == 1:
                new = [f"{indent}..."]
            lines[lo:hi] = new
            continue
        first = node.body[0]
        line = lines[first.lineno - 1]
        is_ellipsis = isinstance(first, ast.Expr) and getattr(first.value, "value", 0) is Ellipsis
        if line[: first.col_offset].strip():
            # `def f(...) -> T: ...` on one line: the docstring becomes the body.
            head = line[: first.col_offset].rstrip()
            rest = [] if is_ellipsis else [indent + line[first.col_offset :].strip()]
            lines[first.lineno - 1 : first.lineno] = [head, *(new or [f"{indent}..."]), *rest]
        elif is_ellipsis:
            lines[first.lineno - 1 : first.end_lineno] = new or [f"{indent}..."]
        else:
            extra = [""] if isinstance(node, ast.ClassDef) and new else []
            lines[first.lineno - 1 : first.lineno - 1] = [*new, *extra]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Checks or rewrites the stub's docstrings; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="report differences, exit 1 if any")
    mode.add_argument("--write", action="store_true", help="rewrite the stub's docstrings")
    args = p.parse_args(argv)
    module = importlib.import_module(MODULE)
    text = STUB.read_text()
    found = entries(ast.parse(text), module)
    wrong = [e for e in found if e.stub != e.runtime]
    if args.write:
        STUB.write_text(rewrite(text, wrong))
        print(f"{STUB}: rewrote {len(wrong)} docstrings of {len(found)}")
        return 0
    for e in wrong:
        print(f"{e.qualname}:\n  stub:    {e.stub!r}\n  runtime: {e.runtime!r}")
    if wrong:
        print(
            f"{len(wrong)} of {len(found)} docstrings in {STUB.name} differ from {MODULE}; "
            "the Rust doc comments in rust/python/ are the source: run "
            "`python scripts/stub_docs.py --write` after changing them",
            file=sys.stderr,
        )
        return 1
    print(f"{STUB.name}: all {len(found)} docstrings match {MODULE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
