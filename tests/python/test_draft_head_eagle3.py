"""The EAGLE-3 draft head shipped for the default model, ``smollm2-eagle3``, on the real model.

It loads by name beside SmolLM2-135M-Instruct as an ``Eagle3Head`` that reads the target's
embedding in place (its folder holds the head's own weights only: ``fc``, one decoder layer,
its norm and its LM head over a reduced draft vocabulary); greedy output with it equals
plain greedy output; on the fixed prompts ``test_draft_heads`` wrote for the MTP head (so
never in its training data) its acceptance length stays above a measured floor. The hybrid
keeps the MTP head, whose training measured the longer acceptance. Slow: marked ``slow``.
"""

from __future__ import annotations

import pytest
import specdraft
from specdraft.heads import best_head_for, default_head_for, draft_head_path, head_kind
from specdraft.models import fetch_default_model
from specdraft.quantize import read_safetensors
from test_draft_heads import engine_acceptance

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

HEAD = "smollm2-eagle3"
DRAFTS = 3
# Measured on the shipped head (engine, greedy, 3 drafts, 64 new tokens on each prompt, Q8_0
# projections): 1.391, 68 drafts accepted in 174 verify steps; see the head's README. The
# floor sits about three accepted drafts below it, for near-ties decided differently by other
# kernels or backends; the head's first run measures 1.367 here.
ACCEPTANCE_FLOOR = 1.37

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_path():
    return fetch_default_model()


def test_the_shipped_head_is_found_by_name_and_kind_and_holds_only_its_own_weights(model_path):
    assert head_kind(HEAD) == "eagle3"
    assert default_head_for(model_path, "eagle3") == HEAD
    # The MTP head measured the longer acceptance when both were trained.
    assert best_head_for(model_path) == "smollm2-mtp"
    raw = read_safetensors(draft_head_path(HEAD) / "model.safetensors")
    assert not any("embed" in name for name in raw)
    assert {"fc.weight", "lm_head.weight", "norm.weight", "d2t"} <= set(raw)
    assert raw["lm_head.weight"][1] == [8192, 576]


def test_the_shipped_head_drafts_above_its_floor_without_changing_the_output(model_path, gpu):
    model = specdraft.load_model(model_path, gpu=gpu, max_seq_len=512, kv_blocks=64)
    head = specdraft.load_draft_head(HEAD, model)
    assert type(head).__name__ == "Eagle3Head"
    assert head.shares_target and head.projection_format == "q8_0"
    plain_engine = specdraft.SpecEngine(model, None)
    engine = specdraft.SpecEngine(model, head, num_drafts=DRAFTS, draft_policy="fixed")
    acceptance, per_prompt = engine_acceptance(model, plain_engine, engine)
    assert acceptance >= ACCEPTANCE_FLOOR, per_prompt
    del engine, plain_engine, head, model
    assert gpu.live_allocs == 0
