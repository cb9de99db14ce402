"""Speculative decoding on the real default model, SmolLM2-135M-Instruct (Q4_1 GGUF).

Greedy speculative output must equal plain greedy output token for token whatever the
proposer drafts (PromptLookup, a Python proposer, random ids), and on an input-grounded
prompt n-gram lookup must be accepted (mean acceptance length above 1). Slow (downloads the
model once; runs 135M parameters on the CPU backend): marked ``slow``.
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
from test_engine import PyLookup  # noqa: E402

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


@pytest.mark.slow
def test_greedy_speculative_equals_plain_greedy_on_smollm2() -> None:
    from specdraft.tokenizer import load_tokenizer

    path = fetch_default_model()
    tok = load_tokenizer(path)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": f"Repeat this passage word for word:\n\n{PASSAGE}"}]
    )
    model = specdraft.load_model(path, max_rows=64, max_seq_len=512, kv_blocks=64)
    plain = specdraft.SpecEngine(model, tokenizer=tok)
    (base,) = plain.generate([chat], max_tokens=24)
    assert base.error is None, base.error
    assert "Rhine" in base.text, base.text
    for proposer in (specdraft.PromptLookup(), PyLookup(), RandomIds()):
        engine = specdraft.SpecEngine(model, proposer, num_drafts=4, tokenizer=tok)
        (r,) = engine.generate([chat], max_tokens=24)
        assert r.error is None, r.error
        assert list(r.tokens) == list(base.tokens), type(proposer).__name__
        if not isinstance(proposer, RandomIds):
            # Copying the prompt: n-gram drafts are accepted, fewer forwards are needed.
            assert r.metrics["mean_acceptance_length"] > 1.5, r.metrics
