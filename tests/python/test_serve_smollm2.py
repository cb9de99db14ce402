"""``specdraft serve`` on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF), whose
replies vary from prompt to prompt and from seed to seed, with the real ``openai`` client:
chat and completions, streamed and not, give offline ``generate``'s text for greedy decoding
and a seeded sample; 32 concurrent streams each get their solo text; a stop string cuts the
reply where it begins. Slow (runs 135M parameters on the CPU backend): marked ``slow``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from specdraft.models import fetch_default_model

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
from serve_harness import MODEL, serve  # noqa: E402

TOPICS = ["the sea", "tea", "rivers", "rust", "owls", "snow", "maps", "bread"]
SAMPLING = [{"temperature": 0.0, "seed": 0}, {"temperature": 0.8, "seed": 7}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)


def chat(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


@pytest.fixture(scope="module")
def smollm2_path():
    return fetch_default_model()


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_replies_equal_offline_generate_streamed_or_not(smollm2_path, sampling):
    kw = {"max_tokens": 24, **sampling}
    with serve(smollm2_path) as s:
        c = client(s.url)
        (want,) = s.engine.chat([chat("the sea")], **kw)
        got = c.chat.completions.create(model=MODEL, messages=chat("the sea"), **kw)
        assert got.choices[0].message.content == want.text
        assert got.usage.completion_tokens == len(want.tokens)
        streamed = "".join(
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(
                model=MODEL, messages=chat("the sea"), stream=True, **kw
            )
            if ch.choices
        )
        assert streamed == want.text

        # Characters split across tokens are never split in the stream.
        japanese = [{"role": "user", "content": "Translate to Japanese: good morning"}]
        (want,) = s.engine.chat([japanese], **kw)
        streamed = "".join(
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(model=MODEL, messages=japanese, stream=True, **kw)
            if ch.choices
        )
        assert streamed == want.text

        # A reply that ends at the model's EOS: its text stops before the EOS token.
        short = [{"role": "user", "content": "Answer with one word: what colour is the sky?"}]
        (want,) = s.engine.chat([short], **{**kw, "max_tokens": 48})
        assert want.finish_reason == "stop", want.text
        got = c.chat.completions.create(model=MODEL, messages=short, **{**kw, "max_tokens": 48})
        assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, "stop")

        prompt = "The three largest cities of France are"
        (want,) = s.engine.generate([prompt], **kw)
        assert c.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].text == want.text
        streamed = "".join(
            ch.choices[0].text
            for ch in c.completions.create(model=MODEL, prompt=prompt, stream=True, **kw)
            if ch.choices
        )
        assert streamed == want.text


@pytest.mark.slow
def test_32_concurrent_streams_each_get_their_solo_text(smollm2_path):
    n = 32
    asks = [(chat(TOPICS[i % len(TOPICS)]), SAMPLING[i % 2]["temperature"], i) for i in range(n)]
    with serve(smollm2_path) as s:
        solo = [
            s.engine.chat([m], max_tokens=16, temperature=t, seed=seed)[0].text
            for m, t, seed in asks
        ]
        assert len(set(solo)) > n // 4, "the replies differ, so a mix-up would show"
        c = client(s.url)

        def one(i: int) -> str:
            m, t, seed = asks[i]
            stream = c.chat.completions.create(
                model=MODEL, messages=m, max_tokens=16, temperature=t, seed=seed, stream=True
            )
            return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(one, range(n), timeout=300))
        assert got == solo


@pytest.mark.slow
def test_a_stop_string_cuts_the_reply_where_it_begins(smollm2_path):
    prompt = "The three largest cities of France are"
    with serve(smollm2_path) as s:
        (want,) = s.engine.generate([prompt], max_tokens=32, temperature=0)
        words = want.text.split()
        assert len(words) >= 4, want.text
        stop = words[2][1:] + " " + words[3][:2]  # spans a word boundary, so several tokens
        assert stop in want.text
        got = client(s.url).completions.create(
            model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop, "@@@"]
        )
        assert got.choices[0].text == want.text[: want.text.index(stop)]
        assert got.choices[0].finish_reason == "stop"
