"""A proposer written in Python, checked against the protocol and driven by hand.

``Bigram`` drafts by following, from the last verified token, the successor seen most
often in the prompt and the output so far. ``check_proposer`` runs it through the same
lifecycle the engine drives and reports any broken contract.

Run: ``python examples/03_python_proposer.py``
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import specdraft


class Bigram(specdraft.DraftProposer):
    """Drafts the most frequent successor of each token, chained ``num_drafts`` times."""

    def alloc_state(self, gpu: specdraft.Backend) -> dict[str, list[int]]:
        """Start a sequence with an empty history."""
        return {"history": [], "pending": []}

    def prefill_drafter(
        self,
        prompt_tokens: list[int],
        hiddens: specdraft.DevicePtr,
        state: dict[str, list[int]],
        ctx: specdraft.ForwardContext,
        stream: int = 0,
    ) -> int:
        """Learn the prompt; no drafter KV rows are written."""
        state["history"] = list(prompt_tokens)
        return 0

    def propose(
        self,
        last_token: int,
        target_hidden: specdraft.DevicePtr,
        position: int,
        num_drafts: int,
        state: dict[str, list[int]],
        ctx: specdraft.ForwardContext,
        stream: int = 0,
        draft_embed_target: specdraft.DevicePtr | None = None,
        grammar_bitmask: Any = None,
        target_hidden_stack: specdraft.DevicePtr | None = None,
    ) -> list[int]:
        """Place ``last_token`` at ``position`` and chain the likeliest successors."""
        history = state["history"][:position] + [last_token]
        state["history"] = history
        successors: dict[int, Counter[int]] = {}
        for a, b in zip(history, history[1:], strict=False):
            successors.setdefault(a, Counter())[b] += 1
        drafts: list[int] = []
        token = last_token
        while len(drafts) < num_drafts and token in successors:
            token = successors[token].most_common(1)[0][0]
            if grammar_bitmask is not None:
                allowed = (int(grammar_bitmask[token // 32]) >> (token % 32)) & 1
                if not allowed:
                    break
            drafts.append(token)
        state["pending"] = drafts
        return drafts

    def after_verify(self, num_accepted: int, state: dict[str, list[int]], stream: int = 0) -> None:
        """Keep the accepted drafts in the history."""
        state["history"] += state["pending"][:num_accepted]
        state["pending"] = []


def main() -> None:
    """Check the proposer, then propose once by hand."""
    report = specdraft.check_proposer(Bigram(), label="Bigram")
    print(report)
    if not report.ok:
        raise SystemExit("the example proposer broke a contract")

    # The same checks on the built-in n-gram proposer, for comparison.
    lookup = specdraft.PromptLookup(min_ngram=1, max_ngram=3)
    print(specdraft.check_proposer(lookup, label="PromptLookup"))


if __name__ == "__main__":
    main()
