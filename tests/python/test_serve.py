"""``specdraft serve`` over HTTP with the real ``openai`` client, on the tiny chat GGUF:
chat and completions, streamed and not, give offline ``generate``'s text (greedy and a
seeded sample); concurrent streams each get their solo text; a disconnect frees its KV;
each bad request gets its OpenAI error while another stream continues; the command drains
and exits 0 on SIGTERM. Everything binds 127.0.0.1 and is bounded in count and time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
from serve_harness import MODEL, free_port, metric, serve, wait_for  # noqa: E402
from test_engine import write_tiny_chat_gguf  # noqa: E402

CHATS = [
    [{"role": "user", "content": f"say something about {w}"}]
    for w in ["cats", "abcabc", "the sea", "x", "numbers 1 2 3 1 2 3", "rust", "tea", "q"]
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny-chat.gguf"
    write_tiny_chat_gguf(path)
    return path


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=60, max_retries=0)


def test_chat_and_completions_give_offline_text_streamed_or_not(model_path):
    with serve(model_path) as s:
        c = client(s.url)
        assert [m.id for m in c.models.list().data] == [MODEL]
        for temperature, seed in [(0.0, 0), (0.9, 11)]:
            kw = {"max_tokens": 20, "temperature": temperature, "seed": seed}
            (want,) = s.engine.chat([CHATS[0]], **kw)
            got = c.chat.completions.create(model=MODEL, messages=CHATS[0], **kw)
            assert got.choices[0].message.content == want.text
            assert (
                got.choices[0].finish_reason
                == {"length": "length", "stop": "stop"}[want.finish_reason]
            )
            assert got.usage.completion_tokens == len(want.tokens)
            assert (
                got.usage.model_extra["drafted_tokens"] >= got.usage.model_extra["accepted_tokens"]
            )
            parts, usage = [], None
            for chunk in c.chat.completions.create(
                model=MODEL,
                messages=CHATS[0],
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            ):
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
            assert "".join(parts) == want.text
            assert usage is not None and usage.completion_tokens == len(want.tokens)

            prompt = "once upon a time"
            (want,) = s.engine.generate([prompt], **kw)
            got = c.completions.create(model=MODEL, prompt=prompt, **kw)
            assert got.choices[0].text == want.text
            streamed = "".join(
                ch.choices[0].text
                for ch in c.completions.create(model=MODEL, prompt=prompt, stream=True, **kw)
                if ch.choices
            )
            assert streamed == want.text


def test_response_format_constrains_the_reply_as_the_engine_grammar_does(model_path):
    from specdraft.grammar import Grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with serve(model_path) as s:
        tok = s.model.tokenizer
        c = client(s.url)
        for fmt, grammar_schema in [
            ({"type": "json_object"}, {"type": "object"}),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, schema),
        ]:
            (want,) = s.engine.chat(
                [CHATS[1]],
                max_tokens=40,
                temperature=0.0,
                grammar=Grammar.json_schema(tok, grammar_schema),
            )
            got = c.chat.completions.create(
                model=MODEL, messages=CHATS[1], max_tokens=40, temperature=0, response_format=fmt
            )
            assert got.choices[0].message.content == want.text
            if want.finish_reason == "stop":
                assert isinstance(json.loads(want.text), dict)
        r = httpx.post(
            f"{s.url}/v1/chat/completions",
            json={"model": MODEL, "messages": CHATS[1], "response_format": {"type": "yaml"}},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_metrics_name_every_series_and_return_to_an_empty_pool(model_path):
    with serve(model_path) as s:
        c = client(s.url)
        for i in range(3):
            c.completions.create(model=MODEL, prompt=f"abab {i}", max_tokens=8, temperature=0)
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        for name in [
            "specdraft_requests_total",
            "specdraft_requests_running",
            "specdraft_requests_waiting",
            "specdraft_generated_tokens_total",
            "specdraft_drafted_tokens_total",
            "specdraft_accepted_tokens_total",
            "specdraft_kv_blocks_total",
            "specdraft_kv_blocks_free",
            "specdraft_device_live_allocations",
            "specdraft_device_base_allocations",
            "specdraft_time_to_first_token_seconds_bucket",
            "specdraft_inter_token_latency_seconds_count",
            "specdraft_acceptance_length_sum",
        ]:
            assert f"\n{name}{{" in text, name
        assert 'specdraft_requests_total{proposer="prompt-lookup",finish_reason="length"} 3' in text
        assert metric(s.url, "specdraft_generated_tokens_total") == 24
        assert metric(s.url, "specdraft_time_to_first_token_seconds_count") == 3
        # Tokens after each request's first step are observed, once each: at most 7 a request.
        assert 0 < metric(s.url, "specdraft_inter_token_latency_seconds_count") <= 21
        assert metric(s.url, "specdraft_kv_blocks_free") == metric(
            s.url, "specdraft_kv_blocks_total"
        )
        assert metric(s.url, "specdraft_requests_running") == 0
        # Idle again, the ledger holds what it held before the first request: the model's.
        live = metric(s.url, "specdraft_device_live_allocations")
        assert live == metric(s.url, "specdraft_device_base_allocations") == s.gpu.live_allocs


def test_concurrent_streams_each_get_their_solo_text(model_path):
    n = 32
    chats = [CHATS[i % len(CHATS)] + [{"role": "user", "content": str(i)}] for i in range(n)]
    with serve(model_path) as s:
        solo = [s.engine.chat([m], max_tokens=24, temperature=0)[0].text for m in chats]
        c = client(s.url)

        def one(i: int) -> str:
            stream = c.chat.completions.create(
                model=MODEL, messages=chats[i], max_tokens=24, temperature=0, stream=True
            )
            return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(one, range(n), timeout=120))
        assert got == solo
        assert metric(s.url, "specdraft_requests_total") >= n
        assert metric(s.url, "specdraft_time_to_first_token_seconds_count") >= n


def test_a_disconnected_stream_frees_its_kv(model_path):
    with serve(model_path, slow=True) as s:
        total = metric(s.url, "specdraft_kv_blocks_total")
        body = {
            "model": MODEL,
            "prompt": "a long story",
            "max_tokens": 240,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                assert metric(s.url, "specdraft_kv_blocks_free") < total
                base = metric(s.url, "specdraft_device_base_allocations")
                assert metric(s.url, "specdraft_device_live_allocations") > base
        # The connection is gone: the request is cancelled and its blocks come back long
        # before its 240 tokens (at least 10 ms a step) could have run out.
        wait_for(
            lambda: metric(s.url, "specdraft_kv_blocks_free") == total,
            1.5,
            what="the KV blocks of the disconnected stream",
        )
        assert metric(s.url, "specdraft_device_live_allocations") == base
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert (
            'specdraft_requests_total{proposer="prompt-lookup",finish_reason="cancelled"} 1' in text
        )
        assert s.loop.serving.running == 0


def test_a_bounded_load_with_disconnects_ends_every_request_and_frees_everything(model_path):
    n, width = 200, 32
    with serve(model_path, max_batch=16, kv_blocks=96) as s:
        baseline = s.gpu.live_allocs  # the model alone
        total = metric(s.url, "specdraft_kv_blocks_total")

        def one(i: int) -> str:
            body = {
                "model": MODEL,
                "prompt": f"request {i}: " + "ab" * (i % 7),
                "max_tokens": 8 + i % 40,
                "temperature": 0.0 if i % 2 else 0.7,
                "seed": i,
                "stream": True,
                "ignore_eos": True,
            }
            with httpx.Client(timeout=30) as h:
                with h.stream("POST", f"{s.url}/v1/completions", json=body) as r:
                    assert r.status_code == 200, r.read()
                    data = (line for line in r.iter_lines() if line.startswith("data:"))
                    if i % 10 == 3:
                        next(data)
                        return "disconnected"  # leaving the block closes the connection
                    lines = list(data)
            assert lines[-1] == "data: [DONE]"
            return json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"]

        with ThreadPoolExecutor(width) as pool:
            ends = list(pool.map(one, range(n), timeout=240))
        assert ends.count("disconnected") == n // 10
        assert ends.count("length") == n - n // 10
        wait_for(lambda: metric(s.url, "specdraft_kv_blocks_free") == total, 10, "every block")
        wait_for(lambda: s.loop.serving.idle, 10, "an idle engine")
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        ended = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("specdraft_requests_total{")
        )
        assert ended == n, text
        assert s.gpu.live_allocs == baseline, s.gpu.live_report()


def test_a_client_that_stops_waiting_for_a_whole_reply_frees_its_kv(model_path):
    with serve(model_path, slow=True) as s:
        total = metric(s.url, "specdraft_kv_blocks_total")
        body = {"model": MODEL, "prompt": "a long story", "max_tokens": 240, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
        wait_for(
            lambda: metric(s.url, "specdraft_kv_blocks_free") == total,
            1.5,
            what="the KV blocks of the abandoned request",
        )
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert 'finish_reason="cancelled"} 1' in text


def test_each_bad_request_gets_its_error_while_another_stream_runs(model_path):
    key = "sk-test"
    with serve(model_path, api_key=key, max_batch=1, max_queue=1, slow=True) as s:
        (want,) = s.engine.generate(["a long story"], max_tokens=150, ignore_eos=True)
        c = client(s.url, key)
        stream = c.completions.create(
            model=MODEL,
            prompt="a long story",
            max_tokens=150,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts = [next(iter(stream)).choices[0].text]
        auth = {"Authorization": f"Bearer {key}"}
        url = f"{s.url}/v1/completions"

        def refused(status: int, expect: str, param: str | None = None, **kw) -> None:
            r = httpx.post(url, timeout=30, **kw)
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert expect in err["message"], err
            if param is not None:
                assert err["param"] == param

        ok = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        refused(400, "not valid JSON", headers=auth, content=b"{nope")
        refused(400, "'logit_bias'", "logit_bias", headers=auth, json={**ok, "logit_bias": {}})
        refused(400, "n=2", "n", headers=auth, json={**ok, "n": 2})
        refused(400, "temperature", headers=auth, json={**ok, "temperature": -3})
        refused(400, "plus max_tokens (5000)", headers=auth, json={**ok, "max_tokens": 5000})
        refused(404, "'gpt-4'", "model", headers=auth, json={**ok, "model": "gpt-4"})
        refused(401, "API key", json=ok)
        refused(401, "API key", headers={"Authorization": "Bearer wrong"}, json=ok)
        # With one running (max_batch 1) and one waiting (max_queue 1), the next is refused.
        waiting = threading.Thread(
            target=lambda: httpx.post(url, headers=auth, json=ok, timeout=60), daemon=True
        )
        waiting.start()
        wait_for(lambda: metric(s.url, "specdraft_requests_waiting") == 1, what="a waiting one")
        r = httpx.post(url, headers=auth, json=ok, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "--max-queue 1" in r.json()["error"]["message"]
        parts += [ch.choices[0].text for ch in stream if ch.choices]
        assert "".join(parts) == want.text, "the running stream was unharmed"
        waiting.join(60)
        assert not waiting.is_alive()
        assert httpx.get(f"{s.url}/health", timeout=10).json() == {"status": "ok"}


def test_sigterm_drains_running_streams_and_exits_0(model_path, tmp_path):
    port = free_port()
    cmd = [
        sys.executable, "-m", "specdraft.cli", "serve", "--model", str(model_path),
        "--port", str(port), "--max-seq-len", "256", "--kv-blocks", "64",
        "--proposer", "serve_harness:Sleepy", "--draft-policy", "fixed",
        "--served-model-name", MODEL,
    ]  # fmt: skip
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 60, "the server to start")
        body = {"model": MODEL, "prompt": "a long story", "max_tokens": 120, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            it = r.iter_lines()
            lines.append(next(line for line in it if line.startswith("data:")))
            proc.send_signal(signal.SIGTERM)
            lines += [line for line in it if line.startswith("data:")]
        # Tokens kept coming after the signal, up to max_tokens and the end of the stream.
        assert len(lines) > 20
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length", last
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_dflash_names_the_shipped_dflash_head_and_refuses_a_second_proposer(model_path, capsys):
    from specdraft.cli import main

    base = ["serve", "--model", str(model_path), "--port", str(free_port()), "--dflash"]
    assert main([*base, "--proposer", "suffix"]) == 2
    assert "--dflash names the proposer" in capsys.readouterr().err
    # The tiny model has no shipped DFlash head: the command says so and serves nothing.
    assert main(base) == 2
    assert "dflash" in capsys.readouterr().err.lower()


def test_a_failed_engine_loop_tells_its_clients_and_health_says_so(model_path):
    class Broken:
        def decode(self, ids):
            raise RuntimeError("decoder broke")

    with serve(model_path) as s:
        s.loop.tokenizer = Broken()
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "decoder broke" in error["message"] and error["type"] == "server_error"
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 503
        r = httpx.post(f"{s.url}/v1/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 503, r.text


def test_a_handler_that_fails_answers_500_in_openai_format_and_serves_on(model_path, monkeypatch):
    from specdraft.serve import app as app_module

    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    with serve(model_path) as s:

        def unforeseen(*args):
            raise RuntimeError("unforeseen")

        with monkeypatch.context() as m:
            m.setattr(app_module, "parse", unforeseen)
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500
        assert r.json()["error"] == {
            "message": "internal error: unforeseen",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
