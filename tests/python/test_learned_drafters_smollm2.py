"""Greedy speculative output with the learned drafters equals plain greedy output on the real
default model, SmolLM2-135M-Instruct (Q4_1 GGUF): a random `Eagle3Head` and a random
`DFlashHead` of SmolLM2's shape (hidden 576, 9 query heads on 3 KV heads, vocabulary 49152,
taps inside its 30 layers), and `Hybrid([SuffixDecoding(), head])` of each, on a prompt the
suffix drafter can copy from and on an open one. Every drafter must have drafted, and the
hybrid's copied drafts must be accepted, so verification took both paths. The checkpoints
are written by the writers the heads' own tests use, in the published layouts. Slow.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import specdraft
from specdraft.models import fetch_default_model

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

_HERE = Path(__file__).resolve().parent


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


eagle3_tests = _module("test_eagle3_head")
dflash_tests = _module("test_dflash_head")

# SmolLM2-135M's shape (read from the model below and checked there).
HIDDEN, HEADS, KV_HEADS, VOCAB, LAYERS = 576, 9, 3, 49152, 30
PASSAGE = (
    "The Rhine begins in the Swiss Alps and flows north through Germany to the North Sea. "
    "Cities such as Basel, Cologne and Rotterdam grew along its banks."
)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2() -> specdraft.TargetModel:
    model = specdraft.load_model(fetch_default_model(), max_rows=64, max_seq_len=512, kv_blocks=64)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        HIDDEN,
        HEADS,
        KV_HEADS,
    )
    assert (cfg.vocab_size, cfg.num_hidden_layers) == (VOCAB, LAYERS)
    return model


def _prompts(model: specdraft.TargetModel) -> list[list[int]]:
    tok = model.tokenizer
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
        ),
        tok.apply_chat_template([{"role": "user", "content": "Tell me a story about a fox."}]),
    ]


def _heads(model: specdraft.TargetModel, folder: Path) -> dict[str, specdraft.DraftProposer]:
    """A random EAGLE-3 head (speculators layout, vLLM's default aux layers, a draft
    vocabulary of 40 ids mapped through `d2t`, the target's embedding shared) and a random
    DFlash head (two layers, taps 1 and 27, blocks of 4, the last id its mask token)."""
    e = eagle3_tests.write_checkpoint(
        folder / "eagle3",
        "speculators",
        aux=None,
        embed=False,
        vocab=VOCAB,
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=KV_HEADS,
    )
    d = dflash_tests.write_checkpoint(
        folder / "dflash",
        block_size=4,
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        ffn=1536,
        vocab=VOCAB,
        target_layers=LAYERS,
        taps=(1, 27),
    )
    small = {"max_seq_len": 512, "main_kv_blocks": 64}
    eagle3 = specdraft.Eagle3Head.from_checkpoint(e, model.gpu, target=model, **small)
    dflash = specdraft.DFlashHead.from_checkpoint(d, model.gpu, target=model, **small)
    assert eagle3.target_layer_ids() == [1, 14, 26]
    assert dflash.target_layer_ids() == [1, 27]
    return {"eagle3": eagle3, "dflash": dflash}


@pytest.mark.slow
def test_greedy_output_with_learned_drafters_equals_plain_on_smollm2(smollm2, tmp_path) -> None:
    model = smollm2
    prompts = _prompts(model)
    plain = specdraft.SpecEngine(model).generate(prompts, max_tokens=MAX_TOKENS)
    for r in plain:
        assert r.error is None, r.error
    assert "Rhine" in plain[0].text, plain[0].text
    heads = _heads(model, tmp_path)
    proposers = dict(heads)
    for name, head in heads.items():
        proposers[f"hybrid({name})"] = specdraft.Hybrid(
            [specdraft.SuffixDecoding(), head], target_layers=LAYERS
        )
    for name, proposer in proposers.items():
        engine = specdraft.SpecEngine(model, proposer, num_drafts=3, draft_policy="fixed")
        results = engine.generate(prompts, max_tokens=MAX_TOKENS)
        for i, (r, want) in enumerate(zip(results, plain, strict=True)):
            assert r.error is None, (name, i, r.error)
            assert list(r.tokens) == list(want.tokens), (name, i)
        metrics = engine.last_metrics
        assert metrics["drafted"] > 0, (name, metrics)
        if name.startswith("hybrid"):
            # The copied passage is drafted by the suffix member and accepted.
            assert metrics["accepted"] > 0, (name, metrics)
        del engine
    # A hybrid whose members grow trees verifies the winner's tree each step.
    heads["eagle3"].set_grow_trees(True)
    hybrid = specdraft.Hybrid(
        [specdraft.SuffixDecoding(trees=True), heads["eagle3"]], target_layers=LAYERS
    )
    engine = specdraft.SpecEngine(model, hybrid, num_drafts=3, draft_policy="fixed")
    assert engine.drafts_trees
    results = engine.generate(prompts, max_tokens=MAX_TOKENS)
    for i, (r, want) in enumerate(zip(results, plain, strict=True)):
        assert r.error is None, ("hybrid trees", i, r.error)
        assert list(r.tokens) == list(want.tokens), ("hybrid trees", i)
    assert engine.last_metrics["accepted"] > 0, engine.last_metrics
    del engine, hybrid
