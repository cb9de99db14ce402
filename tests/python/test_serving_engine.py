"""``specdraft.ServingEngine``: one long-lived generation that takes requests between steps.

Requests submitted while others run get exactly their offline greedy output, a cancelled
request gives its KV back at once, a bad request raises before it queues, and closing
leaves the device ledger where the model alone put it.
"""

from __future__ import annotations

import pytest
import specdraft

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from test_engine import _load, write_tiny_chat_gguf  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serving") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


PROMPTS = ["hello there", "abcabcabcabc", "the cat sat on the mat", "x", "0123401234"]


def _drive(serving: specdraft.ServingEngine, submit_at: dict[int, list[str]], **kw) -> dict:
    """Steps ``serving`` to the end, submitting ``submit_at[step]`` before each step; returns
    ``{id: (tokens, finish_reason, metrics)}`` and the ids in submission order."""
    seen: dict[int, list] = {}
    ids: list[int] = []
    step = 0
    while step <= max(submit_at) or not serving.idle:
        for p in submit_at.get(step, []):
            ids.append(serving.submit(p, **kw))
        for rid, tokens, finish, metrics, error in serving.step():
            entry = seen.setdefault(rid, [[], None, None])
            assert entry[1] is None, f"update after the end of {rid}"
            entry[0].extend(tokens)
            if finish is not None:
                assert error is None, error
                entry[1], entry[2] = finish, metrics
        step += 1
        assert step < 2000, "the run does not end"
    for _, tokens, finish, _, _ in serving.step():
        raise AssertionError(f"an update after every request ended: {tokens} {finish}")
    return {"seen": seen, "ids": ids}


def test_requests_joining_a_running_batch_get_their_offline_greedy_output(model_path, gpu):
    model = _load(model_path, gpu, kv_blocks=40)
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup(), num_drafts=3, max_batch=3)
    offline = engine.generate(PROMPTS, max_tokens=24, ignore_eos=True)
    serving = specdraft.ServingEngine(engine)
    out = _drive(
        serving, {0: PROMPTS[:2], 3: PROMPTS[2:4], 7: PROMPTS[4:]}, max_tokens=24, ignore_eos=True
    )
    for k, rid in enumerate(out["ids"]):
        tokens, finish, metrics = out["seen"][rid]
        assert tokens == offline[k].tokens, f"prompt {k}"
        assert finish == "length"
        assert metrics["emitted"] == 24
        assert metrics["accepted"] <= metrics["drafted"]
    assert out["ids"] == sorted(set(out["ids"])), "ids are distinct and increasing"
    total, free = serving.kv_blocks
    assert free == total
    serving.close()


def test_cancel_frees_kv_at_once_and_close_frees_everything(model_path, gpu):
    model = _load(model_path, gpu, kv_blocks=40)
    engine = specdraft.SpecEngine(model, specdraft.PromptLookup(), num_drafts=3)
    baseline = gpu.live_allocs
    serving = specdraft.ServingEngine(engine)
    a = serving.submit(PROMPTS[0], max_tokens=60, ignore_eos=True)
    b = serving.submit(PROMPTS[1], max_tokens=60, ignore_eos=True)
    for _ in range(3):
        serving.step()
    total, free_running = serving.kv_blocks
    assert serving.running == 2 and free_running < total
    assert serving.cancel(a)
    assert not serving.cancel(a), "a request is cancelled once"
    assert not serving.cancel(12345)
    assert serving.kv_blocks[1] > free_running, "its blocks came back before any step"
    assert serving.running == 1
    ends = {rid: finish for rid, _, finish, _, _ in serving.step() if finish}
    assert ends.get(a) == "cancelled"
    serving.submit(PROMPTS[2], max_tokens=60, ignore_eos=True)
    serving.step()
    assert gpu.live_allocs > baseline
    serving.close()
    assert serving.kv_blocks == (total, total)
    assert gpu.live_allocs == baseline, gpu.live_report()
    with pytest.raises(specdraft.RequestError, match="closed"):
        serving.step()
    serving.close()  # twice does nothing
    del b


def test_a_bad_request_raises_before_it_queues(model_path, gpu):
    model = _load(model_path, gpu)
    serving = specdraft.ServingEngine(specdraft.SpecEngine(model))
    with pytest.raises(specdraft.RequestError, match=r"\(11 tokens\) plus max_tokens \(300\)"):
        serving.submit("hello there", max_tokens=300)
    with pytest.raises(specdraft.RequestError, match="temperature"):
        serving.submit("hi", temperature=-1.0)
    with pytest.raises(specdraft.RequestError, match="max_tokens"):
        serving.submit("hi", max_tokens=0)
    assert serving.waiting == 0 and serving.idle
    serving.close()
