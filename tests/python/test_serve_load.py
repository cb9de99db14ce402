"""benches/serve_load.py: its contracts by name, and a small load on SmolLM2 (127.0.0.1,
40 requests at concurrency 8, every tenth dropped mid-stream, bounded in time) that must
end with every request completed or dropped, the KV pool whole, the device ledger back to
the model's allocations and the server exiting 0 after SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"
sys.path.insert(0, str(BENCHES))
pytest.importorskip("httpx")
from serve_load import failures  # noqa: E402

GOOD = {
    "requests": 10,
    "completed": 9,
    "cancelled": 1,
    "errors": 0,
    "hung": 0,
    "not_run": 0,
    "server_cancelled": 1,
    "kv_blocks_total": 33,
    "kv_blocks_free": 33,
    "live_allocations": 348,
    "base_allocations": 348,
    "server_exit": 0,
}


def test_each_broken_contract_is_named() -> None:
    assert failures(GOOD) == []
    assert failures({**GOOD, "server_exit": None}) == []  # a server it did not start
    for change, name in [
        ({"completed": 8}, "completed + cancelled != requests"),
        ({"errors": 1}, "errors = 1"),
        ({"hung": 2}, "hung = 2"),
        ({"not_run": 3}, "not_run = 3"),
        ({"server_cancelled": 2}, "the server cancelled requests no client dropped"),
        ({"kv_blocks_free": 32}, "kv_blocks_free != kv_blocks_total"),
        ({"kv_blocks_total": -1, "kv_blocks_free": -1}, "kv_blocks_free != kv_blocks_total"),
        ({"live_allocations": 349}, "live_allocations != base_allocations"),
        ({"server_exit": -9}, "the server exited with -9"),
    ]:
        assert failures({**GOOD, **change}) == [name], change


@pytest.mark.slow
def test_a_small_load_with_drops_leaves_the_server_as_it_found_it() -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from specdraft.models import fetch_default_model

    fetch_default_model()
    args = ["--requests", "40", "--concurrency", "8", "--max-tokens", "16"]
    args += ["--timeout", "60", "--deadline", "300", "--settle", "20"]
    done = subprocess.run(
        [sys.executable, str(BENCHES / "serve_load.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCHES,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(done.stdout)
    assert (r["completed"], r["cancelled"], r["errors"], r["hung"]) == (36, 4, 0, 0), r
    assert r["server_cancelled"] <= 4
    assert r["kv_blocks_free"] == r["kv_blocks_total"] > 0
    assert r["live_allocations"] == r["base_allocations"] > 0
    assert r["server_exit"] == 0 and r["failed"] == []
    assert 0 < r["output_tokens"] <= 36 * 16
