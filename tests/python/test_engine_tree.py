"""Draft trees through ``specdraft.SpecEngine`` (greedy): a Python proposer's tree whose second
branch is the target's continuation is accepted through that branch (its chain accepts
nothing), its ``after_verify_tree`` is told that path, and the output is plain greedy output;
a sampled sequence verifies its tree too, reproducibly by seed; ``draft_shape`` is checked and
reported; on SmolLM2 (slow) prompt lookup's and suffix
decoding's trees give plain greedy output on open and grounded prompts, trees and chains alike,
and so does that second branch, whose accepted rows move in the KV at every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import specdraft
from specdraft import DraftProposer

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from tiny_gguf import write_tiny_llama  # noqa: E402

VOCAB = 260
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    [99, 3, 3, 4, 3, 3],
    [40, 41, 42, 43, 44, 40, 41],
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engine_tree") / "tiny.gguf"
    write_tiny_llama(path, vocab=VOCAB, seed=3, context_length=2048)
    return path


def _load(model_path: Path, gpu: specdraft.Backend) -> specdraft.TargetModel:
    return specdraft.load_model(model_path, gpu=gpu, max_rows=64, max_seq_len=256, kv_blocks=128)


class SecondBranch(DraftProposer):
    """Knows each prompt's plain greedy continuation: drafts ``[wrong, t0, t1, ..]`` with the
    wrong token and ``t0`` both children of the last token and ``t(k+1)`` under ``t(k)``; its
    chain (``propose``) is the first branch, so a chain accepts nothing."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]]) -> None:
        self.truth = truth
        self.paths: list[list[int]] = []

    def alloc_state(self, gpu):
        return {"full": []}

    def prefill_drafter(self, prompt_tokens, hiddens, state, ctx, stream):
        state["full"] = self.truth[tuple(prompt_tokens)]
        return 0

    def _tree(self, state, position, budget):
        full = state["full"]

        def nxt(k: int) -> int:
            return full[position + 1 + k] if position + 1 + k < len(full) else 0

        if budget == 0:
            return [], []
        tokens = [(nxt(0) + 1) % VOCAB] + [nxt(k) for k in range(budget - 1)]
        parents = [-1, -1] + list(range(1, budget - 1))
        return tokens, parents[:budget]

    def propose(
        self,
        last_token,
        target_hidden,
        position,
        num_drafts,
        state,
        ctx,
        stream,
        draft_embed_target=None,
        grammar_bitmask=None,
        target_hidden_stack=None,
    ):
        return self._tree(state, position, num_drafts)[0]

    def propose_tree(
        self,
        last_token,
        target_hidden,
        position,
        budget,
        state,
        ctx,
        stream,
        draft_embed_target=None,
        grammar_bitmask=None,
        target_hidden_stack=None,
    ):
        return self._tree(state, position, budget)

    def after_verify(self, num_accepted, state, stream):
        pass

    def after_verify_tree(self, path, state, stream):
        self.paths.append(list(path))


def _tokens(results) -> list[list[int]]:
    for r in results:
        assert r.error is None, r.error
    return [list(r.tokens) for r in results]


