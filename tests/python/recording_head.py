"""An ``MtpHead`` that records what the engine's verify steps accepted, and the comparison of
those steps with the trainer's engine walk (``specdraft.train.evaluate.engine_walk``)."""

from __future__ import annotations

from typing import Any

import specdraft


class RecordingHead(specdraft.MtpHead):
    """The Rust head, unchanged, with each ``after_verify``'s accepted count kept in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        self.accepted: list[int] = []

    def after_verify(self, num_accepted: int, state: Any, stream: int) -> None:  # noqa: ANN401
        self.accepted.append(num_accepted)
        return super().after_verify(num_accepted, state, stream)


def engine_steps(
    model: specdraft.TargetModel,
    head: RecordingHead,
    prompt: list[int],
    max_tokens: int,
    drafts: int,
    levers: specdraft.ModelLevers,
) -> tuple[list[int], list[int]]:
    """The accepted count of every verify step of one greedy generation, and its tokens.

    A last verify step left no room for drafts (``max_tokens`` reached after it) proposes
    nothing and calls no ``after_verify``: it is counted here as accepting none, as the
    walk counts it.
    """
    head.accepted.clear()
    engine = specdraft.SpecEngine(
        model, head, num_drafts=drafts, draft_policy="fixed", levers=levers
    )
    (r,) = engine.generate([prompt], max_tokens=max_tokens)
    del engine
    steps = list(head.accepted)
    assert len(steps) <= r.metrics["verify_steps"] <= len(steps) + 1
    assert sum(steps) == sum(r.metrics["accepted_at"])
    steps += [0] * (r.metrics["verify_steps"] - len(steps))
    return steps, list(r.tokens)


def agreed_steps(engine: list[int], walk: Any, near_tie: float) -> int:  # noqa: ANN401
    """How many verify steps the walk and the engine agree on before the first difference.

    A difference is allowed only at a near-tie: where the walk's deciding drafts had two
    logits within ``near_tie`` (float32 against the engine's BF16 can pick either); the two
    then continue from different positions, so nothing after it is compared.
    """
    for i, (e, w) in enumerate(zip(engine, walk.accepted, strict=False)):
        if e != w:
            assert walk.margins[i] < near_tie, (i, e, w, walk.margins[i], engine, walk.accepted)
            return i
    assert len(engine) == len(walk.accepted), (engine, walk.accepted)
    return len(engine)
