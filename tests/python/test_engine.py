"""``specdraft.SpecEngine`` from Python on a tiny llama GGUF (written here, with a byte-level
tokenizer and a chat template in its metadata): greedy speculative output equals plain
greedy output for Rust and Python proposers, a raising proposer ends only its sequence,
bad requests and failures while running reach Python as their own exception classes,
grammar-constrained output, text and chat messages through the model's own tokenizer,
conversations, and the ``specdraft bench`` / ``generate`` commands end to end."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft import DraftProposer

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from ngram_proposer import CarryingLookup, PyLookup  # noqa: E402
from tiny_gguf import write_tiny_llama  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
VOCAB = 256 + len(SPECIALS)
EOS = 258
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: the byte-level BPE alphabet, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def write_tiny_chat_gguf(path: Path, seed: int = 3) -> None:
    """A random tiny llama with a byte-level BPE tokenizer (no merges) and a chat template."""

    def tokenizer(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(_byte_chars() + SPECIALS)
        w.add_token_types([1] * 256 + [3] * len(SPECIALS))
        w.add_token_merges([])
        w.add_bos_token_id(257)
        w.add_eos_token_id(EOS)
        w.add_chat_template(TEMPLATE)

    write_tiny_llama(path, vocab=VOCAB, seed=seed, context_length=2048, metadata=tokenizer)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engine") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


def _load(model_path: Path, gpu: specdraft.Backend, **kw) -> specdraft.TargetModel:
    # Loaded inside each test (not in a fixture, which pytest keeps alive past the backend
    # fixture's check that nothing is left allocated).
    opts = {"max_rows": 64, "max_seq_len": 256, "kv_blocks": 128, **kw}
    return specdraft.load_model(model_path, gpu=gpu, **opts)


class PyRandom(DraftProposer):
    """Drafts random ids: almost never accepted, never allowed to change the output."""

    def alloc_state(self, gpu):
        return random.Random(7)

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
        return [state.randrange(VOCAB) for _ in range(num_drafts)]

    def after_verify(self, num_accepted, state, stream):
        pass


class Raising(PyLookup):
    """Fails once a sequence whose prompt starts with token 99 reaches position 12."""

    def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw):
        if state["history"][:1] == [99] and position >= 12:
            raise RuntimeError(f"boom at position {position}")
        return super().propose(
            last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw
        )


PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    [99, 3, 3, 4, 3, 3],
    [40, 41, 42, 43, 44, 40, 41],
]


def _tokens(results):
    for r in results:
        assert r.error is None, r.error
    return [list(r.tokens) for r in results]


def test_greedy_speculative_equals_plain_for_rust_and_python_proposers(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    base = _tokens(specdraft.SpecEngine(model).generate(PROMPTS, max_tokens=24, ignore_eos=True))
    assert all(len(t) == 24 for t in base)
    for proposer in (specdraft.PromptLookup(), PyLookup(), PyRandom()):
        engine = specdraft.SpecEngine(model, proposer, num_drafts=3)
        results = engine.generate(PROMPTS, max_tokens=24, ignore_eos=True)
        assert _tokens(results) == base, type(proposer).__name__
        for r in results:
            m = r.metrics
            assert m["emitted"] == 24
            assert m["decode_tokens"] == 23
            assert m["accepted"] <= m["drafted"]
            assert 1.0 <= m["mean_acceptance_length"] <= 4.0
        # Each prompt alone gives what it gave in the batch.
        alone = engine.generate([PROMPTS[2]], max_tokens=24, ignore_eos=True)
        assert _tokens(alone)[0] == base[2]
    assert engine.last_metrics["emitted"] == 24


def test_a_raising_python_proposer_ends_only_its_sequence(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    base = _tokens(specdraft.SpecEngine(model).generate(PROMPTS, max_tokens=20, ignore_eos=True))
    results = specdraft.SpecEngine(model, Raising(), num_drafts=3).generate(
        PROMPTS, max_tokens=20, ignore_eos=True
    )
    assert results[1].finish_reason == "error"
    error = results[1].error
    assert isinstance(error, specdraft.ProposerError), repr(error)
    assert "request 1: propose failed" in str(error) and "boom at position" in str(error)
    assert "Traceback" in str(error)
    assert isinstance(error.__cause__, specdraft.ProposerError)
    assert "request 1" not in str(error.__cause__)
    assert base[1][: len(results[1].tokens)] == list(results[1].tokens)
    for i in (0, 2):
        assert results[i].error is None and list(results[i].tokens) == base[i]


def test_bad_requests_raise_request_error_before_anything_runs(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup())
    total, free = model.kv_blocks
    for prompts, message in [
        ([[1, 2, 3], [1] * 256], "request 1: the prompt has 256 tokens but the model's context"),
        ([[]], "request 0: the prompt is empty"),
        ([[1, VOCAB]], f"prompt token {VOCAB} at index 1 is outside the vocabulary of {VOCAB}"),
    ]:
        with pytest.raises(specdraft.RequestError, match=message) as caught:
            engine.generate(prompts, max_tokens=4)
        assert isinstance(caught.value, ValueError)
        assert engine.last_metrics is None, "nothing ran"
        del caught  # its traceback holds this frame, and so the model
    with pytest.raises(specdraft.RequestError, match="temperature"):
        engine.generate([[1, 2]], temperature=-1.0)
    with pytest.raises(specdraft.RequestError, match="max_tokens"):
        engine.generate([[1, 2]], max_tokens=0)
    assert model.kv_blocks == (total, free)
    (fine,) = engine.generate([[1, 2, 3]], max_tokens=4)
    assert fine.error is None and len(fine.tokens) >= 1
    with pytest.raises(TypeError, match="TargetModel"):
        specdraft.SpecEngine(object())
    with pytest.raises(TypeError, match="DraftProposer"):
        specdraft.SpecEngine(model, object())


def test_a_request_beyond_the_context_fails_alone_naming_its_numbers(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup())
    prompts = [[1, 2, 3], [1, 2] * 125, [4, 5]]
    alone = engine.generate([prompts[0], prompts[2]], max_tokens=10, ignore_eos=True)
    results = engine.generate(prompts, max_tokens=10, ignore_eos=True)
    bad = results[1]
    assert bad.finish_reason == "error" and list(bad.tokens) == []
    assert isinstance(bad.error, specdraft.RequestError), repr(bad.error)
    message = str(bad.error)
    assert "request 1: the prompt (250 tokens) plus max_tokens (10)" in message, message
    assert "context of 256" in message and "at most 6" in message, message
    assert [list(r.tokens) for r in (results[0], results[2])] == _tokens(alone)
    assert all(r.error is None for r in (results[0], results[2]))


def test_text_without_a_tokenizer_is_a_request_error(tmp_path, gpu) -> None:
    path = tmp_path / "no-tokenizer.gguf"
    write_tiny_llama(path, vocab=VOCAB)
    model = _load(path, gpu)
    assert model.tokenizer is None
    engine = specdraft.SpecEngine(model)
    with pytest.raises(specdraft.RequestError, match="a text prompt needs a tokenizer"):
        engine.generate(["some text"])
    with pytest.raises(specdraft.RequestError, match="chat needs a tokenizer"):
        engine.chat([[{"role": "user", "content": "hi"}]])


def test_out_of_device_memory_during_generate_is_an_allocation_error(model_path) -> None:
    """The engine's own buffers do not fit: the sequence ends with AllocationError, whose
    cause is the backend's own out-of-memory error, and the rest of the call runs on."""
    probe = specdraft.CpuBackend()
    model = _load(model_path, probe)
    loaded = probe.live_bytes
    del model
    # Room for the model and nothing more: the first buffer the engine asks for fails.
    gpu = specdraft.CpuBackend(memory_limit=loaded)
    model = _load(model_path, gpu)
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup(), num_drafts=3)
    results = engine.generate(PROMPTS[:2], max_tokens=8)
    for i, r in enumerate(results):
        assert r.finish_reason == "error"
        assert isinstance(r.error, specdraft.AllocationError), repr(r.error)
        assert f"request {i}: starting the sequence failed: out of device memory" in str(r.error)
        cause = r.error.__cause__
        assert isinstance(cause, specdraft.AllocationError)
        assert str(cause).startswith("out of device memory") and "engine:hidden_rows" in str(cause)
    assert gpu.live_bytes == loaded, "what the failed sequences held is released"
    del engine, model
    assert gpu.live_allocs == 0


