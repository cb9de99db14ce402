"""Speculative decoding on the real default model, SmolLM2-135M-Instruct (Q4_1 GGUF).

Greedy speculative output must equal plain greedy output token for token whatever the
proposer drafts (PromptLookup, a Python proposer, random ids), and on an input-grounded
prompt n-gram lookup must be accepted (mean acceptance length above 1). Text just works:
the model brings its tokenizer, chat messages go through its template, and a conversation
answers turn after turn with the drafter KV it carries matching the history. Slow
(downloads the model once; runs 135M parameters on the CPU backend): marked ``slow``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import specdraft
from specdraft.models import fetch_default_model

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
sys.path.insert(0, str(Path(__file__).parent))
from ngram_proposer import CarryingLookup, PyLookup  # noqa: E402

PASSAGE = (
    "The Rhine begins in the Swiss Alps and flows north through Germany to the North Sea. "
    "Cities such as Basel, Cologne and Rotterdam grew along its banks."
)


class RandomIds(specdraft.DraftProposer):
    def alloc_state(self, gpu):
        return random.Random(1)

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
        return [state.randrange(49152) for _ in range(num_drafts)]

    def after_verify(self, num_accepted, state, stream):
        pass


@pytest.fixture(scope="module")
def smollm2() -> specdraft.TargetModel:
    return specdraft.load_model(fetch_default_model(), max_rows=64, max_seq_len=512, kv_blocks=64)


@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy_on_smollm2(smollm2) -> None:
    model = smollm2
    tok = model.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
    )
    plain = specdraft.SpecEngine(model)
    (base,) = plain.generate([chat], max_tokens=24)
    assert base.error is None, base.error
    assert "Rhine" in base.text, base.text
    for proposer in (specdraft.PromptLookup(), PyLookup(), RandomIds()):
        # Fixed: every step drafts, whatever the measured costs say on a busy machine.
        engine = specdraft.SpecEngine(model, proposer, num_drafts=4, draft_policy="fixed")
        (r,) = engine.generate([chat], max_tokens=24)
        assert r.error is None, r.error
        assert list(r.tokens) == list(base.tokens), type(proposer).__name__
        if not isinstance(proposer, RandomIds):
            # Copying the prompt: n-gram drafts are accepted, fewer forwards are needed.
            assert r.metrics["mean_acceptance_length"] > 1.5, r.metrics


@pytest.mark.slow
def test_text_and_chat_just_work_on_smollm2(smollm2) -> None:
    engine = specdraft.SpecEngine(smollm2, specdraft.PromptLookup(), num_drafts=4)
    (hello,) = engine.generate(["Hello"], max_tokens=8)
    assert hello.error is None, hello.error
    shown = list(hello.tokens)[: -1 if hello.finish_reason == "stop" else None]
    assert hello.text and hello.text == smollm2.tokenizer.decode(shown)
    question = [{"role": "user", "content": "Name the capital of France."}]
    (answer,) = engine.chat([question], max_tokens=24)
    assert answer.error is None, answer.error
    assert "Paris" in answer.text, answer.text
    assert "<|im_end|>" not in answer.text


@pytest.mark.slow
def test_a_conversation_answers_turn_after_turn_on_smollm2(smollm2) -> None:
    tok = smollm2.tokenizer
    proposer = CarryingLookup()
    conv = specdraft.SpecEngine(smollm2, proposer, num_drafts=4).conversation()
    first = conv.send("Name the capital of France.", max_tokens=24)
    assert first.error is None and "Paris" in first.text, first.text
    # The reply is an answer, not an immediate end of turn.
    assert len(first.tokens) > 2 and first.text.strip()
    second = conv.send("And what is the capital of Italy?", max_tokens=24)
    assert second.error is None and "Rome" in second.text, second.text
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "user", "assistant"]
    # The history is the conversation as the template renders it, each turn closed.
    rendered = tok.apply_chat_template(conv.messages, add_generation_prompt=False)
    assert tok.decode(conv.history) == rendered
    # The drafter KV was carried into the second turn and matches the history.
    assert proposer.installed == 1 and conv.carried_rows > 0
    for rows in proposer.snapshots:
        assert rows == conv.history[: len(rows)]
