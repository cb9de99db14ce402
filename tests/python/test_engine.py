"""``specdraft.SpecEngine`` from Python on a tiny llama GGUF (written here, with a byte-level
tokenizer and a chat template in its metadata): greedy speculative output equals plain
greedy output for Rust and Python proposers, a raising proposer ends only its sequence,
grammar-constrained output, conversations, and the ``specdraft bench`` / ``generate``
commands end to end."""

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
from ngram_proposer import PyLookup  # noqa: E402
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


def _load(model_path: Path, gpu: specdraft.CpuBackend) -> specdraft.TargetModel:
    # Loaded inside each test (not in a fixture, which pytest keeps alive past the backend
    # fixture's check that nothing is left allocated).
    return specdraft.load_model(model_path, gpu=gpu, max_rows=64, max_seq_len=256, kv_blocks=128)


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
    assert "propose" in results[1].error and "boom at position" in results[1].error
    assert "Traceback" in results[1].error
    assert base[1][: len(results[1].tokens)] == list(results[1].tokens)
    for i in (0, 2):
        assert results[i].error is None and list(results[i].tokens) == base[i]


def test_bad_input_is_reported_per_prompt_or_raised(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup())
    too_long, fine = engine.generate([[1] * 256, [1, 2, 3]], max_tokens=4)
    assert too_long.finish_reason == "error" and "context holds 256" in too_long.error
    assert fine.error is None and len(fine.tokens) >= 1
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([[1, 2]], temperature=-1.0)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(["text without a tokenizer"])
    with pytest.raises(TypeError, match="TargetModel"):
        specdraft.SpecEngine(object())
    with pytest.raises(TypeError, match="DraftProposer"):
        specdraft.SpecEngine(model, object())


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


def test_text_prompts_chat_and_conversation(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    from specdraft.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    assert tok.eos_token_id == EOS and tok.decode(tok.encode("héllo, wörld")) == "héllo, wörld"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(chat)[0] == 257  # a special token encodes to one id
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup(), tokenizer=tok)
    (r,) = engine.generate([chat], max_tokens=8)
    assert r.text == tok.decode(list(r.tokens))
    conv = engine.conversation()
    first = conv.send(chat, max_tokens=8)
    second = conv.send(tok.encode("<|im_start|>user\nmore<|im_end|>\n"), max_tokens=8)
    history = conv.history
    assert history[-len(second.tokens) :] == list(second.tokens)
    # The second turn equals a fresh generation over the whole history.
    prompt2 = history[: len(history) - len(second.tokens)]
    assert list(first.tokens) == list(r.tokens)
    (fresh,) = engine.generate([prompt2], max_tokens=8)
    assert list(fresh.tokens) == list(second.tokens)
    conv.reset()
    assert conv.history == []


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
        "prompt-lookup",
        "--proposer",
        f"{__name__}:PyLookup",
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
    assert "[baseline] 2/2 prompts" in out.err
    code = _cli("bench", *common, "--prompts", "1", "--max-tokens", "6")
    out = capsys.readouterr()
    assert code == 0 and "speedup" in out.out and "prompt-lookup" in out.out
    code = _cli("generate", *common, "--prompt", "hello", "--max-tokens", "5")
    out = capsys.readouterr()
    assert code == 0 and "tokens (" in out.err
    assert _cli("bench", *common, "--proposer", "no.such.module:X") == 2
    assert "cannot import" in capsys.readouterr().err


def test_llguidance_grammar_constrains_the_real_engine(model_path, gpu) -> None:
    pytest.importorskip("llguidance")
    from specdraft.grammar import Grammar
    from specdraft.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    model = _load(model_path, gpu)
    engine = specdraft.SpecEngine(model, PyRandom(), num_drafts=3, tokenizer=tok)
    number = Grammar.regex(tok, r"[0-9]{3}-[a-c]{2}")
    chat = tok.apply_chat_template([{"role": "user", "content": "a code?"}])
    results = engine.generate([chat, chat], max_tokens=20, temperature=1.0, grammar=number)
    for r in results:
        assert r.error is None, r.error
        text = tok.decode([t for t in r.tokens if t != EOS])
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
