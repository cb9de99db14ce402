"""A draft head's own KV pool holds back admission as the target's does: with a drafter pool
too small for every prompt at once, an ``MtpHead``, ``Eagle3Head``, ``DFlashHead`` or a
``Hybrid`` holding one starts only the prompts whose prefill its free blocks hold, counting
the blocks promised to prompts started before in the same pass, and the others wait until
sequences finish (each result is plain greedy output, none fails); every block is given back
at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import specdraft
import test_dflash_head
import test_eagle3_head
import test_mtp_head

pytest.importorskip("gguf")
from tiny_gguf import write_tiny_llama  # noqa: E402

VOCAB = test_mtp_head.VOCAB
# Eighty prompts of 12 tokens and 36 new tokens: a prefill and a step's drafts take one
# drafter block of 16 rows, the whole sequence at least three.
PROMPTS = [[(3 * i + 7 * k) % 90 + 1 for k in range(12)] for i in range(80)]
NEW_TOKENS = 36
# The heads' main_kv_blocks: an MTP or EAGLE-3 head's pool gets at most this many blocks, a
# DFlash head's this plus two blocks for each of 32 sequences' blocks; either is too small
# for every prompt at once.
DRAFTER_BLOCKS = 7


def _head(kind: str, tmp_path: Path, model):  # noqa: ANN001, ANN202
    small = {"max_seq_len": 64, "main_kv_blocks": DRAFTER_BLOCKS}
    if kind == "mtp":
        folder = test_mtp_head.write_checkpoint(tmp_path / kind, "deepseek_v3")
        return specdraft.MtpHead.from_checkpoint(folder, model.gpu, target=model, **small)
    if kind == "eagle3":
        folder = test_eagle3_head.write_checkpoint(
            tmp_path / kind, "speculators", aux=(1, 2, 3), embed=False
        )
        return specdraft.Eagle3Head.from_checkpoint(folder, model.gpu, target=model, **small)
    folder = test_dflash_head.write_checkpoint(tmp_path / kind, config={"vocab_size": VOCAB})
    return specdraft.DFlashHead.from_checkpoint(folder, model.gpu, target=model, **small)


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "dflash", "hybrid"])
def test_prompts_wait_for_room_in_the_drafter_pool(tmp_path, gpu, kind) -> None:
    write_tiny_llama(tmp_path / "t.gguf", vocab=VOCAB, layers=4, seed=4)
    model = specdraft.load_model(
        tmp_path / "t.gguf", gpu=gpu, max_rows=64, max_seq_len=64, kv_blocks=256
    )
    plain = specdraft.SpecEngine(model, None).generate(
        PROMPTS, max_tokens=NEW_TOKENS, ignore_eos=True
    )
    head = _head("eagle3" if kind == "hybrid" else kind, tmp_path, model)
    total, free = head.kv_blocks
    assert total == free and total < len(PROMPTS), total
    proposer = head
    if kind == "hybrid":
        proposer = specdraft.Hybrid([specdraft.PromptLookup(), head])
    engine = specdraft.SpecEngine(model, proposer, num_drafts=3, draft_policy="fixed")
    results = engine.generate(PROMPTS, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, (r, p) in enumerate(zip(results, plain, strict=True)):
        assert r.error is None, (i, r.error)
        assert list(r.tokens) == list(p.tokens), i
    assert engine.last_metrics["drafted"] > 0
    # The first `total` prompts start at once (a block each); the next waits for one of them
    # to finish, so it starts after all of them have their first token.
    first_wave = max(r.metrics["time_to_first_token_s"] for r in results[:total])
    assert results[total].metrics["queue_time_s"] > first_wave, kind
    assert head.kv_blocks == (total, total)
    del engine, proposer, head, model
    assert gpu.live_allocs == 0
