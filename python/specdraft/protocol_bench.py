"""The protocol benchmark: the cost of one ``propose`` call through ``dyn DraftProposer``.

Each proposer is driven from Rust (``specdraft.testing.time_propose``) with the interpreter
released, exactly as the engine drives it, so the time of a Python proposer includes
attaching to the interpreter, the call, and converting its arguments and result. A trivial
Python proposer does no work, so its time is the whole Python overhead of the protocol.
"""

from __future__ import annotations

import platform
from typing import Any

from specdraft import DraftProposer, PromptLookup
from specdraft.testing import time_propose

#: The budget for the Python overhead of one ``propose`` call, in microseconds.
TARGET_OVERHEAD_US = 5.0


class TrivialPython(DraftProposer):
    """A Python proposer that drafts nothing: what remains is the protocol's overhead."""

    def alloc_state(self, gpu: Any) -> dict[str, int]:
        """Returns an empty state."""
        return {}

    def propose(
        self,
        last_token: int,
        target_hidden: Any,
        position: int,
        num_drafts: int,
        state: Any,
        ctx: Any,
        stream: int,
        draft_embed_target: Any = None,
        grammar_bitmask: Any = None,
        target_hidden_stack: Any = None,
    ) -> list[int]:
        """Drafts nothing."""
        return []

    def after_verify(self, num_accepted: int, state: Any, stream: int) -> None:
        """Keeps nothing."""


class FourDraftsPython(TrivialPython):
    """A Python proposer returning four drafts, to price the conversion of a result."""

    def propose(
        self,
        last_token: int,
        target_hidden: Any,
        position: int,
        num_drafts: int,
        state: Any,
        ctx: Any,
        stream: int,
        draft_embed_target: Any = None,
        grammar_bitmask: Any = None,
        target_hidden_stack: Any = None,
    ) -> list[int]:
        """Drafts the four tokens after ``last_token``."""
        return [(last_token + i) % 256 for i in range(1, 5)][:num_drafts]


class PythonOverPromptLookup(PromptLookup):
    """A Python subclass of PromptLookup whose ``propose`` calls the Rust one via super()."""

    def propose(
        self,
        last_token: int,
        target_hidden: Any,
        position: int,
        num_drafts: int,
        state: Any,
        ctx: Any,
        stream: int = 0,
        draft_embed_target: Any = None,
        grammar_bitmask: Any = None,
        target_hidden_stack: Any = None,
    ) -> list[int]:
        """Runs the Rust PromptLookup through the base class."""
        return super().propose(last_token, target_hidden, position, num_drafts, state, ctx, stream)


def run(iters: int = 100_000, num_drafts: int = 4) -> dict[str, Any]:
    """Times every proposer and returns the figures (microseconds per call)."""
    proposers: dict[str, DraftProposer] = {
        "prompt_lookup_rust": PromptLookup(),
        "trivial_python": TrivialPython(),
        "four_drafts_python": FourDraftsPython(),
        "python_subclass_of_prompt_lookup": PythonOverPromptLookup(),
    }
    results = {
        name: time_propose(p, iters=iters, num_drafts=num_drafts) for name, p in proposers.items()
    }
    overhead = results["trivial_python"]["median_us"]
    return {
        "benchmark": "protocol_py",
        "what": "microseconds per propose call through dyn DraftProposer, driven from Rust",
        "iters": iters,
        "num_drafts": num_drafts,
        "python": platform.python_version(),
        "results": results,
        "python_overhead_us": overhead,
        "target_overhead_us": TARGET_OVERHEAD_US,
        "meets_target": overhead < TARGET_OVERHEAD_US,
    }
