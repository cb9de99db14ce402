"""``specdraft serve``: an OpenAI-compatible server on one long-lived engine.

:mod:`~specdraft.serve.engine_loop` drives a :class:`specdraft.ServingEngine` from one
thread for every client (continuous batching), :mod:`~specdraft.serve.app` is the HTTP
side (Starlette), :mod:`~specdraft.serve.params` checks the OpenAI parameters,
:mod:`~specdraft.serve.text` turns tokens into text with stop strings,
:mod:`~specdraft.serve.metrics` renders Prometheus metrics and :mod:`~specdraft.serve.cli`
is the command. The HTTP stack comes with the ``serve`` extra.
"""

from specdraft.serve.cli import add_serve

__all__ = ["add_serve"]
