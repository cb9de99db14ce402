"""The package surface: re-exports, the type stub, the command line."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import specdraft
from specdraft import cli

STUB = Path(specdraft.__file__).with_name("_core.pyi")


def stub_names() -> set[str]:
    tree = ast.parse(STUB.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_public_name_is_exported_and_typed():
    declared = stub_names()
    for name in specdraft.__all__:
        assert hasattr(specdraft, name), name
        assert name in declared, f"{name} is missing from _core.pyi"
    assert (STUB.parent / "py.typed").exists()


def test_protocol_method_list_matches_the_base_class():
    assert len(specdraft.PROTOCOL_METHODS) == 22
    assert specdraft.PROTOCOL_METHODS[:3] == ["alloc_state", "propose", "after_verify"]
    for name in specdraft.PROTOCOL_METHODS:
        assert callable(getattr(specdraft.DraftProposer, name)), name


def test_exception_hierarchy():
    for exc in (
        specdraft.AllocationError,
        specdraft.ConfigError,
        specdraft.CheckpointError,
        specdraft.ProposerError,
    ):
        assert issubclass(exc, specdraft.SpecdraftError)
    assert issubclass(specdraft.SpecdraftError, Exception)


def test_cli_bench_protocol_prints_the_figures(capsys):
    assert cli.main(["bench", "--protocol", "--iters", "300"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["benchmark"] == "protocol_py" and out["iters"] == 300
    results = out["results"]
    assert set(results) == {
        "prompt_lookup_rust",
        "trivial_python",
        "four_drafts_python",
        "python_subclass_of_prompt_lookup",
    }
    assert results["prompt_lookup_rust"]["drafts_per_call"] == 4
    assert results["trivial_python"]["drafts_per_call"] == 0
    for r in results.values():
        assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]
    assert out["python_overhead_us"] == results["trivial_python"]["median_us"]


def test_cli_without_a_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "bench" in capsys.readouterr().out
