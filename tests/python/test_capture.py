"""Target layer capture from Python, on a tiny three-layer llama GGUF: ``hidden_states`` with
``layers=`` against the same model's final hidden and an independent numpy forward, clear
errors for bad ids, and a Python proposer that names ``target_layer_ids`` receiving the
captured rows (``ctx.target_hidden_stack`` at its drafter prefill, ``target_hidden_stack`` at
each propose, ``ctx.target_hidden_stacks`` in a batch) exactly as a teacher-forced capture of
the same tokens gives them."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import specdraft
from specdraft import DraftProposer

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).parent))
import smollm2_reference as ref  # noqa: E402
from tiny_gguf import HIDDEN, write_tiny_llama  # noqa: E402

VOCAB = 80
LAYERS = 3
TOKENS = [1, 7, 33, 2, 79, 40, 40, 5, 12, 64, 3, 17, 21, 8, 70, 9, 11, 30]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("capture") / "tiny3.gguf"
    write_tiny_llama(path, vocab=VOCAB, seed=4, layers=LAYERS)
    return path


def _load(path: Path, gpu: specdraft.Backend) -> specdraft.TargetModel:
    return specdraft.load_model(path, gpu=gpu, max_rows=8, max_seq_len=96, kv_blocks=16)


def test_hidden_states_with_layers_is_each_layers_output_side_by_side(
    model_path: Path, gpu: specdraft.CpuBackend
) -> None:
    model = _load(model_path, gpu)
    n, h = len(TOKENS), HIDDEN
    stack = model.hidden_states(TOKENS, layers=[2, 0])
    assert stack.shape == (n, 2 * h) and stack.dtype == np.float32
    # The last layer's output is the final hidden before the norm, bit for bit.
    np.testing.assert_array_equal(stack[:, :h], model.hidden_states(TOKENS))
    # The first layer's output against an independent numpy forward of one layer.
    reader = gguf.GGUFReader(str(model_path))
    want = ref.forward(reader, ref.load_weights(reader), TOKENS, depth=1)
    scale = np.abs(want).max()
    assert np.abs(stack[:, h:] - want).max() < 0.03 * scale
    # The order given is the column order; one layer is its own column.
    swapped = model.hidden_states(TOKENS, layers=[0, 2])
    np.testing.assert_array_equal(swapped[:, :h], stack[:, h:])
    np.testing.assert_array_equal(swapped[:, h:], stack[:, :h])
    assert model.hidden_states(TOKENS, layers=[1]).shape == (n, h)
    assert model.kv_blocks == (16, 16), "hidden_states returns the KV blocks it used"
    del model


@pytest.mark.parametrize(
    ("layers", "says"),
    [
        ([3], "layer id 3 is out of range: the model has 3 decoder layers"),
        ([0, 0], "layer id 0 is named twice"),
        ([], "layers is empty"),
    ],
)
def test_hidden_states_refuses_bad_layer_ids(
    model_path: Path, gpu: specdraft.CpuBackend, layers: list[int], says: str
) -> None:
    model = _load(model_path, gpu)
    with pytest.raises(specdraft.RequestError, match=says):
        model.hidden_states(TOKENS, layers=layers)
    assert model.kv_blocks == (16, 16)
    del model


class StackSpy(DraftProposer):
    """Drafts nothing; records every captured row it is given, keyed by the position the
    row was computed at (a token's row is the one computed one position before it)."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = layers
        self.rows: dict[int, list[tuple[int, np.ndarray]]] = {}
        self.ks: list[int] = []

    def target_layer_ids(self):
        return self.layers

    def alloc_state(self, gpu):
        return {"seen": 0, "prompt": None}

    def _rows(self, ctx, ptr, k):
        width = len(self.layers) * ctx.config.hidden_size
        return np.asarray(ctx.gpu.download(ptr, "bf16", (k, width)))

    def prefill_drafter(self, prompt_tokens, hiddens, state, ctx, stream):
        state["prompt"] = tuple(prompt_tokens)
        state["seen"] = len(prompt_tokens) - 1
        got = self._rows(ctx, ctx.target_hidden_stack, len(prompt_tokens))
        self.rows.setdefault(state["prompt"], []).extend(enumerate(got))
        return 0

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
        assert ctx.target_hidden_stack is None
        k = position - state["seen"]
        state["seen"] = position
        self.ks.append(k)
        got = self._rows(ctx, target_hidden_stack, k)
        first = position - k
        self.rows[state["prompt"]].extend((first + i, r) for i, r in enumerate(got))
        return []

    def after_verify(self, num_accepted, state, stream):
        pass


def test_a_python_proposer_receives_the_captured_rows(
    model_path: Path, gpu: specdraft.CpuBackend
) -> None:
    model = _load(model_path, gpu)
    prompts = [TOKENS, TOKENS[:5]]
    (plain_a, plain_b) = specdraft.SpecEngine(model).generate(prompts, max_tokens=12)
    spy = StackSpy([2, 0])
    engine = specdraft.SpecEngine(model, spy, num_drafts=3, draft_policy="fixed")
    results = engine.generate(prompts, max_tokens=12)
    assert [list(r.tokens) for r in results] == [list(plain_a.tokens), list(plain_b.tokens)]
    assert spy.ks and all(k == 1 for k in spy.ks), "drafting nothing, each propose gets one row"
    for prompt, result in zip(prompts, results, strict=True):
        full = list(prompt) + list(result.tokens)
        want = model.hidden_states(full[:-1], layers=[2, 0])
        seen = spy.rows[tuple(prompt)]
        positions = sorted({p for p, _ in seen})
        # Every row from the first on, past the prompt (the last steps, left no room for a
        # draft by max_tokens, propose nothing).
        assert positions == list(range(len(positions))) and len(positions) > len(prompt)
        for p, row in seen:
            np.testing.assert_array_equal(row, want[p], err_msg=f"row computed at {p}")
    del engine, model


class BatchedStackSpy(StackSpy):
    """The same spy, proposing in batches: each sequence from its entry of
    ``ctx.target_hidden_stacks``."""

    def __init__(self, layers: list[int]) -> None:
        super().__init__(layers)
        self.batches: list[int] = []

    def propose_batch_max(self, buffers, config):
        return 4

    def propose_batch(
        self,
        last_tokens,
        target_hiddens,
        positions,
        num_drafts,
        states,
        ctx,
        stream=0,
        out_conf=None,
    ):
        stacks = ctx.target_hidden_stacks
        assert stacks is not None and len(stacks) == len(last_tokens)
        self.batches.append(len(last_tokens))
        return [
            self.propose(t, h, p, num_drafts, s, ctx, stream, target_hidden_stack=k)
            for t, h, p, s, k in zip(
                last_tokens, target_hiddens, positions, states, stacks, strict=True
            )
        ]


def test_a_batching_python_proposer_receives_each_sequences_rows(
    model_path: Path, gpu: specdraft.CpuBackend
) -> None:
    model = _load(model_path, gpu)
    prompts = [TOKENS, TOKENS[:5], TOKENS[3:9]]
    plain = specdraft.SpecEngine(model).generate(prompts, max_tokens=12)
    spy = BatchedStackSpy([2, 0])
    engine = specdraft.SpecEngine(model, spy, num_drafts=3, draft_policy="fixed")
    results = engine.generate(prompts, max_tokens=12)
    assert [list(r.tokens) for r in results] == [list(r.tokens) for r in plain]
    assert max(spy.batches) == 3, spy.batches
    for prompt, result in zip(prompts, results, strict=True):
        want = model.hidden_states((list(prompt) + list(result.tokens))[:-1], layers=[2, 0])
        seen = spy.rows[tuple(prompt)]
        assert len({p for p, _ in seen}) > len(prompt)
        for p, row in seen:
            np.testing.assert_array_equal(row, want[p], err_msg=f"row computed at {p}")
    del engine, model


class Named(DraftProposer):
    def __init__(self, layers: list[int], gamma: int | None = None) -> None:
        self.layers, self.gamma = layers, gamma

    def target_layer_ids(self):
        return self.layers

    def block_gamma(self):
        return self.gamma

    def alloc_state(self, gpu):
        return None

    def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw):
        return []

    def after_verify(self, num_accepted, state, stream):
        pass


def test_the_engine_checks_layer_ids_and_honours_block_gamma(
    model_path: Path, gpu: specdraft.CpuBackend
) -> None:
    model = _load(model_path, gpu)
    with pytest.raises(specdraft.RequestError, match="layer id 5 is out of range"):
        specdraft.SpecEngine(model, Named([0, 5]))
    with pytest.raises(specdraft.RequestError, match="layer id 1 is named twice"):
        specdraft.SpecEngine(model, Named([1, 1]))
    assert specdraft.SpecEngine(model, Named([], gamma=5), num_drafts=2).num_drafts == 4
    assert specdraft.SpecEngine(model, Named([], gamma=1), num_drafts=6).num_drafts == 1
    assert specdraft.SpecEngine(model, Named([]), num_drafts=2).num_drafts == 2
    assert specdraft.DraftProposer().target_layer_ids() == []
    del model
