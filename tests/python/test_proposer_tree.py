"""``propose_tree`` from Python: a proposer's own tree comes back into Rust as it drew it and
passes ``check_proposer``; each kind of malformed tree is refused with what was wrong; a
proposer that does not define it gets ``propose``'s chain without Python being asked for a
tree."""

from __future__ import annotations

import gc
import re
import sys
from typing import Any

import pytest
import specdraft
from ngram_proposer import PyLookup
from specdraft import DevicePtr, PromptLookup, ProposerError
from specdraft.testing import as_rust


def allowed(mask: Any, t: int) -> bool:
    """Whether the grammar bitmask ``mask`` allows token ``t`` (no mask allows all)."""
    return mask is None or bool((int(mask[t // 32]) >> (t % 32)) & 1)


class TreeLookup(PyLookup):
    """PyLookup's history, drafted as a tree: two roots (the next allowed ids after the last
    token), a child under the second root and a grandchild under that, with probabilities.
    ``flaw`` names one way to break the tree's contract."""

    def __init__(self, flaw: str | None = None) -> None:
        super().__init__()
        self.flaw = flaw

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
        vocab = ctx.config.vocab_size
        tokens: list[int] = []
        parents: list[int] = []
        t = last_token
        for parent in [-1, -1, 1, 2][:budget]:
            t = next(
                (
                    c
                    for c in ((t + k) % vocab for k in range(1, vocab))
                    if allowed(grammar_bitmask, c)
                ),
                None,
            )
            if t is None:
                break
            tokens.append(t)
            parents.append(parent)
        probs = [0.5] * len(tokens)
        last = len(tokens) - 1
        if self.flaw == "own parent":
            parents[last] = last
        elif self.flaw == "over budget":
            tokens += [0] * (budget + 1 - len(tokens))
            parents += [-1] * (len(tokens) - len(parents))
            probs += [0.1] * (len(tokens) - len(probs))
        elif self.flaw == "out of vocab":
            tokens[last] = vocab
        elif self.flaw == "bad prob":
            probs[last] = 1.5
        elif self.flaw == "short parents":
            parents.pop()
        elif self.flaw == "not a tuple":
            return tokens
        elif self.flaw == "ignores mask" and grammar_bitmask is not None:
            tokens[last] = next(c for c in range(vocab) if not allowed(grammar_bitmask, c))
        return tokens, parents, probs


def test_a_python_tree_passes_check_proposer():
    report = specdraft.check_proposer(TreeLookup())
    assert report.ok, str(report)
    assert "propose_tree" in report.checks_run


def test_a_python_tree_reaches_rust_as_drawn(gpu, ctx):
    rust = as_rust(TreeLookup())
    assert "propose_tree" in rust.python_methods
    st = rust.alloc_state(gpu)
    tree = rust.propose_tree(7, DevicePtr.NULL, 3, 4, st, ctx)
    assert tree == ([8, 9, 10, 11], [-1, -1, 1, 2], [0.5, 0.5, 0.5, 0.5])
    # A budget of 2 keeps the two roots.
    assert rust.propose_tree(7, DevicePtr.NULL, 3, 2, st, ctx)[:2] == ([8, 9], [-1, -1])
    rust.free_state(gpu, st)


@pytest.mark.parametrize(
    ("flaw", "words"),
    [
        ("own parent", "a tree with node 3's parent 3, which does not come before it"),
        ("over budget", "a tree with 5 nodes, over the budget of 4"),
        ("short parents", "a tree with 3 parents for 4 tokens"),
        ("not a tuple", "4 items, expected a (tokens, parents)"),
    ],
)
def test_rust_refuses_a_malformed_python_tree(gpu, ctx, flaw, words):
    rust = as_rust(TreeLookup(flaw))
    st = rust.alloc_state(gpu)
    with pytest.raises(ProposerError, match=re.escape(f"propose_tree returned {words}")):
        rust.propose_tree(7, DevicePtr.NULL, 3, 4, st, ctx)
    rust.free_state(gpu, st)


@pytest.mark.parametrize(
    ("flaw", "check", "words"),
    [
        ("own parent", "propose_tree", "node 3's parent 3, which does not come before it"),
        ("over budget", "propose_tree", "5 nodes, over the budget of 4"),
        ("out of vocab", "propose_tree", "outside the vocabulary of 64"),
        ("bad prob", "propose_tree", "probability 1.5, outside [0, 1]"),
        ("short parents", "propose_tree", "3 parents for 4 tokens"),
        ("not a tuple", "propose_tree", "expected a (tokens, parents)"),
        ("ignores mask", "propose_tree: grammar mask", "which the grammar_bitmask forbids"),
    ],
)
def test_each_malformed_tree_is_named(flaw, check, words):
    report = specdraft.check_proposer(TreeLookup(flaw))
    assert not report.ok
    hits = [v for v in report.violations if v.check == check and words in v.message]
    assert hits, str(report)
    assert hits[0].fix


def python_calls_during(fn):
    """Python-level function names called while ``fn`` runs (calls from Rust included)."""
    seen: list[str] = []

    def profiler(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    was_enabled = gc.isenabled()
    gc.disable()
    sys.setprofile(profiler)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
        if was_enabled:
            gc.enable()
    return result, seen


def test_without_its_own_tree_a_python_proposer_gets_its_proposes_chain(gpu, ctx):
    rust = as_rust(PyLookup())
    assert "propose_tree" not in rust.python_methods
    st = rust.alloc_state(gpu)
    rust.prefill_drafter([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1], DevicePtr.NULL, st, ctx)
    tree, seen = python_calls_during(lambda: rust.propose_tree(2, DevicePtr.NULL, 11, 4, st, ctx))
    assert tree == ([3, 4, 5, 1], [-1, 0, 1, 2])
    assert seen.count("propose") == 1 and "propose_tree" not in seen, seen
    rust.free_state(gpu, st)


def test_a_rust_proposers_tree_does_not_enter_python(gpu, ctx):
    p = PromptLookup()
    st = p.alloc_state(gpu)
    p.prefill_drafter([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1], DevicePtr.NULL, st, ctx)
    tree, seen = python_calls_during(lambda: p.propose_tree(2, DevicePtr.NULL, 11, 4, st, ctx))
    assert tree == ([3, 4, 5, 1], [-1, 0, 1, 2])
    assert set(seen) <= {"<lambda>"}, seen
    p.free_state(gpu, st)


def test_the_base_propose_tree_is_the_chain_of_the_classs_propose(gpu, ctx):
    p = PyLookup()
    st = p.alloc_state(gpu)
    p.prefill_drafter([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1], DevicePtr.NULL, st, ctx, 0)
    assert p.propose_tree(2, DevicePtr.NULL, 11, 3, st, ctx) == ([3, 4, 5], [-1, 0, 1])


class BatchedTreeLookup(TreeLookup):
    """TreeLookup that also batches: ``propose_batch`` and ``propose_tree_batch`` answer
    what the per-sequence methods answer, counting the tree batches. ``batch_flaw`` names
    one way to break ``propose_tree_batch``'s contract."""

    def __init__(self, batch_flaw: str | None = None) -> None:
        super().__init__()
        self.batch_flaw = batch_flaw
        self.tree_batches = 0

    def propose_batch_max(self, buffers, config):
        return 4

    def propose_batch(
        self, last_tokens, target_hiddens, positions, num_drafts, states, ctx, stream=0, **_
    ):
        return [
            self.propose(t, h, p, num_drafts, s, ctx, stream)
            for t, h, p, s in zip(last_tokens, target_hiddens, positions, states, strict=True)
        ]

    def propose_tree_batch(
        self, last_tokens, target_hiddens, positions, budget, states, ctx, stream=0
    ):
        self.tree_batches += 1
        trees = [
            self.propose_tree(t, h, p, budget, s, ctx, stream)
            for t, h, p, s in zip(last_tokens, target_hiddens, positions, states, strict=True)
        ]
        if self.batch_flaw == "one tree short":
            trees.pop()
        elif self.batch_flaw == "a node over the budget":
            tokens, parents, probs = trees[1]
            trees[1] = (tokens + [0], parents + [-1], probs + [0.5])
        return trees


def test_a_python_tree_batch_reaches_rust_as_drawn_and_passes_check_proposer(gpu, ctx):
    p = BatchedTreeLookup()
    rust = as_rust(p)
    assert "propose_tree_batch" in rust.python_methods
    states = [rust.alloc_state(gpu) for _ in range(2)]
    trees = rust.propose_tree_batch([7, 20], [DevicePtr.NULL] * 2, [3, 3], 4, states, ctx)
    assert trees == [
        ([8, 9, 10, 11], [-1, -1, 1, 2], [0.5] * 4),
        ([21, 22, 23, 24], [-1, -1, 1, 2], [0.5] * 4),
    ]
    for st in states:
        rust.free_state(gpu, st)
    report = specdraft.check_proposer(BatchedTreeLookup())
    assert report.ok, str(report)
    assert "propose_tree_batch" in report.checks_run


class TreeBatchOnly(TreeLookup):
    """TreeLookup with ``propose_tree_batch`` but no ``propose_batch``: chains one at a
    time, trees in batches."""

    def propose_batch_max(self, buffers, config):
        return 4

    def propose_tree_batch(
        self, last_tokens, target_hiddens, positions, budget, states, ctx, stream=0
    ):
        return [
            self.propose_tree(t, h, p, budget, s, ctx, stream)
            for t, h, p, s in zip(last_tokens, target_hiddens, positions, states, strict=True)
        ]


def test_tree_batches_are_checked_without_chain_batches():
    report = specdraft.check_proposer(TreeBatchOnly())
    assert report.ok, str(report)
    assert "propose_tree_batch" in report.checks_run


@pytest.mark.parametrize(
    ("flaw", "words"),
    [
        ("one tree short", "1 trees for 2 sequences"),
        ("a node over the budget", "for sequence 1: a tree with 5 nodes, over the budget of 4"),
    ],
)
def test_rust_refuses_a_malformed_python_tree_batch(gpu, ctx, flaw, words):
    rust = as_rust(BatchedTreeLookup(flaw))
    states = [rust.alloc_state(gpu) for _ in range(2)]
    with pytest.raises(ProposerError, match=re.escape(f"propose_tree_batch returned {words}")):
        rust.propose_tree_batch([7, 20], [DevicePtr.NULL] * 2, [3, 3], 4, states, ctx)
    for st in states:
        rust.free_state(gpu, st)
    report = specdraft.check_proposer(BatchedTreeLookup(flaw))
    assert any(v.check == "propose_tree_batch" for v in report.violations), str(report)


def test_a_proposer_with_its_own_tree_but_no_tree_batch_is_asked_per_sequence(gpu, ctx):
    rust = as_rust(TreeLookup())
    states = [rust.alloc_state(gpu) for _ in range(2)]
    got, seen = python_calls_during(
        lambda: rust.propose_tree_batch([7, 20], [DevicePtr.NULL] * 2, [3, 3], 4, states, ctx)
    )
    assert got is None and "propose_tree" not in seen, seen
    # The base class says the same of a subclass that overrides propose_tree.
    assert TreeLookup().propose_tree_batch([7], [DevicePtr.NULL], [3], 4, states[:1], ctx) is None
    for st in states:
        rust.free_state(gpu, st)
