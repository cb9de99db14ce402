"""The training loop's batching, starting weights and time limit, on a synthetic cache and
a small head (no target model needed): a batch is as wide as its longest sequence rounded
up to ``WIDTH_STEP`` and padding never changes the loss; ``load_params`` starts a fresh
optimizer from a checkpoint's weights; a passed deadline stops training with a checkpoint."""

from __future__ import annotations

import time

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
from specdraft.train.cache import HiddenCache, from_bf16_bits  # noqa: E402
from specdraft.train.head import HeadDims, init_params  # noqa: E402
from specdraft.train.trainer import WIDTH_STEP, Batches, Trainer, TrainSettings  # noqa: E402

D = HeadDims(hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, eps=1e-5, rope_theta=1e4)
VOCAB, DRAFT_VOCAB = 96, 64
LENGTHS = [10, 70, 130, 300]
# The loop's tests use one width, so the step compiles once.
SHORT = [10, 20, 30, 40]
SETTINGS = TrainSettings(epochs=1, steps=3, batch=1, seq_len=256, lr=1e-3, checkpoint_every=2)


def _cache(folder, lengths: list[int]) -> HiddenCache:
    rng = np.random.default_rng(3)
    c = HiddenCache(folder, "synthetic", D.hidden)
    for i, n in enumerate(lengths):
        hid = rng.standard_normal((n, D.hidden)).astype(np.float32)
        c.append("synthetic", str(i), "train", rng.integers(0, VOCAB, n).tolist(), hid)
    return c


@pytest.fixture
def cache(tmp_path) -> HiddenCache:
    return _cache(tmp_path / "cache", SHORT)


def _frozen() -> dict[str, jax.Array]:
    rng = np.random.default_rng(4)
    embed = rng.standard_normal((VOCAB, D.hidden)).astype(np.float32)
    return {
        "embed": jax.numpy.asarray(embed),
        "lm_head": jax.numpy.asarray(embed[:DRAFT_VOCAB]),
        "target_norm": jax.numpy.ones(D.hidden),
    }


def _trainer(total_steps: int = 4) -> Trainer:
    return Trainer(D, _frozen(), SETTINGS, total_steps)


def test_a_batch_is_as_wide_as_its_longest_sequence_rounded_up(tmp_path):
    cache = _cache(tmp_path / "cache", LENGTHS)
    batches = Batches(cache, SETTINGS)
    tokens, hiddens = cache.open_arrays()
    widths = {}
    for step in range(len(LENGTHS)):
        tok, hid, valid, _ = batches.batch(step)
        n = int(valid.sum())
        seq = next(s for s in cache.split("train") if min(s.length, SETTINGS.seq_len) == n)
        widths[seq.length] = tok.shape[1]
        assert tok.shape == valid.shape and hid.shape == (*tok.shape, D.hidden)
        assert valid[0, :n].all() and not valid[0, n:].any()
        assert np.array_equal(tok[0, :n], tokens[seq.offset : seq.offset + n])
        assert np.array_equal(hid[0, :n], from_bf16_bits(hiddens[seq.offset : seq.offset + n]))
        assert not tok[0, n:].any() and not hid[0, n:].any()
    # Rounded up to the width step, capped at seq_len (300 is cut to 256).
    assert WIDTH_STEP == 64
    assert widths == {10: 64, 70: 128, 130: 192, 300: 256}
    coarse = Batches(cache, TrainSettings(batch=4, seq_len=256, width_step=128))
    assert coarse.batch(0)[0].shape == (4, 256)
    short = Batches(_cache(tmp_path / "short", SHORT), TrainSettings(batch=4, width_step=128))
    assert short.batch(0)[0].shape == (4, 128)


