"""benches/decode_peer.py: reading llama-bench's JSON, the summary's ratios, and a whole run
against a stand-in llama-bench (a script that records its arguments and prints fixed rates)
on a tiny random model, with the errors a missing or failing peer gives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"
sys.path.insert(0, str(BENCHES))
pytest.importorskip("gguf")
from decode_peer import decode_rate, summarise  # noqa: E402
from test_engine import write_tiny_chat_gguf  # noqa: E402


def _record(n_prompt: int, n_gen: int, avg_ts: float) -> dict[str, object]:
    """A test as llama-bench -o json prints it (the fields the script reads, and some more)."""
    fields = {"model_type": "llama 256M Q4_1", "n_threads": 2, "n_prompt": n_prompt}
    return fields | {"n_gen": n_gen, "avg_ts": avg_ts, "stddev_ts": 1.5, "samples_ts": [avg_ts]}


def test_the_decode_rate_is_the_test_without_a_prompt() -> None:
    both = json.dumps([_record(512, 0, 900.0), _record(0, 128, 123.4)])
    assert decode_rate(both) == 123.4
    for bad, what in [
        ("not json", "printed no JSON"),
        (json.dumps({"n_gen": 128}), "not a list of tests"),
        (json.dumps([_record(512, 0, 900.0)]), r"no single decode test .*\(512, 0\)"),
        (json.dumps([_record(0, 128, 1.0), _record(0, 64, 2.0)]), "no single decode test"),
        (json.dumps([{"n_prompt": 0, "n_gen": 128}]), "no single decode test"),
        (json.dumps([_record(0, 128, 0.0)]), "reads 0.0 tokens per second"),
    ]:
        with pytest.raises(ValueError, match=what):
            decode_rate(bad)


def test_the_summary_sets_each_round_against_its_own_peer_mean_and_plain() -> None:
    def row(name: str, tps: float) -> dict[str, object]:
        return {"row": name, "tokens_per_s": tps}

    rounds = [
        {"llama_bench_mean": 100.0, "rows": [row("baseline", 150.0), row("mtp", 180.0)]},
        {"llama_bench_mean": 120.0, "rows": [row("baseline", 144.0), row("mtp", 192.0)]},
    ]
    s = summarise(rounds)
    assert s["baseline"]["tokens_per_s"] == 147.0
    assert s["mtp"]["tokens_per_s"] == 186.0
    # Round 1: 150 / 100 and 180 / 100; round 2: 144 / 120 and 192 / 120.
    assert (s["baseline"]["vs_llama_bench"]["min"], s["baseline"]["vs_llama_bench"]["max"]) == (
        1.2,
        1.5,
    )
    assert s["mtp"]["vs_llama_bench"]["median"] == round((1.8 + 1.6) / 2, 4)
    assert s["mtp"]["vs_llama_bench"]["rounds"] == 2
    # Against plain in the same round: 180 / 150 and 192 / 144.
    assert (s["mtp"]["vs_plain"]["min"], s["mtp"]["vs_plain"]["max"]) == (1.2, round(192 / 144, 4))
    assert s["baseline"]["vs_plain"]["median"] == 1.0


FAKE = """#!{python}
import json, sys
from pathlib import Path
log = Path({log!r})
calls = log.read_text().count("\\n") if log.exists() else 0
with log.open("a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if {fail!r}:
    print("boom: no such device", file=sys.stderr)
    sys.exit(3)
rates = [50.0, 70.0]
print(json.dumps([{{"n_prompt": 0, "n_gen": 6, "avg_ts": rates[calls % 2]}}]))
"""


def _fake(tmp_path: Path, fail: bool = False) -> tuple[Path, Path]:
    log = tmp_path / "calls.log"
    script = tmp_path / "llama-bench"
    script.write_text(FAKE.format(python=sys.executable, log=str(log), fail=fail))
    script.chmod(0o755)
    return script, log


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # A process of its own: the script pins itself to --threads CPUs.
    command = [sys.executable, str(BENCHES / "decode_peer.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("decode_peer") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


def test_a_round_runs_the_peer_before_and_after_and_reports_ratios(tiny, tmp_path) -> None:
    script, log = _fake(tmp_path)
    done = _run(
        *["--model", str(tiny), "--llama-bench", str(script), "--threads", "1"],
        *["--max-tokens", "6", "--proposer", "prompt-lookup"],
        *["--", "--prompts", "2", "--max-seq-len", "1024"],
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2, "llama-bench runs before and after specdraft"
    for argv in calls:
        assert argv == ["-m", str(tiny), "-t", "1", "-p", "0", "-n", "6", "-r", "3", "-o", "json"]
    (only,) = report["rounds"]
    assert only["llama_bench_tokens_per_s"] == [50.0, 70.0]
    assert only["llama_bench_mean"] == 60.0
    rows = {r["row"]: r for r in only["rows"]}
    assert set(rows) == {"baseline", "prompt-lookup (adaptive)"}
    assert rows["prompt-lookup (adaptive)"]["identical_to_baseline"] is True
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and row["errors"] == []
        assert report["summary"][name]["vs_llama_bench"]["median"] == round(
            row["tokens_per_s"] / 60.0, 4
        )
    assert report["threads"] == 1 and report["max_tokens"] == 6


def test_a_missing_or_failing_peer_and_a_model_it_cannot_read_are_named(tiny, tmp_path) -> None:
    missing = tmp_path / "no-such-llama-bench"
    done = _run("--model", str(tiny), "--llama-bench", str(missing))
    assert done.returncode == 2 and f"no llama-bench at {missing}" in done.stderr
    folder = tmp_path / "hf-folder"
    folder.mkdir()
    done = _run("--model", str(folder), "--llama-bench", str(missing))
    assert done.returncode == 2 and "llama-bench reads GGUF files" in done.stderr
    script, _ = _fake(tmp_path, fail=True)
    done = _run("--model", str(tiny), "--llama-bench", str(script), "--threads", "1")
    assert done.returncode == 1
    assert "llama-bench exited 3: boom: no such device" in done.stderr
    assert done.stdout == ""
