"""Shipped draft heads of every kind, found by name and by their target's file and loaded by
``load_draft_head`` with the class their ``config.json`` names: an MTP head, an EAGLE-3 head
(``speculators_model_type``) and a DFlash head (``dflash_config``), written here at random
for a tiny target into a stand-in for the package's head folder. Each drafts through the
engine without changing greedy output, ``--proposer mtp|eagle3|dflash|hybrid`` build them,
and a kind that is not shipped, or not a kind, is refused naming what is shipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import specdraft
import specdraft.heads as heads
import test_dflash_head
import test_eagle3_head
import test_mtp_head
from specdraft.bench import hybrid_for
from specdraft.cli_engine import make_proposer

pytest.importorskip("gguf")
from tiny_gguf import write_tiny_llama  # noqa: E402

VOCAB, LAYERS = test_mtp_head.VOCAB, 4
TARGET_FILE = "tiny-target.gguf"
CLASSES = {"mtp": "MtpHead", "eagle3": "Eagle3Head", "dflash": "DFlashHead"}


def _ship(folder: Path, acceptance: float | None = None) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["specdraft_target"] = {"name": "tiny", "file": TARGET_FILE}
    (folder / "config.json").write_text(json.dumps(config))
    if acceptance is not None:
        report = {"acceptance": {"engine_mean_acceptance_length": acceptance}}
        (folder / "report.json").write_text(json.dumps(report))


@pytest.fixture
def shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A head folder holding one random head of each kind for the tiny target; returns the
    target's path."""
    root = tmp_path / "heads"
    _ship(test_mtp_head.write_checkpoint(root / "tiny-mtp", "deepseek_v3"), 1.7)
    _ship(
        test_eagle3_head.write_checkpoint(
            root / "tiny-eagle3", "speculators", aux=(1, 2, 3), embed=False
        ),
        1.4,
    )
    _ship(test_dflash_head.write_checkpoint(root / "tiny-dflash", config={"vocab_size": VOCAB}))
    monkeypatch.setattr(heads, "_root", lambda: root)
    target = tmp_path / TARGET_FILE
    write_tiny_llama(target, vocab=VOCAB, layers=LAYERS, seed=4)
    return target


def _load(path: Path, gpu) -> specdraft.TargetModel:  # noqa: ANN001
    return specdraft.load_model(path, gpu=gpu, max_rows=32, max_seq_len=128, kv_blocks=32)


def test_each_kind_is_found_by_its_target_and_loads_as_its_class(shipped, gpu) -> None:
    assert heads.shipped_heads() == ["tiny-dflash", "tiny-eagle3", "tiny-mtp"]
    model = _load(shipped, gpu)
    prompt = [1, 5, 9, 13, 2, 7, 7, 30, 41]
    (plain,) = specdraft.SpecEngine(model, None).generate([prompt], max_tokens=20)
    for kind, cls in CLASSES.items():
        name = heads.default_head_for(shipped, kind)
        assert (name, heads.head_kind(name)) == (f"tiny-{kind}", kind)
        head = heads.load_draft_head(name, model)
        assert type(head).__name__ == cls, kind
        # On the CPU backend the projections are re-stored as Q8_0 by default.
        assert head.projection_format == "q8_0", kind
        engine = specdraft.SpecEngine(model, head, num_drafts=3, draft_policy="fixed")
        (spec,) = engine.generate([prompt], max_tokens=20)
        assert spec.error is None, spec.error
        assert list(spec.tokens) == list(plain.tokens), kind
        assert spec.metrics["drafted_at"][0] > 0, kind
        del engine, head
    del model
    assert gpu.live_allocs == 0


def test_the_command_line_names_build_each_kind_and_the_hybrid(shipped, gpu) -> None:
    model = _load(shipped, gpu)
    for kind, cls in CLASSES.items():
        head = make_proposer(kind, model, str(shipped))
        assert type(head).__name__ == cls, kind
        del head
    hybrid = make_proposer("hybrid", model, str(shipped))
    suffix, head = hybrid.members
    # The head whose training measured the longest acceptance comes after suffix decoding.
    assert type(suffix).__name__ == "SuffixDecoding"
    assert type(head).__name__ == "MtpHead"
    assert hybrid.target_layers == LAYERS
    del hybrid, suffix, head, model
    assert gpu.live_allocs == 0


def test_a_kind_not_shipped_or_unknown_is_refused_naming_what_is_shipped(shipped, gpu) -> None:
    with pytest.raises(ValueError, match="no draft head kind 'medusa'; kinds: mtp, eagle3"):
        heads.default_head_for(shipped, "medusa")
    (Path(heads._root()) / "tiny-eagle3" / "config.json").unlink()
    with pytest.raises(
        ValueError,
        match=rf"no shipped eagle3 draft head was trained for {TARGET_FILE}; "
        rf"shipped: tiny-dflash \(dflash, for {TARGET_FILE}\), tiny-mtp \(mtp",
    ):
        heads.default_head_for(shipped, "eagle3")
    model = _load(shipped, gpu)
    with pytest.raises(ValueError, match="no shipped eagle3 draft head"):
        make_proposer("eagle3", model, str(shipped))
    del model
    assert gpu.live_allocs == 0


def test_the_hybrid_takes_the_head_that_measured_the_longest_acceptance(shipped, gpu) -> None:
    root = Path(heads._root())
    assert heads.measured_acceptance("tiny-eagle3") == 1.4
    assert heads.measured_acceptance("tiny-dflash") is None
    assert heads.best_head_for(shipped) == "tiny-mtp"
    _ship(root / "tiny-eagle3", 1.9)
    assert heads.best_head_for(shipped) == "tiny-eagle3"
    model = _load(shipped, gpu)
    hybrid = hybrid_for(model, str(shipped))
    assert type(hybrid.members[1]).__name__ == "Eagle3Head"
    del hybrid
    # A tie goes to the kind listed first; a head without a report comes last.
    _ship(root / "tiny-mtp", 1.9)
    assert heads.best_head_for(shipped) == "tiny-mtp"
    (root / "tiny-mtp" / "config.json").unlink()
    (root / "tiny-eagle3" / "config.json").unlink()
    assert heads.best_head_for(shipped) == "tiny-dflash"
    (root / "tiny-dflash" / "config.json").unlink()
    with pytest.raises(ValueError, match=f"no shipped draft head was trained for {TARGET_FILE}"):
        heads.best_head_for(shipped)
    with pytest.raises(ValueError, match="no shipped draft head was trained"):
        hybrid_for(model, str(shipped))
    del model
    assert gpu.live_allocs == 0
