"""Hooks for testing and benchmarking proposers; not part of the stable API.

They expose what the engine sees of a proposer, so a test can drive each protocol method
through the same path the engine uses, and a benchmark can time ``propose`` from Rust:

* :func:`as_rust` wraps a proposer the way the engine does (its overridden methods called
  through the adapter, the rest in Rust) and returns it as a :class:`DraftProposer` whose
  methods take that path; :attr:`DynProposer.python_methods` lists the methods that call
  Python.
* :func:`time_propose` times ``propose`` through the Rust protocol, driven from Rust with
  the interpreter released.

The Rust crate's equivalent is ``specdraft::engine::testing`` (``TableTarget``, a small
deterministic target model).
"""

from __future__ import annotations

from specdraft._core import _as_rust as as_rust
from specdraft._core import _DynProposer as DynProposer
from specdraft._core import _time_propose as time_propose

__all__ = ["DynProposer", "as_rust", "time_propose"]
