"""The package surface: re-exports, the type stub, the exceptions, the command line."""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

import specdraft
from specdraft import _core, cli

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
        obj = getattr(specdraft, name)
        if getattr(obj, "__module__", None) in ("specdraft", "specdraft._core"):
            assert name in declared, f"{name} is missing from _core.pyi"
        elif callable(obj):
            assert obj.__doc__, f"{name} has no docstring"
    assert (STUB.parent / "py.typed").exists()


def test_test_hooks_are_not_public():
    for name in ("_DynProposer", "_as_rust", "_time_propose", "TableTarget", "DynProposer"):
        assert name not in specdraft.__all__ and not hasattr(specdraft, name), name
    from specdraft import testing

    assert set(testing.__all__) == {"DynProposer", "as_rust", "time_propose"}
    assert "not part of the stable API" in testing.__doc__


def test_cuda_backend_exists_in_every_build():
    assert issubclass(specdraft.CudaBackend, specdraft.Backend)
    assert "CudaBackend" in specdraft.__all__


def test_protocol_method_list_matches_the_base_class():
    assert len(specdraft.PROTOCOL_METHODS) == 27
    assert specdraft.PROTOCOL_METHODS[:3] == ["alloc_state", "propose", "after_verify"]
    for name in specdraft.PROTOCOL_METHODS:
        assert callable(getattr(specdraft.DraftProposer, name)), name


def test_exception_hierarchy():
    for exc in (
        specdraft.AllocationError,
        specdraft.BackendError,
        specdraft.BackendUnavailableError,
        specdraft.ConfigError,
        specdraft.CheckpointError,
        specdraft.ProposerError,
        specdraft.RequestError,
        specdraft.GenerationError,
    ):
        assert issubclass(exc, specdraft.SpecdraftError)
        assert exc.__module__ == "specdraft" and exc.__doc__, exc
    assert issubclass(specdraft.SpecdraftError, Exception)
    # A bad request is also a ValueError, as Python code expects of a bad argument; a
    # failure while running is not.
    assert issubclass(specdraft.RequestError, ValueError)
    assert not issubclass(specdraft.GenerationError, ValueError)
    assert not issubclass(specdraft.RequestError, specdraft.GenerationError)


def _options(method) -> list[inspect.Parameter]:
    """The parameters after `self` and the prompt(s) or message."""
    return list(inspect.signature(method).parameters.values())[2:]


def test_generate_chat_and_send_take_the_same_options():
    generate = _options(specdraft.SpecEngine.generate)
    assert [p.name for p in generate][:2] == ["max_tokens", "temperature"]
    assert "ignore_eos" in [p.name for p in generate]
    assert _options(specdraft.SpecEngine.chat) == generate
    assert _options(specdraft.Conversation.send) == generate


def test_one_name_for_each_thing():
    greedy = list(inspect.signature(specdraft.TargetModel.generate_greedy).parameters)
    assert "max_tokens" in greedy and "max_new_tokens" not in greedy
    # (total, free) like MtpHead.kv_blocks, not a second spelling of the same figure.
    assert hasattr(specdraft.TargetModel, "kv_blocks")
    assert not hasattr(specdraft.TargetModel, "kv_blocks_free")


def test_one_load_tokenizer():
    import specdraft.models
    import specdraft.tokenizer

    assert specdraft.load_tokenizer is specdraft.tokenizer.load_tokenizer
    assert not hasattr(specdraft.models, "load_tokenizer")


def test_the_stub_documents_what_the_module_documents():
    """Each docstring is written once, in Rust; the stub's copy must equal it."""
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "scripts" / "stub_docs.py"
    spec = importlib.util.spec_from_file_location("stub_docs", script)
    stub_docs = importlib.util.module_from_spec(spec)
    sys.modules["stub_docs"] = stub_docs  # its dataclasses look their module up
    spec.loader.exec_module(stub_docs)
    found = stub_docs.entries(ast.parse(STUB.read_text()), _core)
    assert len(found) > 150
    wrong = [e.qualname for e in found if e.stub != e.runtime]
    assert wrong == [], "run `python scripts/stub_docs.py --write`"


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
