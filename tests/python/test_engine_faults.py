"""A Python proposer raising in each of its methods during ``generate``: only the sequence
the call was for ends (with a ``ProposerError`` naming the method), the others' outputs are
unchanged, and the KV pool and the backend return to empty (the ``gpu`` fixture checks the
backend after each test)."""

from __future__ import annotations

import pytest
import specdraft

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from ngram_proposer import PyLookup  # noqa: E402
from test_engine import write_tiny_chat_gguf  # noqa: E402

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    [99, 3, 3, 4, 3, 3],
    [40, 41, 42, 43, 44, 40, 41],
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


class Faulty(PyLookup):
    """PyLookup raising in ``method`` for the sequence whose prompt starts with 99 (for
    ``alloc_state``, which sees no prompt, on its second call: request 1's)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.allocs = 0

    def _fail(self, method: str, state) -> None:
        if method == self.method and state is not None and state["history"][:1] == [99]:
            raise RuntimeError(f"injected fault in {method}")

    def alloc_state(self, gpu):
        self.allocs += 1
        if self.method == "alloc_state" and self.allocs == 2:
            raise RuntimeError("injected fault in alloc_state")
        return super().alloc_state(gpu)

    def prefill_drafter(self, prompt_tokens, hiddens, state, ctx, stream):
        n = super().prefill_drafter(prompt_tokens, hiddens, state, ctx, stream)
        self._fail("prefill_drafter", state)
        return n

    def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw):
        self._fail("propose", state)
        return super().propose(
            last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw
        )

    def after_verify(self, num_accepted, state, stream):
        self._fail("after_verify", state)
        super().after_verify(num_accepted, state, stream)

    def free_state(self, gpu, state):
        self._fail("free_state", state)


@pytest.mark.parametrize(
    "method", ["alloc_state", "prefill_drafter", "propose", "after_verify", "free_state"]
)
def test_a_fault_in_each_method_ends_only_its_sequence(model_path, gpu, method) -> None:
    model = specdraft.load_model(model_path, gpu=gpu, max_rows=64, max_seq_len=256, kv_blocks=8)
    base = specdraft.SpecEngine(model).generate(PROMPTS, max_tokens=20, ignore_eos=True)
    # A pool of 8 blocks queues and preempts these, so faults meet recomputed sequences too.
    engine = specdraft.SpecEngine(model, Faulty(method), num_drafts=3, max_batch_tokens=4)
    results = engine.generate(PROMPTS * 2, max_tokens=20, ignore_eos=True)
    failed = [i for i, r in enumerate(results) if r.error is not None]
    # alloc_state fails its second call only; the others fail every request 1 and 4.
    assert failed == ([1] if method == "alloc_state" else [1, 4]), failed
    for i in failed:
        error = results[i].error
        assert results[i].finish_reason == "error"
        assert isinstance(error, specdraft.ProposerError), repr(error)
        assert method in str(error) and "injected fault" in str(error)
    for i, r in enumerate(results):
        if i not in failed:
            assert list(r.tokens) == list(base[i % 3].tokens), i
    total, free = model.kv_blocks
    assert free == total
    del engine, model
