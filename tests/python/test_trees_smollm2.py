"""Greedy decoding with draft trees equals plain greedy decoding on SmolLM2 for every proposer
that grows trees (prompt lookup, suffix decoding, and the shipped MTP and EAGLE-3 heads), at
batch 1, 4, 8 and 16: a tree step changes which rows are verified and how the accepted path's
KV is compacted, never the tokens. Slow: runs the real model on the CPU backend."""

from __future__ import annotations

from typing import Any

import pytest
import specdraft

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow

TOKENS = 16
WIDTHS = (1, 4, 8, 16)
# Eight passages to repeat (grounded: lookups and suffixes find them) and eight open
# questions, so the batches mix drafts that are accepted with drafts that are not.
PASSAGES = (
    "The Rhine rises in the Swiss Alps and flows north to the North Sea.",
    "Bread is made of flour, water, salt and yeast, kneaded and left to rise.",
    "A leap year has 366 days; February then has 29 days instead of 28.",
    "Copper conducts electricity well, which is why wires are made of it.",
    "The heart pumps blood through arteries, and veins carry it back.",
    "Honey bees collect nectar from flowers and turn it into honey.",
    "A triangle's angles always add up to one hundred and eighty degrees.",
    "Tea leaves are picked, withered, rolled and dried before they are sold.",
)
QUESTIONS = (
    "Write a short poem about rivers.",
    "Why do cats purr?",
    "Give me three ideas for a rainy afternoon.",
    "What makes a good friend?",
    "Describe the smell of the sea.",
    "How would you explain snow to a child?",
    "Name a few uses for an old newspaper.",
    "What is your favourite season, and why?",
)


def _tokens(results: Any) -> list[list[int]]:  # noqa: ANN401 - GenerateResult list
    for r in results:
        assert r.error is None, r.error
    return [list(r.tokens) for r in results]


def test_every_tree_proposer_keeps_plain_greedy_output_at_every_batch_width() -> None:
    from specdraft.models import fetch_default_model

    model = specdraft.load_model(
        fetch_default_model(), max_rows=128, max_seq_len=256, kv_blocks=192
    )
    tok = model.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        for text in [f"Repeat this sentence: {p}" for p in PASSAGES] + list(QUESTIONS)
    ]
    assert len(prompts) == max(WIDTHS)
    plain = specdraft.SpecEngine(model, max_batch=1)
    base = _tokens(plain.generate(prompts, max_tokens=TOKENS, ignore_eos=True))
    mtp = specdraft.load_draft_head("smollm2-mtp", model)
    eagle3 = specdraft.load_draft_head("smollm2-eagle3", model)
    for head in (mtp, eagle3):
        head.set_grow_trees(True)
    proposers = {
        "prompt lookup": specdraft.PromptLookup(trees=True),
        "suffix": specdraft.SuffixDecoding(trees=True),
        "mtp": mtp,
        "eagle3": eagle3,
    }
    for name, proposer in proposers.items():
        for width in WIDTHS:
            # Fixed: every step drafts its whole budget, whatever the measured costs say.
            engine = specdraft.SpecEngine(
                model, proposer, num_drafts=4, draft_policy="fixed", max_batch=width
            )
            assert engine.drafts_trees, name
            results = engine.generate(prompts, max_tokens=TOKENS, ignore_eos=True)
            assert _tokens(results) == base, f"{name} at batch {width}"
            accepted = sum(r.metrics["accepted"] for r in results)
            assert accepted > 0, f"{name} at batch {width}: no draft accepted"
    del mtp, eagle3, proposers
    del model
