"""Python proposers driven from Rust: conformance, error reporting, dispatch, PromptLookup."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import specdraft
from ngram_proposer import PyLookup
from specdraft import DevicePtr, DraftProposer, PromptLookup, ProposerError
from specdraft.testing import as_rust, time_propose

VOCAB = 64  # check_proposer's default vocabulary


def test_python_proposer_passes_check_proposer():
    report = specdraft.check_proposer(PyLookup())
    assert report.ok, str(report)
    assert report.proposer == "PyLookup"
    assert "propose" in " ".join(report.checks_run)
    assert report.violations == []


def test_check_proposer_on_the_users_backend_leaves_nothing_live(gpu):
    report = specdraft.check_proposer(PyLookup(), gpu=gpu, num_sequences=2, steps=4)
    assert report.ok, str(report)


class Boom(PyLookup):
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
        return self.helper_that_fails(position)

    def helper_that_fails(self, position):
        raise ValueError(f"no drafts at position {position}")


def one_violation(proposer, check_prefix):
    report = specdraft.check_proposer(proposer)
    assert not report.ok
    hits = [v for v in report.violations if v.check.startswith(check_prefix)]
    assert hits, str(report)
    return hits[0].message


def test_exception_in_propose_is_reported_with_method_class_and_traceback():
    msg = one_violation(Boom(), "propose")
    assert "propose of Python proposer Boom" in msg
    assert "Traceback (most recent call last)" in msg
    assert "helper_that_fails" in msg and "test_proposers.py" in msg
    assert "ValueError: no drafts at position" in msg


def test_exception_reaches_python_as_proposer_error_with_traceback(gpu, ctx):
    rust = as_rust(Boom())
    st = rust.alloc_state(gpu)
    with pytest.raises(
        ProposerError,
        match=r"(?s)propose of Python proposer Boom: Traceback.*"
        r"helper_that_fails.*ValueError",
    ):
        rust.propose(3, DevicePtr.NULL, 0, 4, st, ctx)
    rust.free_state(gpu, st)


def returning(value):
    class Garbage(PyLookup):
        def propose(self, *args, **kwargs):
            return value

    return Garbage()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("abc", "propose returned 'abc' (str), expected a list of token ids"),
        ([1, -2], "propose returned a negative token id -2 at index 1"),
        (list(range(7)), "propose returned 7 ids but num_drafts is 4"),
        (
            [5, VOCAB],
            f"propose returned token id {VOCAB} at index 1, outside the vocabulary of {VOCAB}",
        ),
        ([1.5], "propose returned 1.5 (float) at index 0, expected an int token id"),
        (None, "propose returned None (NoneType), expected a list of token ids"),
    ],
)
def test_garbage_from_propose_is_reported_saying_what_came_back(value, expected):
    msg = one_violation(returning(value), "propose")
    assert expected in msg, msg


def test_numpy_arrays_and_tuples_are_accepted_as_drafts(gpu, ctx):
    for value in (np.array([1, 2], dtype=np.int64), (1, 2)):
        rust = as_rust(returning(value))
        st = rust.alloc_state(gpu)
        assert rust.propose(0, DevicePtr.NULL, 0, 4, st, ctx) == [1, 2]


class Leaky(PyLookup):
    def alloc_state(self, gpu):
        state = super().alloc_state(gpu)
        state["scratch"] = gpu.alloc(96, tag="leaky-scratch")
        return state


def test_device_memory_not_freed_in_free_state_is_reported_as_a_leak_with_its_tag():
    msg = one_violation(Leaky(), "free_state")
    assert 'tagged "leaky-scratch"' in msg and "96 bytes" in msg


class Tidy(Leaky):
    def free_state(self, gpu, state):
        gpu.free(state.pop("scratch"))


def test_freeing_in_free_state_passes():
    report = specdraft.check_proposer(Tidy())
    assert report.ok, str(report)


class Stateless(DraftProposer):
    """Drafts the last token again; keeps nothing per sequence, so its state is None."""

    def alloc_state(self, gpu):
        return None

    def propose(
        self,
        last_token,
        target_hidden,
        position,
        num_drafts,
        state,
        ctx,
        stream,
        grammar_bitmask=None,
        **kw,
    ):
        assert state is None
        if (
            grammar_bitmask is not None
            and not (grammar_bitmask[last_token // 32] >> (last_token % 32)) & 1
        ):
            return []
        return [last_token] * num_drafts

    def after_verify(self, num_accepted, state, stream):
        assert state is None


def test_a_proposer_without_state_may_return_none_from_alloc_state(gpu, ctx):
    report = specdraft.check_proposer(Stateless())
    assert report.ok, str(report)
    rust = as_rust(Stateless())
    st = rust.alloc_state(gpu)  # opaque here; the proposer's own methods receive None
    assert rust.propose(7, DevicePtr.NULL, 3, 2, st, ctx) == [7, 7]
    rust.after_verify(1, st)
    rust.free_state(gpu, st)


def test_missing_required_method_is_refused_at_wrap_time():
    class NoPropose(DraftProposer):
        def alloc_state(self, gpu):
            return {}

        def after_verify(self, num_accepted, state, stream):
            pass

    with pytest.raises(ProposerError, match="NoPropose does not define propose"):
        specdraft.check_proposer(NoPropose())
    with pytest.raises(TypeError, match="DraftProposer subclass"):
        specdraft.check_proposer(object())


class Counting(PyLookup):
    def __init__(self):
        super().__init__()
        self.calls = []

    def block_gamma(self):
        self.calls.append("block_gamma")
        return 3


def python_calls_during(fn):
    """Python-level function calls made while `fn` runs (Rust calls into Python included)."""
    seen = []

    def profiler(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    # The garbage collector's callbacks (jax installs one when a training test imported it)
    # are Python calls the proposer did not make: keep the collector off while counting.
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


def test_only_overridden_methods_call_python():
    p = Counting()
    rust = as_rust(p)
    assert rust.python_methods == [
        "alloc_state",
        "propose",
        "after_verify",
        "block_gamma",
        "prefill_drafter",
    ]
    cfg = specdraft.ModelConfig.tiny(VOCAB)
    value, seen = python_calls_during(lambda: rust.propose_batch_max(specdraft.BufferArena(8), cfg))
    assert value == 1
    assert seen == [] or set(seen) <= {"<lambda>"}, seen
    for method, args, default in [
        ("needs_comm", (), False),
        ("prefill_hidden_rows", (4096,), 4096),
        ("prefill_uses_shared_buffers", (), False),
        ("circuit_draft", (cfg, specdraft.ModelLevers()), None),
    ]:
        value, seen = python_calls_during(lambda m=method, a=args: getattr(rust, m)(*a))
        assert value == default and set(seen) <= {"<lambda>"}, (method, seen)
    # The positive control: an overridden method is called, exactly once per call.
    value, seen = python_calls_during(rust.block_gamma)
    assert value == 3 and seen.count("block_gamma") == 1 and p.calls == ["block_gamma"]


def test_failure_in_an_infallible_method_is_unraisable_and_falls_back(monkeypatch):
    class BadGamma(PyLookup):
        def block_gamma(self):
            return "seven"

    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    assert as_rust(BadGamma()).block_gamma() is None
    assert len(reports) == 1
    assert "block_gamma returned 'seven' (str), expected a non-negative int" in str(
        reports[0].exc_value
    )


def test_users_backend_reaches_the_proposer_as_the_same_object(gpu):
    seen = []

    class Spy(PyLookup):
        def alloc_state(self, gpu_arg):
            seen.append(gpu_arg)
            return super().alloc_state(gpu_arg)

    rust = as_rust(Spy())
    st = rust.alloc_state(gpu)
    assert seen[0] is gpu
    rust.free_state(gpu, st)


def test_a_lent_backend_handle_refuses_use_after_the_call():
    kept = []

    class Keeper(PyLookup):
        def alloc_state(self, gpu):
            kept.append(gpu)
            return super().alloc_state(gpu)

    assert specdraft.check_proposer(Keeper()).ok
    with pytest.raises(specdraft.BackendUnavailableError, match="no longer valid"):
        kept[0].alloc(8)


REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def lookup_drafts(proposer, gpu, ctx, history, num_drafts=4):
    st = proposer.alloc_state(gpu)
    proposer.prefill_drafter(history[:-1], DevicePtr.NULL, st, ctx)
    drafts = proposer.propose(history[-1], DevicePtr.NULL, len(history) - 1, num_drafts, st, ctx)
    proposer.free_state(gpu, st)
    return drafts


def test_prompt_lookup_drafts_the_true_continuation(gpu, ctx):
    pl = PromptLookup()
    assert lookup_drafts(pl, gpu, ctx, REPEATING) == [7, 8, 9, 5]
    assert lookup_drafts(pl, gpu, ctx, list(range(10, 30))) == []
    assert pl.lookup(REPEATING, 2) == [7, 8]
    assert specdraft.check_proposer(pl).ok


def test_prompt_lookup_argument_errors():
    with pytest.raises(ProposerError, match="min_ngram <= max_ngram"):
        PromptLookup(min_ngram=3, max_ngram=2)


def test_prompt_lookup_state_is_opaque_and_checked(gpu, ctx):
    pl = PromptLookup()
    st = pl.alloc_state(gpu)
    assert isinstance(st, specdraft.ProposerState)
    with pytest.raises(ProposerError, match="not a PromptLookupState"):
        pl.propose(1, DevicePtr.NULL, 0, 4, {"not": "mine"}, ctx)
    with pytest.raises(ProposerError, match="outside the vocabulary of 256"):
        pl.propose(999, DevicePtr.NULL, 0, 4, st, ctx)


class EvenOnly(PromptLookup):
    """PromptLookup with one method overridden: drafts cut at the first odd token."""

    def propose(
        self,
        last_token,
        target_hidden,
        position,
        num_drafts,
        state,
        ctx,
        stream=0,
        draft_embed_target=None,
        grammar_bitmask=None,
        target_hidden_stack=None,
    ):
        drafts = super().propose(
            last_token,
            target_hidden,
            position,
            num_drafts,
            state,
            ctx,
            stream,
            draft_embed_target=draft_embed_target,
            grammar_bitmask=grammar_bitmask,
            target_hidden_stack=target_hidden_stack,
        )
        out = []
        for t in drafts:
            if t % 2:
                break
            out.append(t)
        return out


def test_python_subclass_of_prompt_lookup_overrides_one_method(gpu, ctx):
    p = EvenOnly()
    rust = as_rust(p)
    assert rust.python_methods == ["propose"]
    history = [2, 4, 6, 7, 2, 4]
    # Rust prefill (not overridden) feeds the state the Python propose reads through super().
    assert lookup_drafts(rust, gpu, ctx, history) == [6]
    # "2 4" matches two tokens, which earns two drafts.
    assert lookup_drafts(PromptLookup(), gpu, ctx, history) == [6, 7]
    # The batched Rust path would bypass the Python propose, so the adapter declines it.
    cfg = specdraft.ModelConfig.tiny(256)
    assert rust.propose_batch_max(specdraft.BufferArena(8), cfg) == 1
    assert PromptLookup().propose_batch_max(specdraft.BufferArena(8), cfg) > 1
    st = rust.alloc_state(gpu)
    assert rust.propose_batch([1], [DevicePtr.NULL], [0], 4, [st], ctx) is None
    rust.free_state(gpu, st)
    assert specdraft.check_proposer(p).ok


def test_rust_proposer_batch_from_python_matches_single_proposes(gpu, ctx):
    pl = PromptLookup()
    states = [pl.alloc_state(gpu) for _ in range(2)]
    pl.prefill_drafter(REPEATING[:-1], DevicePtr.NULL, states[0], ctx)
    pl.prefill_drafter([1, 2, 3, 1], DevicePtr.NULL, states[1], ctx)
    conf = []
    drafts = pl.propose_batch(
        [REPEATING[-1], 2],
        [DevicePtr.NULL] * 2,
        [len(REPEATING) - 1, 4],
        3,
        states,
        ctx,
        out_conf=conf,
    )
    # The second history matches two tokens ("1 2"), which earns two drafts.
    assert drafts == [[7, 8, 9], [3, 1]]
    # Each draft carries matched / (matched + 1): the first occurrence matches 7 tokens
    # ("5 6 7 8 9 5 6", counted back past the 4-gram), the second 2.
    assert conf[0] == [7 / 8] * 3
    assert conf[1] == pytest.approx([2 / 3] * 2, abs=1e-6)
    with pytest.raises(ProposerError, match="already in use"):
        pl.propose_batch([1, 1], [DevicePtr.NULL] * 2, [0, 0], 3, [states[0]] * 2, ctx)


def test_grammar_mask_reaches_python_as_int32_words(gpu, ctx):
    got = []

    class MaskSpy(PyLookup):
        def propose(self, *args, grammar_bitmask=None, **kwargs):
            got.append(grammar_bitmask)
            return []

    rust = as_rust(MaskSpy())
    st = rust.alloc_state(gpu)
    mask = np.zeros(8, dtype=np.uint32)
    mask[0] = 0xFFFFFFFF
    rust.propose(1, DevicePtr.NULL, 0, 4, st, ctx, grammar_bitmask=mask)
    rust.propose(1, DevicePtr.NULL, 0, 4, st, ctx)
    assert got[0].dtype == np.int32 and got[0][0] == -1 and len(got[0]) == 8
    assert got[1] is None


def test_forward_context_kept_past_the_call_stays_usable(gpu):
    kept = []

    class Keep(PyLookup):
        def propose(
            self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kwargs
        ):
            kept.append(ctx)
            return []

    assert specdraft.check_proposer(Keep()).ok
    ctx = kept[-1]
    assert ctx.config.vocab_size == VOCAB
    p = ctx.gpu.alloc(8)
    ctx.gpu.free(p)


def test_rust_work_runs_with_the_interpreter_released():
    import threading

    started = threading.Event()
    done = threading.Event()

    def work():
        started.set()
        time_propose(PromptLookup(), iters=400_000)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    progress = 0
    while not done.is_set():
        progress += 1
    t.join()
    # With the interpreter held for the whole Rust loop this thread could not run at all.
    assert progress > 1000, progress


class Batched(PyLookup):
    """Overrides the batch methods: drafts `[last + 1]` for each sequence."""

    def __init__(self, rows_returned=None):
        super().__init__()
        self.rows_returned = rows_returned

    def propose_batch(
        self,
        last_tokens,
        target_hiddens,
        positions,
        num_drafts,
        states,
        ctx,
        stream,
        out_conf=None,
    ):
        assert all(isinstance(h, DevicePtr) for h in target_hiddens)
        drafts = [[t + 1] for t in last_tokens]
        if out_conf is not None:
            out_conf.extend([[0.5] for _ in drafts])
        return drafts if self.rows_returned is None else drafts[: self.rows_returned]

    def propose_batch_max(self, buffers, config):
        return 8

    def take_drafter_kv(self, state):
        return ([3, 4], 20, 19)

    def catchup_batch(self, tokens, hiddens, first_pos, states, ctx, stream):
        assert all(isinstance(h, DevicePtr) for row in hiddens for h in row)
        return sum(len(t) for t in tokens)


def test_python_batch_methods_are_called_and_checked(gpu, ctx):
    rust = as_rust(Batched())
    states = [rust.alloc_state(gpu) for _ in range(2)]
    conf = []
    hid = [DevicePtr(0x10), DevicePtr(0x20)]
    assert rust.propose_batch([1, 5], hid, [0, 0], 4, states, ctx, out_conf=conf) == [[2], [6]]
    assert conf == [[0.5], [0.5]]
    assert rust.propose_batch_max(specdraft.BufferArena(4), ctx.config) == 8
    assert rust.take_drafter_kv(states[0]) == ([3, 4], 20, 19)
    assert rust.catchup_batch([[1, 2], [3]], [hid, hid[:1]], [4, 9], states, ctx) == 3
    short = as_rust(Batched(rows_returned=1))
    with pytest.raises(ProposerError, match="propose_batch returned 1 lists of drafts for 2"):
        short.propose_batch([1, 5], hid, [0, 0], 4, states, ctx)


def test_bad_take_drafter_kv_is_unraisable_and_means_none(monkeypatch, gpu):
    class BadTake(PyLookup):
        def take_drafter_kv(self, state):
            return ([1], 2)

    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    rust = as_rust(BadTake())
    st = rust.alloc_state(gpu)
    assert rust.take_drafter_kv(st) is None
    assert "take_drafter_kv returned 2 items" in str(reports[0].exc_value)
