"""Draws ``specdraft bench`` rows as a PNG.

Tokens/s by proposer and batch width, and acceptance by draft position. What is drawn is
computed apart (:func:`plot_data`); only the drawing needs matplotlib (the optional extra
``plot``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PlotData", "plot_data", "plot_rows"]


def _label(row: dict[str, Any]) -> str:
    return row["proposer"] if row["policy"] is None else f"{row['proposer']} ({row['policy']})"


def _sum(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


@dataclass(frozen=True)
class PlotData:
    """What :func:`plot_rows` draws, computed without matplotlib."""

    #: The batch widths, ascending: one group of bars each, at x = 0, 1, ...
    widths: list[int]
    #: Each bar's width on the x axis.
    bar_width: float
    #: Per proposer and policy, in row order: its bars' x positions and tokens/s (a width
    #: it has no row at has no bar).
    bars: list[tuple[str, list[float], list[float]]]
    #: Per proposer and policy that drafted: its acceptance rate at draft positions 1, 2, ...
    acceptance: list[tuple[str, list[float]]]


def plot_data(rows: list[dict[str, Any]]) -> PlotData:
    """The bars and acceptance curves of ``rows`` (see :func:`plot_rows`)."""
    widths = sorted({r["batch"] for r in rows})
    labels = list(dict.fromkeys(_label(r) for r in rows))
    step = 0.8 / max(len(labels), 1)
    bars = []
    for k, label in enumerate(labels):
        xs, ys = [], []
        for i, w in enumerate(widths):
            row = next((r for r in rows if r["batch"] == w and _label(r) == label), None)
            if row is not None:
                xs.append(i + (k - (len(labels) - 1) / 2) * step)
                ys.append(row["tokens_per_s"])
        bars.append((label, xs, ys))
    acceptance = []
    for label in labels:
        drafted: list[int] = []
        accepted: list[int] = []
        for r in rows:
            if _label(r) == label:
                drafted = _sum(drafted, r["drafted_at"])
                accepted = _sum(accepted, r["accepted_at"])
        if not any(drafted):
            continue
        # Pooled over batch widths: each position's rate weighs every step that drafted it.
        acceptance.append(
            (label, [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)])
        )
    return PlotData(widths, step, bars, acceptance)


def plot_rows(rows: list[dict[str, Any]], path: str) -> None:
    """Writes the figures of ``rows`` to the PNG file ``path``.

    Left, grouped bars of tokens/s (one group per batch width, one bar per proposer and
    policy); right, each proposer's acceptance rate by draft position over all its widths.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plotting needs matplotlib, which specdraft's optional extra 'plot' brings: "
            "pip install 'specdraft[plot]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    data = plot_data(rows)
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 5))
    for label, xs, ys in data.bars:
        bars.bar(xs, ys, width=data.bar_width, label=label)
    bars.set_xticks(range(len(data.widths)), [f"batch {w}" for w in data.widths])
    bars.set_ylabel("tokens/s")
    bars.set_title("Throughput by proposer and batch width")
    bars.legend(fontsize="small")
    for label, rates in data.acceptance:
        lines.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    lines.set_xlabel("draft position")
    lines.set_ylabel("acceptance rate")
    lines.set_ylim(0, 1)
    lines.set_title("Acceptance by draft position")
    lines.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