def test_a_request_the_kv_pool_can_never_hold_is_an_allocation_error(model_path, gpu) -> None:
    """Two KV blocks (32 positions): a request that would outgrow them fails at once."""
    model = _load(model_path, gpu, kv_blocks=2)
    engine = specdraft.SpecEngine(model, PyLookup(), num_drafts=3)
    (r,) = engine.generate([PROMPTS[0]], max_tokens=60, ignore_eos=True)
    assert r.finish_reason == "error"
    assert r.tokens == [], "it failed before it ran"
    assert isinstance(r.error, specdraft.AllocationError), repr(r.error)
    message = str(r.error)
    assert "request 0: the prompt (7 tokens) plus max_tokens (60)" in message
    assert "66 KV rows" in message and "holds 32" in message
    assert model.kv_blocks == (2, 2)
    del engine, model


def test_sampling_is_reproducible_per_seed(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    engine = specdraft.SpecEngine(model, PyLookup(), num_drafts=3)
    kw = dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    a = _tokens(engine.generate(PROMPTS, **kw))
    assert _tokens(engine.generate(PROMPTS, **kw)) == a
    # Prompt i samples with seed + i, so prompt 2 alone with seed 13 repeats it.
    alone = _tokens(engine.generate([PROMPTS[2]], **{**kw, "seed": 13}))
    assert alone[0] == a[2]


class EvenOnly:
    """A pure-Python grammar: only even token ids, for `limit` tokens, then only EOS."""

    def __init__(self, limit: int) -> None:
        self.limit, self.seen, self.done = limit, [], False

    def fill_mask(self, mask: np.ndarray) -> None:
        allowed = [EOS] if len(self.seen) >= self.limit else range(0, 256, 2)
        for t in allowed:
            mask[t // 32] |= np.int32(np.uint32(1 << (t % 32)).astype(np.int32))

    def advance(self, token: int) -> None:
        ok = token == EOS if len(self.seen) >= self.limit else token % 2 == 0 and token < 256
        if not ok:
            raise ValueError(f"token {token} not allowed")
        self.seen.append(token)
        self.done = token == EOS

    def is_finished(self) -> bool:
        return self.done


def test_grammar_constrains_every_emitted_token(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    plain = specdraft.SpecEngine(model)
    (base,) = plain.generate([PROMPTS[0]], max_tokens=30, grammar=[EvenOnly(10)])
    for proposer in (PyRandom(), PyLookup(), specdraft.PromptLookup()):
        g = EvenOnly(10)
        (r,) = specdraft.SpecEngine(model, proposer, num_drafts=3).generate(
            [PROMPTS[0]], max_tokens=30, grammar=[g]
        )
        assert r.error is None, r.error
        assert list(r.tokens) == g.seen == list(base.tokens)
        assert all(t % 2 == 0 for t in r.tokens[:10]) and r.tokens[10] == EOS
        assert r.finish_reason == "stop"


class Letters:
    """A grammar: lower-case ASCII letters for `limit` tokens, then only EOS (when
    `then_eos`); the tiny tokenizer has no merges, so a letter is one byte token."""

    def __init__(self, limit: int, then_eos: bool = True) -> None:
        self.limit, self.then_eos, self.seen, self.done = limit, then_eos, 0, False

    def allowed(self) -> range | list[int]:
        if self.seen >= self.limit and self.then_eos:
            return [EOS]
        return range(ord("a"), ord("z") + 1)

    def fill_mask(self, mask: np.ndarray) -> None:
        for t in self.allowed():
            mask[t // 32] |= np.int32(np.uint32(1 << (t % 32)).astype(np.int32))

    def advance(self, token: int) -> None:
        if token not in self.allowed():
            raise ValueError(f"token {token} not allowed")
        self.seen += 1
        self.done = token == EOS

    def is_finished(self) -> bool:
        return self.done


class LettersGrammar:
    """A fresh :class:`Letters` matcher per sequence."""

    def __init__(self, limit: int, then_eos: bool = True) -> None:
        self.limit, self.then_eos = limit, then_eos

    def matcher(self) -> Letters:
        return Letters(self.limit, self.then_eos)


def test_text_prompts_use_the_models_own_tokenizer(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    tok = model.tokenizer
    assert isinstance(tok, specdraft.Tokenizer)
    assert tok.eos_token_id == EOS and tok.decode(tok.encode("héllo, wörld")) == "héllo, wörld"
    assert specdraft.load_tokenizer(model_path).encode("a b") == tok.encode("a b")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(chat)[0] == 257  # a special token encodes to one id
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup())
    assert engine.tokenizer is tok
    (r,) = engine.generate(["Hello"], max_tokens=8, grammar=LettersGrammar(3))
    assert r.error is None, r.error
    assert list(r.tokens)[-1] == EOS and r.finish_reason == "stop"
    # The text is the reply's, without the EOS token that ended it.
    assert r.text == tok.decode(list(r.tokens)[:-1]) and len(r.text) == 3 and r.text.isalpha()
    (same,) = engine.generate([tok.encode("Hello")], max_tokens=8, grammar=LettersGrammar(3))
    assert list(same.tokens) == list(r.tokens)


def test_chat_messages_go_through_the_template(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    tok = model.tokenizer
    engine = specdraft.SpecEngine(model, PyLookup(), num_drafts=3)
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "and?"}],
    ]
    results = engine.chat(conversations, max_tokens=10, ignore_eos=True)
    rendered = [tok.encode(tok.apply_chat_template(c)) for c in conversations]
    expected = engine.generate(rendered, max_tokens=10, ignore_eos=True)
    assert [list(r.tokens) for r in results] == [list(r.tokens) for r in expected]
    assert all(r.metrics["prompt_tokens"] == len(p) for r, p in zip(results, rendered, strict=True))
    with pytest.raises(TypeError, match="wrap a single conversation in a list"):
        engine.chat(conversations[0])


def test_conversation_turns_go_through_the_template_and_carry_the_drafter_kv(
    model_path, gpu
) -> None:
    model = _load(model_path, gpu)
    tok = model.tokenizer
    proposer = CarryingLookup()
    engine = specdraft.SpecEngine(model, proposer, num_drafts=3)
    conv = engine.conversation()
    # First reply: letters then EOS (the template's closing "\n" is appended); second:
    # cut by max_tokens (the whole closing "<|im_end|>\n" is appended).
    first = conv.send("hi", max_tokens=12, grammar=LettersGrammar(5))
    assert first.finish_reason == "stop" and len(first.text) == 5
    second = conv.send("more", max_tokens=6, grammar=LettersGrammar(99, then_eos=False))
    assert second.finish_reason == "length" and len(second.text) == 6
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": second.text},
    ]
    assert conv.messages == messages
    # The history is the conversation exactly as the template renders it, turns closed.
    assert conv.history == tok.encode(tok.apply_chat_template(messages, False))
    # The second reply is what a fresh generation over the rendered history gives.
    prompt2 = tok.encode(tok.apply_chat_template(messages[:3]))
    (fresh,) = engine.generate([prompt2], max_tokens=6, grammar=LettersGrammar(99, then_eos=False))
    assert list(fresh.tokens) == list(second.tokens)
    # The drafter KV was carried into the second turn, and every carried row matches the
    # history at its position.
    assert proposer.installed == 1 and conv.carried_rows > 0
    for rows in proposer.snapshots:
        assert rows == conv.history[: len(rows)]
    # Token ids are appended as they are; reset forgets everything and frees the KV.
    ids = tok.encode("\nxyz")
    before = conv.history
    third = conv.send(ids, max_tokens=2, ignore_eos=True)
    assert conv.history == before + ids + list(third.tokens)
    assert conv.messages == messages
    conv.reset()
    assert conv.history == [] and conv.messages == [] and conv.carried_rows == 0
    assert proposer.store == {}


def test_a_bad_turn_raises_and_changes_nothing(model_path, gpu) -> None:
    model = _load(model_path, gpu, max_seq_len=64)
    conv = specdraft.SpecEngine(model, CarryingLookup(), num_drafts=3).conversation()
    conv.send("hi", max_tokens=4, ignore_eos=True)
    history, messages, carried = conv.history, conv.messages, conv.carried_rows
    with pytest.raises(specdraft.RequestError, match="context holds 64"):
        conv.send("x" * 80)
    with pytest.raises(specdraft.RequestError, match=r"max_tokens \(100\).*context of 64"):
        conv.send("again", max_tokens=100)
    with pytest.raises(specdraft.RequestError, match="temperature"):
        conv.send("again", temperature=-2.0)
    assert (conv.history, conv.messages, conv.carried_rows) == (history, messages, carried)


def _cli(*args: str) -> int:
    from specdraft.cli import main

    return main(list(args))


def test_bench_and_generate_commands(model_path, capsys) -> None:
    common = ["--model", str(model_path), "--device", "cpu", "--max-seq-len", "1024"]
    code = _cli(
        "bench",
        *common,
        "--prompts",
        "2",
        "--max-tokens",
        "12",
        "--json",
        "--proposer",
        f"prompt-lookup,{__name__}:PyLookup",
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    names = [r["proposer"] for r in report["results"]]
    assert names == ["baseline", "prompt-lookup", f"{__name__}:PyLookup"]
    assert report["prompts"] == 2
    for r in report["results"][1:]:
        assert r["identical_to_baseline"] is True
        assert r["tokens"] == report["results"][0]["tokens"]
        assert 1.0 <= r["mean_acceptance_length"] <= 5.0
        assert len(r["acceptance_by_position"]) <= 4
    # The first built-in prompts are input-grounded; each kind's figures are reported.
    base_kinds = report["results"][0]["by_kind"]
    assert set(base_kinds) == {"grounded"} and base_kinds["grounded"]["speedup"] == 1.0
    for r in report["results"][1:]:
        assert set(r["by_kind"]) == {"grounded"} and r["by_kind"]["grounded"]["tokens_per_s"] > 0
    assert "pass 1/1, batch 1: 2/2 calls" in out.err
    code = _cli("bench", *common, "--prompts", "1", "--max-tokens", "6")
    out = capsys.readouterr()
    assert code == 0 and "speedup" in out.out and "prompt-lookup" in out.out
    code = _cli("generate", *common, "--prompt", "hello", "--max-tokens", "5")
    out = capsys.readouterr()
    assert code == 0 and "tokens (" in out.err
    small = ["--model", str(model_path), "--device", "cpu", "--max-seq-len", "32"]
    assert _cli("generate", *small, "--prompt", "hello", "--max-tokens", "64") == 1
    err = capsys.readouterr().err
    assert "max_tokens (64)" in err and "beyond the model's context of 32" in err, err
    assert _cli("bench", *common, "--proposer", "no.such.module:X") == 2
    assert "cannot import" in capsys.readouterr().err


def test_llguidance_grammar_constrains_the_real_engine(model_path, gpu) -> None:
    pytest.importorskip("llguidance")
    from specdraft.grammar import Grammar

    model = _load(model_path, gpu)
    tok = model.tokenizer
    engine = specdraft.SpecEngine(model, PyRandom(), num_drafts=3)
    number = Grammar.regex(tok, r"[0-9]{3}-[a-c]{2}")
    chat = tok.apply_chat_template([{"role": "user", "content": "a code?"}])
    results = engine.generate([chat, chat], max_tokens=20, temperature=1.0, grammar=number)
    for r in results:
        assert r.error is None, r.error
        text = r.text
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-", text
        assert set(text[4:]) <= set("abc")
    m = number.matcher()
    assert sorted(m.allowed()) == [tok.encode(str(d))[0] for d in range(10)]
    with pytest.raises(ValueError, match="refused"):
        m.advance(tok.encode("x")[0])
    with pytest.raises(ValueError, match="invalid lark grammar"):
        Grammar.lark(tok, "start: (")
    schema = Grammar.json_schema(tok, {"type": "object", "properties": {"a": {"type": "integer"}}})
    (r,) = engine.generate([chat], max_tokens=40, grammar=schema)
    assert r.error is None, r.error
    if r.finish_reason == "stop":
        json.loads(tok.decode([t for t in r.tokens if t != EOS]))
