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