def test_a_python_tree_is_accepted_through_its_second_branch(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    base = _tokens(specdraft.SpecEngine(model).generate(PROMPTS, max_tokens=20, ignore_eos=True))
    truth = {tuple(p): p + b for p, b in zip(PROMPTS, base, strict=True)}
    tree = SecondBranch(truth)
    engine = specdraft.SpecEngine(model, tree, num_drafts=4, draft_policy="fixed")
    assert engine.draft_shape == "tree" and engine.drafts_trees
    results = engine.generate(PROMPTS, max_tokens=20, ignore_eos=True)
    assert _tokens(results) == base
    assert sum(r.metrics["accepted"] for r in results) >= 3 * len(PROMPTS)
    assert tree.paths and all(p == list(range(1, len(p) + 1)) for p in tree.paths), tree.paths
    chain = specdraft.SpecEngine(
        model, SecondBranch(truth), num_drafts=4, draft_policy="fixed", draft_shape="chain"
    )
    assert chain.draft_shape == "chain" and not chain.drafts_trees
    results = chain.generate(PROMPTS, max_tokens=20, ignore_eos=True)
    assert _tokens(results) == base
    assert sum(r.metrics["accepted"] for r in results) == 0


def test_a_sampled_sequence_verifies_its_tree_reproducibly_by_seed(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    base = _tokens(specdraft.SpecEngine(model).generate(PROMPTS, max_tokens=20, ignore_eos=True))
    truth = {tuple(p): p + b for p, b in zip(PROMPTS, base, strict=True)}
    runs = []
    for _ in range(2):
        tree = SecondBranch(truth)
        engine = specdraft.SpecEngine(model, tree, num_drafts=4, draft_policy="fixed")
        # Nearly greedy: the target's continuation, the second branch, is mostly accepted.
        results = engine.generate(PROMPTS, max_tokens=20, temperature=0.05, seed=7, ignore_eos=True)
        runs.append(_tokens(results))
        # The sampled steps were verified as trees, through the second branch.
        assert any(p and p[0] == 1 for p in tree.paths), tree.paths
        assert sum(r.metrics["accepted"] for r in results) >= len(PROMPTS)
    assert runs[0] == runs[1], "the same seed gives the same tokens"


def test_draft_shape_is_checked_and_a_chain_proposer_grows_no_tree(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    with pytest.raises(specdraft.RequestError, match="draft_shape"):
        specdraft.SpecEngine(model, specdraft.PromptLookup(), draft_shape="bush")
    assert not specdraft.PromptLookup().grows_trees()
    assert not specdraft.SpecEngine(model, specdraft.PromptLookup()).drafts_trees
    assert specdraft.PromptLookup(trees=True).grows_trees()
    assert specdraft.SpecEngine(model, specdraft.PromptLookup(trees=True)).drafts_trees
    assert not specdraft.SuffixDecoding().grows_trees()
    suffix = specdraft.SuffixDecoding(trees=True)
    assert suffix.trees and suffix.grows_trees() and "trees=True" in repr(suffix)
    assert specdraft.SpecEngine(model, suffix).drafts_trees
    # A Python proposer with its own propose and no propose_tree drafts chains.
    from ngram_proposer import PyLookup

    assert not PyLookup().grows_trees()
    assert not specdraft.SpecEngine(model, PyLookup()).drafts_trees


@pytest.mark.slow
def test_lookup_and_suffix_trees_give_plain_greedy_output_on_smollm2() -> None:
    from specdraft.models import fetch_default_model

    model = specdraft.load_model(fetch_default_model(), max_rows=64, max_seq_len=512, kv_blocks=64)
    tok = model.tokenizer
    passage = (
        "The Rhine begins in the Swiss Alps and flows north through Germany to the North Sea. "
        "Cities such as Basel, Cologne and Rotterdam grew along its banks, and Basel's bridges "
        "cross the Rhine where Basel meets the Rhine's bend."
    )
    chats = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"Repeat this passage:\n\n{passage}"}]
        ),
        tok.apply_chat_template([{"role": "user", "content": "Write a short poem about rivers."}]),
    ]
    base = _tokens(specdraft.SpecEngine(model).generate(chats, max_tokens=48))
    for shape in ("tree", "chain"):
        for proposer in (
            specdraft.PromptLookup(trees=True),
            specdraft.SuffixDecoding(trees=True),
        ):
            # Fixed: every step drafts, whatever the measured costs say on a busy machine.
            engine = specdraft.SpecEngine(
                model, proposer, num_drafts=4, draft_shape=shape, draft_policy="fixed"
            )
            results = engine.generate(chats, max_tokens=48)
            assert _tokens(results) == base, (shape, proposer)
            # Copying the passage: the drafts are accepted.
            assert results[0].metrics["mean_acceptance_length"] > 1.5, (
                proposer,
                results[0].metrics,
            )
    # Every accepted path runs down a second branch, so its KV rows move at every step.
    ids = [tok.encode(c) for c in chats]
    truth = {tuple(p): p + b for p, b in zip(ids, base, strict=True)}
    tree = SecondBranch(truth)
    engine = specdraft.SpecEngine(model, tree, num_drafts=4, draft_policy="fixed")
    results = engine.generate(ids, max_tokens=48)
    assert _tokens(results) == base
    assert all(r.metrics["mean_acceptance_length"] > 3.0 for r in results), [
        r.metrics for r in results
    ]
