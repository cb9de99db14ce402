"""``SpecEngine.stream`` and the scheduler from Python on the tiny chat GGUF of
``test_engine``: streamed tokens and text add up to the results, text deltas never split a
multi-byte character, a consumer that raises (or closes early) leaves no KV block held,
and a KV pool that holds only a few sequences queues the rest instead of failing them."""

from __future__ import annotations

from pathlib import Path

import pytest
import specdraft

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from test_engine import PyRandom, write_tiny_chat_gguf  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


def _load(model_path: Path, gpu: specdraft.Backend, **kw) -> specdraft.TargetModel:
    opts = {"max_rows": 64, "max_seq_len": 256, "kv_blocks": 128, **kw}
    return specdraft.load_model(model_path, gpu=gpu, **opts)


PROMPTS = ["hello there", "a b c a b c a b", "x", "the same words, the same words"]


def _pool_is_free(model: specdraft.TargetModel) -> bool:
    total, free = model.kv_blocks
    return total == free


def test_streamed_tokens_and_text_add_up_to_the_results(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    plain = specdraft.SpecEngine(model, None).generate(PROMPTS, max_tokens=24, ignore_eos=True)
    for proposer in (None, specdraft.PromptLookup(), PyRandom()):
        engine = specdraft.SpecEngine(model, proposer, num_drafts=3, max_batch_tokens=8)
        assert engine.max_batch_tokens == 8 and engine.max_batch == 256
        stream = engine.stream(PROMPTS, max_tokens=24, ignore_eos=True)
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        texts = [""] * len(PROMPTS)
        assert stream.results is None
        for index, new, delta in stream:
            assert new, "an item carries at least one token"
            tokens[index] += new
            texts[index] += delta
        results = stream.results
        assert [r.tokens for r in results] == [r.tokens for r in plain]
        assert tokens == [r.tokens for r in plain]
        assert texts == [r.text for r in results]
        for r in results:
            m = r.metrics
            assert m["prefill_time_s"] > 0.0
            assert 0.0 <= m["queue_time_s"] <= m["wall_time_s"]
            assert 0.0 < m["time_to_first_token_s"] <= m["wall_time_s"]
        assert _pool_is_free(model)
    del stream, engine, model


def test_text_deltas_never_split_a_multibyte_character(model_path, gpu) -> None:
    pytest.importorskip("llguidance")
    from specdraft.grammar import Grammar

    model = _load(model_path, gpu)
    tok = model.tokenizer
    word = "é€😀ü"
    # The tokenizer has one token per byte, so each character is 2 to 4 tokens.
    assert len(tok.encode(word)) == len(word.encode())
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup(), num_drafts=2)
    grammar = Grammar.regex(tok, word)
    deltas = [d for _, _, d in engine.stream(["say it"], max_tokens=20, grammar=grammar) if d]
    assert "".join(deltas) == word
    for d in deltas:
        assert "\ufffd" not in d, deltas
    # Some token arrived with no text of its own (a character's first bytes).
    assert len(deltas) < len(word.encode())
    del engine, model


def test_a_raising_consumer_and_an_early_close_free_every_block(model_path, gpu) -> None:
    model = _load(model_path, gpu)
    engine = specdraft.SpecEngine(model, PyRandom(), num_drafts=3)

    def consume(e: specdraft.SpecEngine) -> None:
        for _index, _new, _delta in e.stream(PROMPTS, max_tokens=40, ignore_eos=True):
            raise KeyError("consumer failed")

    with pytest.raises(KeyError):
        consume(engine)
    assert _pool_is_free(model)

    with engine.stream(PROMPTS, max_tokens=40, ignore_eos=True) as stream:
        next(iter(stream))
        total, free = model.kv_blocks
        assert free < total, "the running sequences hold blocks"
    assert _pool_is_free(model)
    results = stream.results
    assert len(results) == len(PROMPTS)
    stopped = [r for r in results if r.finish_reason == "error"]
    assert stopped and all("stopped" in str(r.error) for r in stopped)
    assert list(stream) == []
    stream.close()
    del stream, engine, model


def test_a_small_pool_queues_requests_instead_of_failing_them(model_path, gpu) -> None:
    # 6 blocks of 16 rows: room for about two of these sequences at once.
    model = _load(model_path, gpu, kv_blocks=6)
    prompt = [7, 100, 31, 4, 250, 12]
    alone = specdraft.SpecEngine(model, None).generate([prompt], max_tokens=30, ignore_eos=True)
    for proposer in (None, specdraft.PromptLookup()):
        engine = specdraft.SpecEngine(model, proposer, max_batch_tokens=16)
        results = engine.generate([prompt] * 12, max_tokens=30, ignore_eos=True)
        for r in results:
            assert r.error is None, r.error
            assert r.tokens == alone[0].tokens
        assert _pool_is_free(model)
    # One that the whole pool (96 rows) could never hold fails alone, naming both numbers.
    engine = specdraft.SpecEngine(model, None)
    results = engine.generate([prompt, [5] * 60, prompt], max_tokens=40, ignore_eos=True)
    assert results[1].finish_reason == "error"
    assert isinstance(results[1].error, specdraft.AllocationError)
    message = str(results[1].error)
    assert "60 tokens" in message and "max_tokens (40)" in message and "holds 96" in message
    alone40 = specdraft.SpecEngine(model, None).generate([prompt], max_tokens=40, ignore_eos=True)
    for r in (results[0], results[2]):
        assert r.error is None, r.error
        assert r.tokens == alone40[0].tokens
    with pytest.raises(specdraft.RequestError):
        specdraft.SpecEngine(model, None, max_batch=0)
    del engine, model


class _Writes:
    """A stdout that keeps each write."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_generate_command_prints_as_it_goes(model_path, monkeypatch) -> None:
    from specdraft.cli import main

    gpu = specdraft.CpuBackend()
    model = specdraft.load_model(model_path, gpu=gpu, max_seq_len=1024)
    (want,) = specdraft.SpecEngine(model, None).generate(["hello"], max_tokens=16)
    del model
    assert len(want.text) >= 4, "the prompt gives enough text to stream"
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    args = ["generate", "--model", str(model_path), "--device", "cpu", "--max-seq-len", "1024"]
    args += ["--no-chat", "--prompt", "hello", "--max-tokens", "16", "--max-batch-tokens", "2"]
    assert main(args) == 0
    assert "".join(out.parts) == want.text + "\n"
    assert len([p for p in out.parts if p.strip()]) >= 2, out.parts
