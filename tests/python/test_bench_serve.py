"""``specdraft bench-serve`` against a ``specdraft serve`` app on the tiny GGUF (127.0.0.1,
bounded): the figures count every request and token, percentiles are ordered, and a
refused request is a counted error with its message."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("httpx")
pytest.importorskip("starlette")
from serve_harness import MODEL, serve  # noqa: E402
from specdraft.cli import main  # noqa: E402
from specdraft.measure import percentiles  # noqa: E402
from test_engine import write_tiny_chat_gguf  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_serve") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "mean": 50.5}
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0, "mean": 3.0}
    assert percentiles([])["p50"] is None


def test_bench_serve_counts_every_request_and_token(model_path, capsys):
    with serve(model_path, api_key="k", max_seq_len=1024) as s:
        args = ["bench-serve", "--url", s.url, "--api-key", "k", "--clients", "4"]
        args += ["--requests", "10", "--max-tokens", "12", "--ignore-eos"]
        assert main(args) == 0
        figures = json.loads(capsys.readouterr().out)
        assert figures["model"] == MODEL
        assert (figures["completed"], figures["errors"]) == (10, 0)
        assert figures["output_tokens"] == 120
        assert figures["throughput_tok_s"] > 0
        for key in ("ttft_s", "chunk_gap_s", "tpot_s"):
            p = figures[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)

        args = ["bench-serve", "--url", s.url, "--api-key", "k", "--model", "other"]
        assert main([*args, "--requests", "2", "--max-tokens", "4"]) == 1
        figures = json.loads(capsys.readouterr().out)
        assert (figures["completed"], figures["errors"]) == (0, 2)
        assert "HTTP 404" in figures["error_samples"][0]
