"""Extraction of the target's hiddens under a time limit, and the count of tokens trained.

``extract_train`` stops before the next sequence once its deadline has passed (a fake
clock makes the cut exact); what it cached stays cached, and a later call goes on from
there so that the files equal one uninterrupted extraction byte for byte.
``extract_replies`` caches each prompt followed by the target's reply, batch by batch,
within its token budget, cut to the sequence length, its drafts starting at the reply.
``Batches.tokens_in`` counts the sequences' own tokens in the first steps' batches,
checked against the ``valid`` masks of the batches themselves. ``tokenize_conversations``
finds where each conversation's first reply starts, and the cache and the batches carry it.
"""

from __future__ import annotations

import numpy as np
import pytest
from specdraft.train import targets
from specdraft.train.cache import HiddenCache
from specdraft.train.data import Conversation, TokenizedConversation

HIDDEN = 8
LENGTHS = [5, 9, 3, 12, 7]


class _Clock:
    """A monotonic clock that moves only when the fake model runs a forward."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Model:
    """Deterministic 'hiddens' (a function of the tokens); each forward costs one second."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.calls = 0

    def hidden_states(self, tokens: list[int]) -> np.ndarray:
        self.calls += 1
        self.clock.now += 1.0
        t = np.asarray(tokens, np.float32)[:, None]
        return (t * 0.5 + np.arange(HIDDEN, dtype=np.float32)[None, :]).astype(np.float32)


def _seqs() -> list[TokenizedConversation]:
    rng = np.random.default_rng(1)
    return [
        TokenizedConversation("synthetic", str(i), rng.integers(0, 500, n).tolist())
        for i, n in enumerate(LENGTHS)
    ]


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(targets.time, "monotonic", c)
    return c


def _files(cache: HiddenCache) -> tuple[bytes, bytes, list]:
    return (
        (cache.folder / "tokens.u32").read_bytes(),
        (cache.folder / "hiddens.bf16").read_bytes(),
        [(s.corpus, s.id, s.split, s.offset, s.length) for s in cache.sequences],
    )


def test_a_passed_deadline_caches_nothing(tmp_path, clock):
    model = _Model(clock)
    cache = HiddenCache(tmp_path / "c", "fake", HIDDEN)
    assert targets.extract_train(model, cache, _seqs(), deadline=clock.now) == 0
    assert model.calls == 0
    assert cache.tokens == 0


def test_the_deadline_cuts_between_sequences_and_a_later_call_goes_on(tmp_path, clock):
    whole = HiddenCache(tmp_path / "whole", "fake", HIDDEN)
    assert targets.extract_train(_Model(clock), whole, _seqs()) == sum(LENGTHS)

    model = _Model(clock)
    cut = HiddenCache(tmp_path / "cut", "fake", HIDDEN)
    # Forwards take one second each: before the third, 2 s have passed, past 1.5 s.
    got = targets.extract_train(model, cut, _seqs(), deadline=clock.now + 1.5)
    assert (got, model.calls) == (LENGTHS[0] + LENGTHS[1], 2)
    assert [s.id for s in cut.sequences] == ["0", "1"]
    # Reopened (as a new run would), the cache resumes with the rest, no sequence twice.
    reopened = HiddenCache(tmp_path / "cut", "fake", HIDDEN)
    assert targets.extract_train(model, reopened, _seqs()) == sum(LENGTHS[2:])
    assert model.calls == len(LENGTHS)
    assert _files(reopened) == _files(whole)


def test_tokens_in_counts_the_valid_tokens_of_the_first_steps(tmp_path):
    pytest.importorskip("jax")
    from specdraft.train.trainer import Batches, TrainSettings

    cache = HiddenCache(tmp_path / "c", "fake", HIDDEN)
    rng = np.random.default_rng(2)
    lengths = [5, 40, 17, 64, 3, 90]
    for i, n in enumerate(lengths):
        cache.append("s", str(i), "train", rng.integers(0, 50, n).tolist(), np.zeros((n, HIDDEN)))
    # seq_len 64 cuts the 90-token sequence; two epochs of three batches of two.
    settings = TrainSettings(epochs=2, batch=2, seq_len=64, width_step=16)
    batches = Batches(cache, settings)
    for steps in range(2 * batches.per_epoch + 1):
        valid = sum(int(batches.batch(s)[2].sum()) for s in range(steps))
        assert batches.tokens_in(steps) == valid
    assert batches.tokens_in(batches.per_epoch) == sum(min(n, 64) for n in lengths)


