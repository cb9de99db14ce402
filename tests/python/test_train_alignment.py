"""The trainer's (hidden, token, teacher) triple, checked against the target's own logits.

DeepSeek-V3's pairing: draft step ``j`` of the row drafted after position ``p`` reads the
target hidden computed at ``p - 1`` (before the final norm: the one whose logits chose the
token at ``p``), the token at ``p + j`` (teacher forcing), and learns the target's
distribution at ``p + j`` (the one that predicts ``p + 1 + j``). Two hand-set heads make
the loss a quantity computed here from ``TargetModel.logits`` (a different forward from the
cached hidden states): one copies its hidden input to its output (so it predicts the target's
distribution at the hidden's position), the other copies the token's embedding. Masking
every position but one picks a single (row, step) pair per step, so each per-step KL must
equal one closed-form KL; a hidden, token or teacher shifted by one position changes it.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import specdraft  # noqa: E402
from specdraft.train.cache import HiddenCache  # noqa: E402
from specdraft.train.data import TokenizedConversation  # noqa: E402
from specdraft.train.head import head_dims, init_params  # noqa: E402
from specdraft.train.pipeline import _frozen  # noqa: E402
from specdraft.train.targets import extract_train, read_target_weights, target_shape  # noqa: E402
from specdraft.train.trainer import Batches, Trainer, TrainSettings  # noqa: E402
from test_engine import VOCAB, write_tiny_chat_gguf  # noqa: E402

LENGTH = 40
DRAFT_VOCAB = 200
STEPS = 3
SETTINGS = TrainSettings(epochs=1, steps=STEPS, batch=1, seq_len=48)
# BF16 hiddens in the cache against the target's own float32 logits.
RTOL, ATOL = 0.03, 0.01


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _kl(p_log: np.ndarray, q_log: np.ndarray) -> float:
    return float(np.sum(np.exp(p_log) * (p_log - q_log)))


def _rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    path = root / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(0, 256, LENGTH)]
    model = specdraft.load_model(path)
    shape = target_shape(model.config)
    cache = HiddenCache(root / "cache", str(path), shape.hidden)
    extract_train(model, cache, [TokenizedConversation("synthetic", "0", tokens)])
    # The target's own distribution at every position, from a full forward.
    logits = np.asarray(model.logits(tokens)).reshape(LENGTH, VOCAB)
    del model
    weights = read_target_weights(path)
    d = head_dims(shape)
    trainer = Trainer(d, _frozen(weights, DRAFT_VOCAB), SETTINGS, 10)
    batch = Batches(cache, SETTINGS).batch(0)
    return tokens, logits, weights, d, trainer, batch


def _head(d, weights, copy: str) -> dict[str, jax.Array]:
    """A head whose layer passes its hidden (``copy="hidden"``) or its token's embedding
    (``"token"``) straight to the final norm: attention and MLP write nothing."""
    p = init_params(d, 0)
    h = d.hidden
    eye, zero = np.eye(h, dtype=np.float32), np.zeros((h, h), np.float32)
    p["eh_proj"] = np.concatenate([zero, eye] if copy == "hidden" else [eye, zero], axis=1)
    p["self_attn.o_proj"] = np.zeros_like(p["self_attn.o_proj"])
    p["mlp.down_proj"] = np.zeros_like(p["mlp.down_proj"])
    # The target's final norm, so a copied hidden gives the target's own logits.
    p["shared_head.norm"] = weights.final_norm.astype(np.float32)
    return {k: jax.numpy.asarray(v) for k, v in p.items()}


def _per_step_kl(trainer, params, batch, position: int) -> np.ndarray:
    """The trainer's per-step KL with only ``position``'s teacher counted."""
    tok, hid, valid, start = batch
    one = np.zeros_like(valid)
    one[0, position] = 1.0
    _, kls = trainer.loss(params, (tok, hid, one, start))
    return np.asarray(kls, np.float64)


def test_cached_hidden_is_the_pre_norm_hidden_whose_logits_predict_the_next_token(setup):
    _, logits, weights, d, _, batch = setup
    hid = batch[1][0, :LENGTH]
    mine = (_rms_norm(hid, d.eps) * weights.final_norm) @ weights.lm_head.T
    scale = np.abs(logits).max()
    assert np.abs(mine - logits).max() <= 0.02 * scale
    assert np.array_equal(np.argmax(mine, axis=-1), np.argmax(logits, axis=-1))


@pytest.mark.parametrize("position", [5, 17, 30, LENGTH - 1])
def test_draft_step_j_reads_the_hidden_at_p_minus_1_and_learns_the_target_at_p_plus_j(
    setup, position
):
    _, logits, weights, d, trainer, batch = setup
    target = _log_softmax(logits[:, :DRAFT_VOCAB])
    got = _per_step_kl(trainer, _head(d, weights, "hidden"), batch, position)
    # The teacher at `position` is learned by step j of the row fed the hidden computed at
    # `position - 1 - j` (the drafts after it feed the copied hidden on).
    want = np.array([_kl(target[position], target[position - 1 - j]) for j in range(STEPS)])
    shifted = np.array([_kl(target[position], target[position - j]) for j in range(STEPS)])
    assert np.allclose(got, want, rtol=RTOL, atol=ATOL), (got, want)
    # The check has power: the hidden one position later gives a clearly different KL.
    assert not np.allclose(shifted, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("position", [5, 17, 30, LENGTH - 1])
def test_draft_step_j_reads_the_token_at_p_plus_j(setup, position):
    tokens, logits, weights, d, trainer, batch = setup
    target = _log_softmax(logits[:, :DRAFT_VOCAB])
    got = _per_step_kl(trainer, _head(d, weights, "token"), batch, position)

    def copied(t: int) -> np.ndarray:
        x = _rms_norm(_rms_norm(weights.embed[t], d.eps), d.eps) * weights.final_norm
        return _log_softmax(x @ weights.lm_head[:DRAFT_VOCAB].T)

    # Every step that learns the teacher at `position` is fed the token at `position`.
    want = np.full(STEPS, _kl(target[position], copied(tokens[position])))
    assert np.allclose(got, want, rtol=RTOL, atol=ATOL), (got, want)
    earlier = _kl(target[position], copied(tokens[position - 1]))
    assert not np.isclose(earlier, want[0], rtol=RTOL, atol=ATOL)


def test_padding_teaches_nothing(setup):
    _, _, weights, d, trainer, batch = setup
    tok, hid, valid, start = batch
    assert valid[0, :LENGTH].all() and not valid[0, LENGTH:].any()
    # With every real position masked out no step has a teacher: the loss is zero.
    value, kls = trainer.loss(_head(d, weights, "hidden"), (tok, hid, np.zeros_like(valid), start))
    assert value == 0.0 and np.all(np.asarray(kls) == 0.0)