def test_padding_a_batch_wider_leaves_its_loss_unchanged(cache):
    trainer = _trainer()
    params = trainer.init_state(init_params(D, 0)).params
    tok, hid, valid, start = Batches(cache, SETTINGS).batch(0)
    assert tok.shape[1] == WIDTH_STEP
    extra = 64

    def pad(x: np.ndarray) -> np.ndarray:
        return np.concatenate([x, np.zeros((1, extra, *x.shape[2:]), x.dtype)], axis=1)

    loss, kls = trainer.loss(params, (tok, hid, valid, start))
    wide_loss, wide_kls = trainer.loss(params, (pad(tok), pad(hid), pad(valid), start))
    assert loss > 0
    np.testing.assert_allclose(wide_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(wide_kls, kls, rtol=1e-5)


def test_load_params_starts_a_fresh_optimizer_from_a_checkpoints_weights(cache, tmp_path):
    trainer = _trainer()
    batches = Batches(cache, SETTINGS)
    ckpt = tmp_path / "state.npz"
    trained = trainer.run(trainer.init_state(init_params(D, 0)), batches, ckpt, stop_at=2)
    other = _trainer(total_steps=9)
    started = other.load_params(other.init_state(init_params(D, 1)), ckpt)
    assert started.step == 0
    for name, value in trained.params.items():
        np.testing.assert_array_equal(np.asarray(started.params[name]), np.asarray(value))
    fresh = other.optimizer.init(started.params)
    a, b = jax.tree_util.tree_leaves(started.opt_state), jax.tree_util.tree_leaves(fresh)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The trained Adam moments are not zero, so the fresh state is a real difference.
    assert any(
        np.abs(np.asarray(x)).max() > 0 for x in jax.tree_util.tree_leaves(trained.opt_state)
    )


def test_a_passed_deadline_stops_training_and_writes_a_checkpoint(cache, tmp_path):
    trainer = _trainer()
    batches = Batches(cache, SETTINGS)
    ckpt = tmp_path / "state.npz"
    state = trainer.run(trainer.init_state(init_params(D, 0)), batches, ckpt, stop_at=1)
    assert state.step == 1
    stopped = trainer.run(state, batches, ckpt, deadline=time.monotonic())
    assert stopped.step == 1
    assert trainer.load(state, ckpt).step == 1
    # Without a deadline the same call trains to the end.
    assert trainer.run(state, batches, None).step == trainer.total_steps


def test_the_loss_learns_on_the_reply_only(tmp_path):
    """Tokens and hiddens strictly inside a sequence's prompt change no term of the loss.

    The head here writes nothing from its attention (``o_proj`` zero), so each chain's terms
    depend on its own positions alone: attention reads the prompt's rows by design, as the
    head does in use. Counting chains from position 1 on (as every batch once did), the same
    change moves the loss.
    """
    rng = np.random.default_rng(5)
    n, start = 40, 24
    cache = HiddenCache(tmp_path / "cache", "synthetic", D.hidden)
    hid = rng.standard_normal((n, D.hidden)).astype(np.float32)
    cache.append("synthetic", "0", "train", rng.integers(0, VOCAB, n).tolist(), hid, start=start)
    batch = Batches(cache, SETTINGS).batch(0)
    assert batch.start.tolist() == [start]
    params = init_params(D, 0)
    params["self_attn.o_proj"] = np.zeros_like(params["self_attn.o_proj"])
    params = {k: jax.numpy.asarray(v) for k, v in params.items()}
    trainer = _trainer()
    # The prompt's tokens, and its hiddens but the last (the one the reply's first token
    # is paired with, which a chain from the reply's start reads).
    tok, hid2 = batch.tokens.copy(), batch.hiddens.copy()
    tok[0, :start] = rng.integers(0, VOCAB, start)
    hid2[0, : start - 1] = rng.standard_normal((start - 1, D.hidden))
    changed = batch._replace(tokens=tok, hiddens=hid2)
    loss, kls = trainer.loss(params, batch)
    assert loss > 0
    np.testing.assert_allclose(trainer.loss(params, changed)[1], kls, rtol=1e-6)
    everywhere = np.ones_like(batch.start)
    old, _ = trainer.loss(params, batch._replace(start=everywhere))
    old_changed, _ = trainer.loss(params, changed._replace(start=everywhere))
    assert abs(old_changed - old) > 0.01 * old, (old, old_changed)
    # The boundary is exact: the prompt's last hidden is read.
    hid3 = batch.hiddens.copy()
    hid3[0, start - 1] = rng.standard_normal(D.hidden)
    moved, _ = trainer.loss(params, batch._replace(hiddens=hid3))
    assert abs(moved - loss) > 1e-3 * loss, (loss, moved)
