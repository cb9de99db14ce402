"""``specdraft.SuffixDecoding`` from Python: its options and their errors, drafts from the
sequence's own history and from earlier outputs, the conformance check, greedy output
unchanged in the engine on a first and a second pass, and ``specdraft bench --proposer
suffix``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import specdraft
from specdraft import DevicePtr, ProposerError

gguf = pytest.importorskip("gguf")
from test_engine import write_tiny_chat_gguf  # noqa: E402


def test_options_have_documented_defaults_and_are_checked() -> None:
    sd = specdraft.SuffixDecoding()
    assert (sd.max_depth, sd.max_spec_factor, sd.max_tree_nodes) == (24, 1.0, 1 << 20)
    assert sd.min_token_prob == pytest.approx(0.1)
    assert "max_depth=24" in repr(sd)
    for kwargs, message in [
        ({"max_depth": 1}, "max_depth must be in 2..=4096, got 1"),
        ({"min_token_prob": 1.5}, r"min_token_prob must be in \[0, 1\], got 1.5"),
        ({"max_spec_factor": -1.0}, "max_spec_factor must be finite and >= 0, got -1"),
        ({"max_tree_nodes": 1 << 40}, "max_tree_nodes must be at most"),
    ]:
        with pytest.raises(ProposerError, match=message):
            specdraft.SuffixDecoding(**kwargs)


def test_drafts_from_its_own_history_and_from_earlier_outputs(gpu, ctx) -> None:
    sd = specdraft.SuffixDecoding()
    st = sd.alloc_state(gpu)
    sd.prefill_drafter([9, 1, 2, 3, 4, 5, 9, 1], DevicePtr.NULL, st, ctx)
    # "9 1 2" occurred once before, followed by 3 4 5: a 3-token match drafts 3.
    assert sd.propose(2, DevicePtr.NULL, 8, 4, st, ctx) == [3, 4, 5]
    sd.after_verify(1, st)
    with pytest.raises(ProposerError, match="outside the vocabulary of 256"):
        sd.propose(999, DevicePtr.NULL, 10, 4, st, ctx)
    # Freeing the sequence stores its output (2 3) in the shared tree, after the prompt's
    # last max_depth / 2 = 12 tokens (here the whole prompt of 8).
    sd.free_state(gpu, st)
    assert sd.shared_tree()["outputs"] == 1 and sd.shared_tree()["tokens"] == 8 + 2
    sd.remember_output([7, 7, 8, 8, 9])
    other = sd.alloc_state(gpu)
    sd.prefill_drafter([7, 7], DevicePtr.NULL, other, ctx)
    assert sd.propose(8, DevicePtr.NULL, 2, 4, other, ctx) == [8, 9]
    sd.free_state(gpu, other)
    assert specdraft.check_proposer(sd).ok


def _load(path: Path, gpu: specdraft.CpuBackend) -> specdraft.TargetModel:
    return specdraft.load_model(path, gpu=gpu, max_rows=64, max_seq_len=256, kv_blocks=128)


def _tokens(results) -> list[list[int]]:
    for r in results:
        assert r.error is None, r.error
    return [list(r.tokens) for r in results]


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [40, 41, 42, 43, 44, 40, 41], [100, 3, 3, 4]]


def test_greedy_output_is_unchanged_on_every_pass(tmp_path, gpu) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_chat_gguf(path)
    model = _load(path, gpu)
    base = _tokens(specdraft.SpecEngine(model).generate(PROMPTS, max_tokens=32, ignore_eos=True))
    sd = specdraft.SuffixDecoding()
    engine = specdraft.SpecEngine(model, sd, num_drafts=4)
    first = engine.generate(PROMPTS, max_tokens=32, ignore_eos=True)
    second = engine.generate(PROMPTS, max_tokens=32, ignore_eos=True)
    assert _tokens(first) == base and _tokens(second) == base
    # Every finished sequence's output went into the shared tree.
    assert sd.shared_tree()["outputs"] == 2 * len(PROMPTS)


def test_bench_command_runs_the_suffix_proposer(tmp_path, capsys) -> None:
    from specdraft.cli import main

    path = tmp_path / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    common = ["--model", str(path), "--device", "cpu", "--max-seq-len", "1024"]
    code = main(
        ["bench", *common, "--prompts", "2", "--max-tokens", "12", "--json", "--proposer", "suffix"]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    results = json.loads(out.out)["results"]
    assert [r["proposer"] for r in results] == ["baseline", "suffix"]
    assert results[1]["identical_to_baseline"] is True