class _Tokenizer:
    """A chat template of ``<role>content``, one id per byte."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def _reply(prompt: list[int], n: int) -> list[int]:
    """A deterministic 'greedy reply': 30 ids after a prompt, at most ``n``."""
    return [(sum(prompt) + 7 * i) % 251 for i in range(min(30, n))]


def _chats() -> list[Conversation]:
    user = ["hi", "tell me more", "x" * 200, "why?", "ok then", "and", "so", "yes"]
    return [
        Conversation(
            "synth", str(i), [{"role": "user", "content": u}, {"role": "assistant", "content": "A"}]
        )
        for i, u in enumerate(user)
    ]


def test_replies_are_the_prompt_then_the_targets_continuation(tmp_path, clock):
    calls: list[list[list[int]]] = []

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        calls.append(prompts)
        return [_reply(p, n) for p in prompts]

    tok, model = _Tokenizer(), _Model(clock)
    cache = HiddenCache(tmp_path / "c", "fake", HIDDEN)
    got = targets.extract_replies(generate, model, tok, cache, _chats(), 64, 20, 10_000, batch=3)
    # The 200-byte prompt leaves no room in 64 positions and is passed over.
    kept = [c for c in _chats() if len(targets.eval_prompt(tok, c)) + 16 <= 64]
    assert len(kept) == len(_chats()) - 1
    assert [len(b) for b in calls] == [3, 3, 1]
    ids, _ = cache.open_arrays()
    assert got == cache.tokens
    assert len(cache.sequences) == len(kept)
    for conv, s in zip(kept, cache.sequences, strict=True):
        prompt = targets.eval_prompt(tok, conv)
        want = (prompt + _reply(prompt, 20))[:64]
        assert (s.corpus, s.id, s.split) == (
            "synth" + targets.REPLY_CORPUS_SUFFIX,
            conv.id,
            "train",
        )
        assert ids[s.offset : s.offset + s.length].tolist() == want
        assert s.start == len(prompt)
    # Everything is cached: a second call generates nothing.
    assert targets.extract_replies(generate, model, tok, cache, _chats(), 64, 20, 10_000) == 0
    assert len(calls) == 3


def test_replies_stop_at_the_token_budget_and_the_deadline(tmp_path, clock):
    tok = _Tokenizer()

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        return [_reply(p, n) for p in prompts]

    cache = HiddenCache(tmp_path / "budget", "fake", HIDDEN)
    first = targets.extract_replies(
        generate, _Model(clock), tok, cache, _chats(), 64, 20, 50, batch=2
    )
    # Batches of two: the budget of 50 is passed within the first batch, so one batch runs.
    assert len(cache.sequences) == 2 and first == cache.tokens >= 50
    cache = HiddenCache(tmp_path / "deadline", "fake", HIDDEN)
    got = targets.extract_replies(
        generate, _Model(clock), tok, cache, _chats(), 64, 20, 10_000, batch=2, deadline=clock.now
    )
    assert got == 0 and cache.tokens == 0


def test_a_conversation_is_learned_from_its_first_reply_on(tmp_path, clock):
    """Teacher-forced corpus text: the reply starts where the first assistant turn's content
    does (after the template's own markup, also when the conversation opens with it), the
    cache lists that start, and each batch row carries it to the loss."""
    pytest.importorskip("jax")
    from specdraft.train.data import tokenize_conversations
    from specdraft.train.trainer import Batches, TrainSettings

    def conv(i: int, *turns: tuple[str, str]) -> Conversation:
        return Conversation("synth", str(i), [{"role": r, "content": c} for r, c in turns])

    convs = [
        conv(
            0, ("user", "hi"), ("assistant", "hello there"), ("user", "more"), ("assistant", "ok")
        ),
        conv(1, ("assistant", "I open"), ("user", "fine"), ("assistant", "good")),
        conv(2, ("system", "be brief"), ("user", "q"), ("assistant", "a reply")),
        # Replies that begin two ids and one id before the 40-id cut: the second has no
        # base position with a draft after it, and is dropped.
        conv(3, ("user", "x" * 21), ("assistant", "late")),
        conv(4, ("user", "x" * 22), ("assistant", "late")),
    ]
    tok = _Tokenizer()
    seqs = tokenize_conversations(tok, convs, 40, 10_000, min_len=1)
    assert [s.id for s in seqs] == ["0", "1", "2", "3"]
    assert [s.start for s in seqs] == [
        len("<user>hi<assistant>"),
        len("<assistant>"),
        len("<system>be brief<user>q<assistant>"),
        38,
    ]
    for s, c in zip(seqs, convs, strict=False):
        text = tok.apply_chat_template(c.messages, add_generation_prompt=False)
        assert s.tokens == tok.encode(text)[:40]
    cache = HiddenCache(tmp_path / "c", "fake", HIDDEN)
    targets.extract_train(_Model(clock), cache, seqs)
    assert [(s.id, s.start) for s in cache.sequences] == [(s.id, s.start) for s in seqs]
    batches = Batches(cache, TrainSettings(batch=4, seq_len=40, width_step=8))
    batch = batches.batch(0)
    order = batches.order(0)
    assert batch.start.tolist() == [seqs[int(i)].start for i in order]
