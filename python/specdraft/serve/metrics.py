"""The server's Prometheus metrics, rendered in the text exposition format.

Every series carries the ``proposer`` label. Counters only grow; gauges are read from the
engine loop's last snapshot; histograms keep cumulative bucket counts, a sum and a count.
Updates come from the engine loop thread and reads from the server's thread, under one lock.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence

#: Seconds: time to first token.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Seconds: time between tokens.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
#: Tokens one verify step emitted for a request.
ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


class Histogram:
    """Cumulative buckets with upper bounds ``bounds`` (and +Inf)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        """Counts ``value`` ``times`` times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times


class ServerMetrics:
    """The counters, gauges and histograms of one server."""

    def __init__(self, proposer: str, gauges: Callable[[], dict[str, float]]) -> None:
        self.proposer = proposer
        self._gauges = gauges
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.generated = 0
        self.drafted = 0
        self.accepted = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.accept_len = Histogram(ACCEPT_BUCKETS)

    def request_ended(self, finish: str, generated: int, drafted: int, accepted: int) -> None:
        """Counts a request that ended with ``finish`` and the tokens it made."""
        with self._lock:
            self.requests[finish] = self.requests.get(finish, 0) + 1
            self.generated += generated
            self.drafted += drafted
            self.accepted += accepted

    def first_token(self, seconds: float) -> None:
        """Observes a time to first token."""
        with self._lock:
            self.ttft.observe(seconds)

    def tokens(self, seconds: float, n: int) -> None:
        """Observes ``n`` tokens that one step emitted ``seconds`` after the last ones."""
        with self._lock:
            self.itl.observe(seconds / n, n)
            self.accept_len.observe(n)

    def render(self) -> str:
        """The metrics in Prometheus' text format."""
        label = f'proposer="{self.proposer}"'
        out: list[str] = []

        def one(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, v in samples:
                out.append(f"{name}{{{labels}}} {_num(v)}")

        with self._lock:
            requests = dict(self.requests)
            totals = (self.generated, self.drafted, self.accepted)
            hists = [
                (
                    "time_to_first_token_seconds",
                    "Time from a request's arrival to its first token.",
                    self.ttft,
                ),
                (
                    "inter_token_latency_seconds",
                    "Time between a request's steps, per token emitted (after its first).",
                    self.itl,
                ),
                (
                    "acceptance_length",
                    "Tokens a verify step emitted for a request.",
                    self.accept_len,
                ),
            ]
            hist_text = [(n, h, _hist_lines(f"specdraft_{n}", label, hist)) for n, h, hist in hists]
        one(
            "specdraft_requests_total",
            "counter",
            "Requests that ended, by how.",
            [(f'{label},finish_reason="{k}"', v) for k, v in sorted(requests.items())]
            or [(f'{label},finish_reason="stop"', 0)],
        )
        for name, v, help_ in zip(
            ("generated_tokens_total", "drafted_tokens_total", "accepted_tokens_total"),
            totals,
            ("Tokens generated.", "Draft tokens proposed.", "Draft tokens accepted."),
            strict=True,
        ):
            one(f"specdraft_{name}", "counter", help_, [(label, v)])
        gauges = self._gauges()
        for name, help_ in (
            ("requests_running", "Requests in the running batch."),
            ("requests_waiting", "Requests waiting for a slot or KV blocks."),
            ("kv_blocks_total", "Blocks of the target's KV pool."),
            ("kv_blocks_free", "Free blocks of the target's KV pool."),
            ("device_live_allocations", "Live allocations in the backend's ledger."),
            (
                "device_base_allocations",
                "Live allocations before the first request: the model's and the engine's own.",
            ),
        ):
            one(f"specdraft_{name}", "gauge", help_, [(label, gauges.get(name, 0))])
        for name, help_, lines in hist_text:
            out.append(f"# HELP specdraft_{name} {help_}")
            out.append(f"# TYPE specdraft_{name} histogram")
            out.extend(lines)
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and not math.isinf(v)):
        return str(int(v))
    return repr(float(v))


def _hist_lines(name: str, label: str, h: Histogram) -> list[str]:
    lines = []
    running = 0
    for bound, c in zip([*h.bounds, math.inf], h.counts, strict=True):
        running += c
        le = "+Inf" if math.isinf(bound) else _num(bound)
        lines.append(f'{name}_bucket{{{label},le="{le}"}} {running}')
    lines.append(f"{name}_sum{{{label}}} {_num(h.sum)}")
    lines.append(f"{name}_count{{{label}}} {h.count}")
    return lines
