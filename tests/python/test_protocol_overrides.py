"""Python overrides of the protocol's optional methods, called from Rust: each receives the
arguments Rust was given, its answer comes back into Rust, and the engine and
``check_proposer`` act on those answers (state sizing, prefill caps and deferral, drafter KV
carried between turns, the KV bookkeeping checks). Overrides whose Rust signature cannot fail
report a bad answer through ``sys.unraisablehook`` and fall back to the default."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import specdraft
from ngram_proposer import PyLookup
from specdraft import DevicePtr, ProposerError
from specdraft._core import _as_rust

OVERRIDDEN = [
    "alloc_state_for",
    "prefill_hidden_rows",
    "needs_comm",
    "prefill_uses_shared_buffers",
    "drafter_rows",
    "last_pair_key",
    "take_drafter_kv",
    "install_drafter_kv",
    "free_drafter_kv",
    "catchup_drafter",
    "read_deferred_draft_token",
    "circuit_draft",
    "set_circuit_draft",
]


class Spy(PyLookup):
    """PyLookup with every optional method of ``OVERRIDDEN`` defined in Python.

    Each records its arguments in ``log`` and answers from ``answers``. Drafter KV is
    simulated with block ids from a real ``BlockAllocator`` (one block per 16 rows), so a
    block the engine fails to hand back shows up as a pool that is not full.
    """

    def __init__(self, **answers: Any) -> None:
        super().__init__()
        self.log: list[tuple[Any, ...]] = []
        self.states: list[dict[str, Any]] = []
        self.pool = specdraft.BlockAllocator(64, 16)
        self.answers = {
            "hidden_rows": None,
            "needs_comm": True,
            "shared": False,
            "rows_lie": 0,
            "key_lie": None,
            "install": True,
            "deferred": 42,
            "binding": None,
            **answers,
        }

    def calls(self, name: str) -> list[tuple[Any, ...]]:
        """The recorded arguments of every call to ``name``, in order."""
        return [entry[1:] for entry in self.log if entry[0] == name]

    def _resize(self, state: dict[str, Any], rows: int) -> None:
        need = self.pool.blocks_for(rows) - len(state["blocks"])
        if need > 0:
            state["blocks"] += self.pool.alloc(need)
        state["rows"] = rows

    def alloc_state(self, gpu):
        self.log.append(("alloc_state", gpu))
        raise AssertionError("alloc_state_for is overridden: Rust must call it instead")

    def alloc_state_for(self, gpu, budget_tokens):
        self.log.append(("alloc_state_for", gpu, budget_tokens))
        state = {"history": [], "pending": [], "rows": 0, "key": None, "blocks": []}
        self.states.append(state)
        return state

    def prefill_drafter(self, prompt_tokens, hiddens, state, ctx, stream):
        self.log.append(("prefill_drafter", list(prompt_tokens)))
        super().prefill_drafter(prompt_tokens, hiddens, state, ctx, stream)
        # Rows for positions 1..P-1; the newest pairs with the hidden at P-2.
        self._resize(state, len(prompt_tokens) - 1)
        state["key"] = len(prompt_tokens) - 2
        return state["rows"]

    def propose(self, last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw):
        self.log.append(("propose", position))
        return super().propose(
            last_token, target_hidden, position, num_drafts, state, ctx, stream, **kw
        )

    def prefill_hidden_rows(self, max_seq_len):
        self.log.append(("prefill_hidden_rows", max_seq_len))
        cap = self.answers["hidden_rows"]
        return max_seq_len if cap is None else cap

    def needs_comm(self):
        self.log.append(("needs_comm",))
        return self.answers["needs_comm"]

    def prefill_uses_shared_buffers(self):
        self.log.append(("prefill_uses_shared_buffers",))
        return self.answers["shared"]

    def drafter_rows(self, state):
        self.log.append(("drafter_rows", state))
        return state["rows"] + self.answers["rows_lie"]

    def last_pair_key(self, state):
        self.log.append(("last_pair_key", state))
        lie = self.answers["key_lie"]
        return state["key"] if lie is None else lie

    def take_drafter_kv(self, state):
        taken = (state["blocks"], state["rows"], state["key"]) if state["rows"] else None
        self.log.append(("take_drafter_kv", state, taken))
        state.update(rows=0, key=None, blocks=[], history=[], pending=[])
        return taken

    def install_drafter_kv(self, state, blocks, rows, last_pair_key=None):
        self.log.append(("install_drafter_kv", state, blocks, rows, last_pair_key))
        if not self.answers["install"]:
            return False
        state.update(blocks=list(blocks), rows=rows, key=last_pair_key)
        return True

    def free_drafter_kv(self, blocks):
        self.log.append(("free_drafter_kv", list(blocks)))
        self.pool.free(blocks)

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state, ctx, stream):
        self.log.append(
            ("catchup_drafter", list(tokens), hiddens, row_base, pos_base, state, ctx, stream)
        )
        state["history"] = state["history"][:pos_base] + list(tokens)
        self._resize(state, row_base + len(tokens))
        state["key"] = pos_base + len(tokens) - 2
        return len(tokens)

    def read_deferred_draft_token(self, gpu):
        self.log.append(("read_deferred_draft_token", gpu))
        return self.answers["deferred"]

    def circuit_draft(self, config, levers):
        self.log.append(("circuit_draft", config, levers))
        return self.answers["binding"]

    def set_circuit_draft(self, runner):
        self.log.append(("set_circuit_draft", runner))

    def free_state(self, gpu, state):
        self.log.append(("free_state", state))
        if state["blocks"]:
            self.pool.free(state["blocks"])
        state["blocks"] = []


def test_every_override_is_what_rust_calls():
    methods = _as_rust(Spy()).python_methods
    required = ["alloc_state", "propose", "after_verify", "prefill_drafter", "free_state"]
    assert sorted(methods) == sorted(required + OVERRIDDEN)


def test_rust_passes_the_arguments_and_returns_the_answers(gpu, ctx):
    p = Spy(hidden_rows=17)
    rust = _as_rust(p)
    assert rust.needs_comm() is True
    assert rust.prefill_hidden_rows(4096) == 17
    assert p.calls("prefill_hidden_rows") == [(4096,)]
    assert rust.prefill_uses_shared_buffers() is False
    p.answers["shared"] = True
    assert rust.prefill_uses_shared_buffers() is True

    st = rust.alloc_state_for(gpu, 123)
    ((lent_gpu, budget),) = p.calls("alloc_state_for")
    assert budget == 123 and lent_gpu is gpu and p.calls("alloc_state") == []
    (mine,) = p.states
    assert rust.prefill_drafter([1, 2, 3, 4, 5], DevicePtr.NULL, st, ctx) == 4
    assert (rust.drafter_rows(st), rust.last_pair_key(st)) == (4, 3)
    # The state Rust holds is the very object alloc_state_for returned.
    assert p.calls("drafter_rows")[0][0] is mine and p.calls("last_pair_key")[0][0] is mine

    hid = gpu.alloc(2 * 64 * 2, tag="hiddens")
    assert rust.catchup_drafter([6, 7], hid, 4, 5, st, ctx, 3) == 2
    ((tokens, hiddens, row_base, pos_base, state, c, stream),) = p.calls("catchup_drafter")
    assert (tokens, hiddens, row_base, pos_base, stream) == ([6, 7], hid, 4, 5, 3)
    assert state is mine and isinstance(c, specdraft.ForwardContext)
    assert c.config.vocab_size == ctx.config.vocab_size
    gpu.free(hid)

    held = list(mine["blocks"])
    blocks, rows, key = rust.take_drafter_kv(st)
    assert (blocks, rows, key) == (held, 6, 5) and len(held) == 1
    assert rust.drafter_rows(st) == 0 and rust.last_pair_key(st) is None
    other = rust.alloc_state_for(gpu, 9)
    assert rust.install_drafter_kv(other, blocks, rows, key) is True
    (installed,) = p.calls("install_drafter_kv")
    assert installed[0] is p.states[1] and installed[1:] == (blocks, 6, 5)
    assert (rust.drafter_rows(other), rust.last_pair_key(other)) == (6, 5)
    p.answers["install"] = False
    assert rust.install_drafter_kv(st, [1], 1) is False
    assert p.calls("install_drafter_kv")[1][1:] == ([1], 1, None)
    rust.free_drafter_kv([])
    assert p.calls("free_drafter_kv") == [([],)]

    assert rust.read_deferred_draft_token(gpu) == 42
    assert p.calls("read_deferred_draft_token")[0][0] is gpu
    rust.set_circuit_draft(None)
    assert p.calls("set_circuit_draft") == [(None,)]
    with pytest.raises(ProposerError, match="takes None or a DraftRunner made by specdraft"):
        rust.set_circuit_draft(object())
    cfg, levers = specdraft.ModelConfig.tiny(77), specdraft.ModelLevers(mtp_kv_exact=True)
    assert rust.circuit_draft(cfg, levers) is None
    ((got_cfg, got_levers),) = p.calls("circuit_draft")
    assert got_cfg.vocab_size == 77 and got_levers.mtp_kv_exact is True

    for s in (st, other):
        rust.free_state(gpu, s)
    assert p.pool.num_free == 64


def test_bad_answers_fall_back_to_the_defaults_and_are_reported(gpu, ctx, monkeypatch):
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    p = Spy(needs_comm="yes", hidden_rows=-1, binding={"kind": "mine"})
    rust = _as_rust(p)
    assert rust.needs_comm() is False
    assert rust.prefill_hidden_rows(300) == 300
    assert rust.circuit_draft(specdraft.ModelConfig.tiny(8), specdraft.ModelLevers()) is None
    messages = [str(r.exc_value) for r in reports]
    assert len(messages) == 3, messages
    assert "needs_comm returned 'yes'" in messages[0]
    assert "prefill_hidden_rows returned" in messages[1]
    assert "only Rust proposers can provide a draft binding" in messages[2]
    p.answers["deferred"] = 2**32
    with pytest.raises(ProposerError, match="does not fit a u32 token id"):
        rust.read_deferred_draft_token(gpu)
    st = rust.alloc_state_for(gpu, 8)
    p.answers["key_lie"] = "later"
    assert rust.last_pair_key(st) is None
    assert "last_pair_key returned 'later'" in str(reports[-1].exc_value)
    rust.free_state(gpu, st)


def test_check_proposer_acts_on_drafter_rows_and_last_pair_key():
    assert specdraft.check_proposer(Spy()).ok
    lying_rows = specdraft.check_proposer(Spy(rows_lie=1))
    assert any(v.check in ("drafter_rows", "install_drafter_kv") for v in lying_rows.violations), (
        str(lying_rows)
    )
    # A key that survives take_drafter_kv: the state does not look fresh.
    lying_key = specdraft.check_proposer(Spy(key_lie=3))
    assert any(v.check == "take_drafter_kv: fresh state" for v in lying_key.violations), str(
        lying_key
    )
    # Declined installs hand every block back through free_drafter_kv.
    declining = Spy(install=False)
    assert specdraft.check_proposer(declining).ok
    assert declining.calls("free_drafter_kv") and declining.pool.num_free == 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    from tiny_gguf import write_tiny_llama

    path = tmp_path_factory.mktemp("overrides") / "tiny.gguf"
    write_tiny_llama(path, vocab=96, seed=5)
    return path


def _model(model_path: Path, gpu) -> specdraft.TargetModel:
    return specdraft.load_model(model_path, gpu=gpu, max_rows=64, max_seq_len=128, kv_blocks=64)


def _ok(results) -> list[list[int]]:
    for r in results:
        assert r.error is None, r.error
    return [list(r.tokens) for r in results]


SHORT = [5, 6, 7, 5, 6, 7]
LONG = [9, 8, 7, 6, 9, 8, 7, 6, 9, 8, 7, 6, 9, 8]


def test_the_engine_sizes_and_caps_the_drafter_from_the_overrides(model_path, gpu):
    model = _model(model_path, gpu)
    p = Spy(hidden_rows=10)
    engine = specdraft.SpecEngine(model, p, num_drafts=3)
    got = _ok(engine.generate([SHORT, LONG], max_tokens=5, ignore_eos=True))
    # Each budget is the prompt plus max_tokens; alloc_state itself is never called.
    assert [b for _, b in p.calls("alloc_state_for")] == [len(SHORT) + 5, len(LONG) + 5]
    assert p.calls("alloc_state") == []
    assert p.calls("prefill_hidden_rows")
    assert all(m == model.max_seq_len for (m,) in p.calls("prefill_hidden_rows"))
    # The 14-token prompt does not fit the 10-row capture: no drafter prefill for it.
    assert p.calls("prefill_drafter") == [(SHORT,)]
    # Drafting changed nothing of the greedy output.
    plain = specdraft.SpecEngine(model).generate([SHORT, LONG], max_tokens=5, ignore_eos=True)
    assert got == _ok(plain)
    assert p.pool.num_free == 64
    del engine, model


def test_shared_buffers_defer_the_drafter_prefill_to_the_first_step(model_path, gpu):
    model = _model(model_path, gpu)
    for shared in (False, True):
        p = Spy(shared=shared)
        engine = specdraft.SpecEngine(model, p, num_drafts=3)
        _ok(engine.generate([SHORT, SHORT[::-1]], max_tokens=4, ignore_eos=True))
        names = [e[0] for e in p.log]
        # The engine asks the Python override, once per sequence whose prefill completes.
        assert names.count("prefill_uses_shared_buffers") == 2, names
        order = [n for n in names if n in ("alloc_state_for", "prefill_drafter", "propose")]
        # Both sequences are admitted together (states made first, one prefill forward for
        # both); every drafter prefill comes before the first propose, deferred or not.
        assert order[:4] == ["alloc_state_for"] * 2 + ["prefill_drafter"] * 2, order
        assert set(order[4:]) == {"propose"}, order
        del engine
    del model


def test_a_conversation_carries_drafter_kv_through_the_overrides(model_path, gpu):
    model = _model(model_path, gpu)
    p = Spy()
    engine = specdraft.SpecEngine(model, p, num_drafts=3)
    conv = engine.conversation()
    conv.send(SHORT, max_tokens=4)
    ((_, taken),) = p.calls("take_drafter_kv")
    # The prompt's rows: positions 1..5, the newest paired with the hidden at position 4.
    assert taken[1:] == (len(SHORT) - 1, len(SHORT) - 2)
    assert conv.carried_rows == len(SHORT) - 1
    prompt2 = list(conv.history) + [11, 12, 13]

    conv.send([11, 12, 13], max_tokens=4)
    ((state, blocks, rows, key),) = p.calls("install_drafter_kv")
    assert (blocks, rows, key) == taken and state is p.states[1]
    # Installed: the drafter catches up on the rows after the carried ones, no prefill.
    ((tokens, hiddens, row_base, pos_base, st, _, _),) = p.calls("catchup_drafter")
    assert (row_base, pos_base) == (rows, key + 2)
    assert tokens == prompt2[key + 2 :]
    assert st is p.states[1] and not hiddens.is_null()
    assert p.calls("prefill_drafter") == [(SHORT,)]
    assert p.calls("free_drafter_kv") == []

    # Declined: the carried blocks come back through free_drafter_kv, the drafter is
    # prefilled over the whole prompt.
    p.answers["install"] = False
    carried = p.calls("take_drafter_kv")[-1][1]
    prompt3 = list(conv.history) + [14]
    conv.send([14], max_tokens=2)
    assert p.calls("free_drafter_kv") == [(carried[0],)]
    assert p.calls("prefill_drafter")[-1] == (prompt3,)
    conv.reset()
    assert len(p.calls("free_drafter_kv")) == 2
    assert p.pool.num_free == 64, "carried blocks were not handed back"
    del conv, engine, model
