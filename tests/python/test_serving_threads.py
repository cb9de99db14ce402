"""``specdraft.ServingEngine`` called from two Python threads at once.

Both threads submit, step, cancel and read the engine's state concurrently, with a Rust
proposer and with one written in Python (whose calls inside a step take the interpreter
back while the other thread holds it). Neither may deadlock (both end within a bound), no
request's tokens may be lost, repeated or mixed with another's: each request's updates,
whichever thread's step returned them, merge into exactly its solo greedy output (a prefix
of it when it was cancelled), each request ends once, and afterwards the KV pool is whole and
the device ledger holds what it held before the first request.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from functools import cache
from pathlib import Path

import pytest
import specdraft

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from ngram_proposer import PyLookup  # noqa: E402
from test_engine import _load, write_tiny_chat_gguf  # noqa: E402

PROMPTS = ["hello there", "abcabcabcabc", "the cat sat on the mat", "x", "0123401234", "ab ab"]
MAX_TOKENS = 20
#: Requests each thread submits.
PER_THREAD = 12
#: Seconds both threads get to finish everything (a deadlock fails here).
BOUND_S = 120.0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serving_threads") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


def merges_into(a: list[list[int]], b: list[list[int]], whole: list[int]) -> bool:
    """Whether the chunks ``a`` and ``b``, each in its own order, interleave into ``whole``.

    Each thread sees its steps' updates in order, but which thread's step came first is
    not recorded, so a request's tokens are right when some interleaving of the two
    threads' chunks gives them.
    """
    sizes_a = [0]
    for c in a:
        sizes_a.append(sizes_a[-1] + len(c))
    sizes_b = [0]
    for c in b:
        sizes_b.append(sizes_b[-1] + len(c))
    if sizes_a[-1] + sizes_b[-1] != len(whole):
        return False

    @cache
    def fits(i: int, j: int) -> bool:
        at = sizes_a[i] + sizes_b[j]
        if i == len(a) and j == len(b):
            return True
        if i < len(a) and whole[at : at + len(a[i])] == a[i] and fits(i + 1, j):
            return True
        return j < len(b) and whole[at : at + len(b[j])] == b[j] and fits(i, j + 1)

    return fits(0, 0)


def test_merges_into_accepts_only_an_interleaving() -> None:
    assert merges_into([[1, 2], [5]], [[3, 4]], [1, 2, 3, 4, 5])
    assert merges_into([], [[1], [2]], [1, 2])
    assert not merges_into([[1, 2], [5]], [[3, 4]], [1, 2, 5, 4, 3])  # b's chunk reordered
    assert not merges_into([[1, 2]], [[3]], [1, 2, 3, 3])  # a token lost
    assert not merges_into([[1, 2]], [[3], [3]], [1, 2, 3])  # a token repeated


def jitter(rng: random.Random) -> None:
    """Sleeps up to half a millisecond: lets the other thread in at varied points (without
    it, the thread that just left a step takes the engine's lock again before the waiting
    one wakes, and the two rarely overlap)."""
    time.sleep(rng.random() * 0.0005)


def run_threads(model_path: Path, proposer: str) -> None:
    """The two threads' run; raises AssertionError naming what went wrong."""
    gpu = specdraft.CpuBackend()
    model = _load(model_path, gpu, kv_blocks=48)
    drafter = specdraft.PromptLookup() if proposer == "rust" else PyLookup()
    # A fixed policy drafts every step, so the Python proposer runs inside every step.
    engine = specdraft.SpecEngine(model, drafter, num_drafts=3, max_batch=4, draft_policy="fixed")
    solo = {
        p: list(engine.generate([p], max_tokens=MAX_TOKENS, ignore_eos=True)[0].tokens)
        for p in PROMPTS
    }
    assert len({tuple(t) for t in solo.values()}) == len(PROMPTS), "the outputs differ"
    baseline = gpu.live_allocs
    serving = specdraft.ServingEngine(engine)
    total = serving.kv_blocks[0]

    lock = threading.Lock()
    prompt_of: dict[int, str] = {}
    # Per request, the chunks each thread's steps returned, in that thread's order.
    chunks: dict[int, dict[str, list[list[int]]]] = {}
    ends: dict[int, list[str]] = {}
    cancelled: set[int] = set()
    problems: list[str] = []
    done_submitting = threading.Barrier(2)

    def record(name: str, updates: list) -> None:
        with lock:
            for rid, tokens, finish, _metrics, error in updates:
                if error is not None:
                    problems.append(f"request {rid}: {error}")
                per = chunks.setdefault(rid, {"a": [], "b": []})
                if tokens:
                    per[name].append(list(tokens))
                if finish is not None:
                    ends.setdefault(rid, []).append(finish)

    def check_state(name: str) -> None:
        free = serving.kv_blocks[1]
        waiting, running = serving.waiting, serving.running
        if not 0 <= free <= total or running > 4 or waiting < 0:
            problems.append(f"{name}: free {free} of {total}, running {running}")

    def worker(name: str, seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            for k in range(PER_THREAD):
                prompt = PROMPTS[(k + seed) % len(PROMPTS)]
                rid = serving.submit(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
                with lock:
                    assert rid not in prompt_of, f"id {rid} given twice"
                    prompt_of[rid] = prompt
                mine.append(rid)
                for _ in range(rng.randrange(3)):
                    record(name, serving.step())
                    jitter(rng)
                    check_state(name)
                if k % 4 == 3:
                    # Cancel one of this thread's requests, running or waiting.
                    victim = rng.choice(mine)
                    if serving.cancel(victim):
                        with lock:
                            cancelled.add(victim)
            done_submitting.wait(BOUND_S)
            deadline = time.monotonic() + BOUND_S
            while not serving.idle:
                record(name, serving.step())
                jitter(rng)
                check_state(name)
                assert time.monotonic() < deadline, "the run does not end"
            # What the other thread's last step ended may still be in one more poll.
            record(name, serving.step())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            problems.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(n, s)) for n, s in (("a", 1), ("b", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    assert len(prompt_of) == 2 * PER_THREAD
    assert cancelled, "some requests were cancelled while others ran"
    for rid, prompt in prompt_of.items():
        assert len(ends.get(rid, [])) == 1, f"request {rid} ended {ends.get(rid)}"
        per = chunks.get(rid, {"a": [], "b": []})
        got = sum(map(len, per["a"] + per["b"]))
        if rid in cancelled:
            assert ends[rid] == ["cancelled"], (rid, ends[rid])
            whole = solo[prompt][:got]
        else:
            assert ends[rid] == ["length"], (rid, ends[rid])
            whole = solo[prompt]
        assert merges_into(per["a"], per["b"], whole), (rid, prompt, per, solo[prompt])
    assert serving.idle and serving.kv_blocks == (total, total)
    assert gpu.live_allocs == baseline, gpu.live_report()
    serving.close()


@pytest.mark.parametrize("proposer", ["rust", "python"])
def test_two_threads_submitting_stepping_and_cancelling_get_solo_outputs(model_path, proposer):
    # In a child process: a deadlock there can hold the interpreter's lock, which would
    # stop this process too; the child is killed at the bound instead.
    try:
        done = subprocess.run(
            [sys.executable, __file__, str(model_path), proposer],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=BOUND_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two threads did not end within {BOUND_S:.0f} s: a deadlock")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")


if __name__ == "__main__":
    run_threads(Path(sys.argv[1]), sys.argv[2])
    print("ok")
