"""A proposer written in Python that the test files share."""

from __future__ import annotations

from specdraft import DraftProposer


class PyLookup(DraftProposer):
    """A Python n-gram proposer: drafts what followed the last earlier occurrence of the
    last token."""

    def alloc_state(self, gpu):
        return {"history": [], "pending": []}

    def prefill_drafter(self, prompt_tokens, hiddens, state, ctx, stream):
        state["history"] = list(prompt_tokens)
        state["pending"] = []
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
        h = state["history"]
        del h[position:]
        h.append(last_token)
        drafts = []
        for start in range(len(h) - 2, -1, -1):
            if h[start] == last_token:
                drafts = h[start + 1 : start + 1 + num_drafts]
                break
        if grammar_bitmask is not None:
            ok = []
            for t in drafts:
                if not (int(grammar_bitmask[t // 32]) >> (t % 32)) & 1:
                    break
                ok.append(t)
            drafts = ok
        state["pending"] = drafts
        return drafts

    def after_verify(self, num_accepted, state, stream):
        state["history"].extend(state["pending"][:num_accepted])
        state["pending"] = []


class CarryingLookup(PyLookup):
    """PyLookup whose history is drafter "KV": one row per position, kept in blocks of a
    store the proposer owns, handed over between conversation turns
    (take_drafter_kv / install_drafter_kv) and caught up on the new prompt rows
    (catchup_drafter). It drafts from its rows only, so a row that does not match the
    conversation changes its drafts. Every row it is handed back is checked against what
    it handed out; ``snapshots`` keeps the rows of each taken state."""

    def __init__(self) -> None:
        self.store: dict[int, list[int]] = {}  # block id -> the history it carries
        self.next_block = 0
        self.snapshots: list[list[int]] = []
        self.installed = 0

    def take_drafter_kv(self, state):
        history = list(state["history"])
        if len(history) < 2:
            return None
        block = self.next_block
        self.next_block += 1
        self.store[block] = history
        self.snapshots.append(history)
        state["history"], state["pending"] = [], []
        # Rows stand for positions 1.. (MTP pairing): the newest row's pair key is its
        # position minus one.
        return [block], len(history) - 1, len(history) - 2

    def install_drafter_kv(self, state, blocks, rows, last_pair_key=None):
        (block,) = blocks
        history = self.store.pop(block)
        assert rows == len(history) - 1 and last_pair_key == len(history) - 2
        state["history"] = history
        self.installed += 1
        return True

    def free_drafter_kv(self, blocks):
        for b in blocks:
            self.store.pop(b)

    def catchup_drafter(self, tokens, hiddens, row_base, pos_base, state, ctx, stream):
        history = state["history"]
        assert row_base == len(history) - 1 and pos_base == len(history), (row_base, pos_base)
        history.extend(tokens)
        return len(tokens)
