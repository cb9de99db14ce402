"""``specdraft.Hybrid`` from Python: made of Rust and Python members, it passes
``check_proposer``; in the engine (a tiny llama GGUF and an MTP head loaded beside it) greedy
output is plain greedy output, the winner of each step is the first member with drafts (and,
by default, no worse measured odds than the later ones), a Python member sees every token of
its sequence, and a raising member fails its sequence with
an error naming it; bad arguments are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import specdraft
import test_mtp_head
from specdraft import DraftProposer

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from test_engine import VOCAB as TINY_VOCAB  # noqa: E402
from test_engine import _load, write_tiny_chat_gguf  # noqa: E402

H, VOCAB = test_mtp_head.H, test_mtp_head.VOCAB


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hybrid") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


class Seen(DraftProposer):
    """Drafts nothing; records every token it is told, as a retrieval drafter must."""

    def __init__(self) -> None:
        self.histories: list[list[int]] = []

    def alloc_state(self, gpu):
        return {"history": [], "pending": []}

    def prefill_drafter(self, prompt_tokens, hiddens, state, ctx, stream):
        state["history"] = list(prompt_tokens)
        return 0

    def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw):
        del state["history"][position:]
        state["history"].append(last_token)
        return []

    def after_verify(self, num_accepted, state, stream):
        pass

    def free_state(self, gpu, state):
        self.histories.append(list(state["history"]))


class Scripted(Seen):
    """Drafts the true continuation (looked up in ``fulls`` by its history), its first token
    changed when ``wrong``; counts the steps its drafts were returned (``wins``)."""

    def __init__(self, fulls: list[list[int]], wrong: bool) -> None:
        super().__init__()
        self.fulls, self.wrong, self.drafted = fulls, wrong, []

    def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw):
        super().propose(last_token, target_hidden, position, num_drafts, state, ctx, stream)
        history = state["history"]
        full = next(f for f in self.fulls if f[: len(history)] == history)
        drafts = full[position + 1 : position + 1 + num_drafts]
        if self.wrong and drafts:
            drafts[0] = (drafts[0] + 1) % TINY_VOCAB
        self.drafted.append(drafts)
        return drafts


class Raising(Seen):
    """Raises from position 20 on."""

    def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw):
        if position >= 20:
            raise RuntimeError(f"boom at position {position}")
        return super().propose(
            last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw
        )


def test_suffix_and_an_mtp_head_pass_the_conformance_check(tmp_path, gpu) -> None:
    folder = test_mtp_head.write_checkpoint(tmp_path / "c", "deepseek_v3")
    head = specdraft.MtpHead.from_checkpoint(folder, gpu)
    suffix = specdraft.SuffixDecoding()
    for layers in (None, 3):
        hybrid = specdraft.Hybrid([suffix, head], target_layers=layers)
        assert hybrid.members == [suffix, head]
        assert hybrid.members[1] is head and hybrid.min_drafts == [1, 1]
        assert hybrid.choice == "measured"
        assert hybrid.target_layers == layers
        # With the target's layer count it asks for the last layer's capture.
        assert hybrid.target_layer_ids() == ([] if layers is None else [2])
        report = specdraft.check_proposer(hybrid, gpu=gpu, vocab_size=VOCAB, hidden_size=H)
        assert report.ok, report.violations
    assert "Hybrid([" in repr(hybrid) and "target_layers=3" in repr(hybrid)
    del hybrid, head


def test_a_python_member_passes_the_check_and_keeps_its_history() -> None:
    seen = Seen()
    hybrid = specdraft.Hybrid([seen, specdraft.PromptLookup()], min_drafts=[1, 2])
    report = specdraft.check_proposer(hybrid)
    assert report.ok, report.violations
    assert hybrid.min_drafts == [1, 2] and seen.histories


def test_a_batch_reports_the_confidences_of_each_sequences_winner(
    gpu: specdraft.CpuBackend, ctx: specdraft.ForwardContext
) -> None:
    # The Python member drafts nothing, so prompt lookup wins wherever it matches; the
    # hybrid then reports exactly what prompt lookup reports, and nothing where no one drafts.
    hybrid = specdraft.Hybrid([Seen(), specdraft.PromptLookup()])
    lookup = specdraft.PromptLookup()
    histories = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7, 9, 8], [7, 6, 5, 4]]
    answers = []
    for proposer in (hybrid, lookup):
        states = [proposer.alloc_state(gpu) for _ in histories]
        for h, st in zip(histories, states, strict=True):
            proposer.prefill_drafter(h[:-1], specdraft.DevicePtr.NULL, st, ctx)
        conf: list[list[float]] = []
        drafts = proposer.propose_batch(
            [h[-1] for h in histories],
            [specdraft.DevicePtr.NULL] * len(histories),
            [len(h) - 1 for h in histories],
            3,
            states,
            ctx,
            out_conf=conf,
        )
        answers.append((drafts, conf))
        for st in states:
            proposer.after_verify(0, st, 0)
            proposer.free_state(gpu, st)
    (h_drafts, h_conf), (l_drafts, l_conf) = answers
    assert h_drafts == l_drafts and h_drafts[0] and h_drafts[1] and not h_drafts[2]
    assert h_conf == l_conf and all(h_conf[:2]) and h_conf[2] == []


def _head_beside(tmp_path: Path, model) -> specdraft.MtpHead:  # noqa: ANN001
    # The checkpoint's vocabulary must be the target's.
    mp = pytest.MonkeyPatch()
    mp.setattr(test_mtp_head, "VOCAB", TINY_VOCAB)
    try:
        folder = test_mtp_head.write_checkpoint(tmp_path / "head", "deepseek_v3")
    finally:
        mp.undo()
    return specdraft.MtpHead.from_checkpoint(folder, model.gpu, target=model)


PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [40, 41, 42, 43, 44, 40, 41],
    [99, 3, 3, 4, 3, 3],
]


def test_in_the_engine_output_is_plain_output_and_members_see_every_token(
    tmp_path, model_path, gpu
) -> None:
    model = _load(model_path, gpu)
    plain = specdraft.SpecEngine(model).generate(PROMPTS, max_tokens=24, ignore_eos=True)
    fulls = [p + list(r.tokens) for p, r in zip(PROMPTS, plain, strict=True)]
    head = _head_beside(tmp_path, model)
    seen = Seen()
    hybrid = specdraft.Hybrid([specdraft.SuffixDecoding(), seen, head])
    # Loaded beside the model, the head gives the target's layer count: exact catch-up.
    assert hybrid.target_layers == model.config.num_hidden_layers
    assert hybrid.target_layer_ids() == [model.config.num_hidden_layers - 1]
    engine = specdraft.SpecEngine(model, hybrid, num_drafts=3, draft_policy="fixed")
    result = engine.generate(PROMPTS, max_tokens=24, ignore_eos=True)
    for r, full in zip(result, fulls, strict=True):
        assert r.error is None, r.error
        assert list(r.tokens) == full[-24:]
    # The Python member never drafts, yet its history is its sequence's (but for the last
    # step's accepted drafts, which no later propose brings, and the last token).
    assert len(seen.histories) == len(PROMPTS)
    for h in seen.histories:
        full = next(f for f in fulls if f[:3] == h[:3])
        assert h == full[: len(h)] and len(h) >= len(full) - 4, (h, full)
    assert engine.last_metrics["accepted"] > 0
    del engine, hybrid, head, model


@pytest.mark.parametrize("choice", ["measured", "first"])
def test_a_first_member_that_misses_yields_to_a_later_one_unless_the_order_is_fixed(
    model_path, gpu, choice: str
) -> None:
    model = _load(model_path, gpu)
    prompt = PROMPTS[1]
    (plain,) = specdraft.SpecEngine(model).generate([prompt], max_tokens=24, ignore_eos=True)
    full = prompt + list(plain.tokens)
    wrong, right = Scripted([full], wrong=True), Scripted([full], wrong=False)
    hybrid = specdraft.Hybrid([wrong, right], target_layers=None, choice=choice)
    assert hybrid.choice == choice and f"choice={choice!r}" in repr(hybrid)
    engine = specdraft.SpecEngine(model, hybrid, num_drafts=3, draft_policy="fixed")
    (r,) = engine.generate([prompt], max_tokens=24, ignore_eos=True)
    assert r.error is None, r.error
    assert list(r.tokens) == list(plain.tokens)
    accepted = engine.last_metrics["accepted"]
    # Each member drafts only when asked for drafts; the later member is asked only on the
    # steps the first one lost.
    first_drafted = sum(1 for d in wrong.drafted if d)
    later_drafted = sum(1 for d in right.drafted if d)
    if choice == "first":
        assert accepted == 0 and later_drafted == 0 and first_drafted > 3
    else:
        # The first step goes to the first member (nothing measured yet), every later one to
        # the member that is right.
        assert first_drafted - later_drafted == 1, (wrong.drafted, right.drafted)
        assert later_drafted > 3 and accepted > 0
    del engine, hybrid, model


class Forked(Seen):
    """Grows a tree of two siblings, a wrong token then the true next one (looked up in
    ``fulls`` by its history); records each accepted path it is told, and keeps the
    accepted tokens in its history."""

    def __init__(self, fulls: list[list[int]]) -> None:
        super().__init__()
        self.fulls, self.paths = fulls, []

    def grows_trees(self):
        return True

    def propose_tree(self, last_token, target_hidden, position, budget, state, ctx, stream, **kw):
        self.propose(last_token, target_hidden, position, 0, state, ctx, stream)
        history = state["history"]
        full = next(f for f in self.fulls if f[: len(history)] == history)
        if budget < 2 or position + 1 >= len(full):
            return [], []
        right = full[position + 1]
        state["pending"] = [(right + 1) % TINY_VOCAB, right]
        return state["pending"], [-1, -1]

    def after_verify_tree(self, path, state, stream):
        # A winner is told its accepted nodes, and keeps them in its history.
        self.paths.append(list(path))
        state["history"].extend(state["pending"][i] for i in path)


def test_members_that_grow_trees_make_the_hybrid_grow_them(tmp_path, model_path, gpu) -> None:
    model = _load(model_path, gpu)
    plain = specdraft.SpecEngine(model).generate(PROMPTS, max_tokens=24, ignore_eos=True)
    fulls = [p + list(r.tokens) for p, r in zip(PROMPTS, plain, strict=True)]
    assert not specdraft.Hybrid([specdraft.SuffixDecoding(), Seen()]).grows_trees()
    head = _head_beside(tmp_path, model)
    head.set_grow_trees(True)
    suffix = specdraft.SuffixDecoding(trees=True)
    for members in ([suffix, head], [Forked(fulls), head]):
        hybrid = specdraft.Hybrid(members)
        assert hybrid.grows_trees()
        engine = specdraft.SpecEngine(model, hybrid, num_drafts=4, draft_policy="fixed")
        result = engine.generate(PROMPTS, max_tokens=24, ignore_eos=True)
        for r, full in zip(result, fulls, strict=True):
            assert r.error is None, r.error
            assert list(r.tokens) == full[-24:]
        assert engine.last_metrics["accepted"] > 0
    # The first member's two siblings won each step: its second node was accepted, and the
    # hybrid told it that path.
    forked = members[0]
    assert forked.paths and all(p == [1] for p in forked.paths), forked.paths
    del engine, hybrid, head, model


def test_a_raising_member_fails_its_sequence_naming_it(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    hybrid = specdraft.Hybrid([specdraft.PromptLookup(), Raising()])
    engine = specdraft.SpecEngine(model, hybrid, num_drafts=3)
    result = engine.generate(PROMPTS, max_tokens=24, ignore_eos=True)
    for r in result:
        assert isinstance(r.error, specdraft.ProposerError), r.error
        assert "hybrid member 1 (Raising) failed" in str(r.error), r.error
        assert "boom at position 20" in str(r.error), r.error
    del engine, hybrid, model


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(specdraft.ProposerError, match="at least one member"):
        specdraft.Hybrid([])
    with pytest.raises(TypeError, match="expected a proposer"):
        specdraft.Hybrid([specdraft.PromptLookup(), object()])
    with pytest.raises(ValueError, match="2 members but 1 min_drafts"):
        specdraft.Hybrid([specdraft.PromptLookup(), Seen()], min_drafts=[1])
    with pytest.raises(
        specdraft.ProposerError, match=r"member 0 \(PromptLookup\) has min_drafts 0"
    ):
        specdraft.Hybrid([specdraft.PromptLookup()], min_drafts=[0])
    with pytest.raises(ValueError, match='choice "best": expected "measured" or "first"'):
        specdraft.Hybrid([specdraft.PromptLookup()], choice="best")
