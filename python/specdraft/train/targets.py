"""What the trainer takes from the target: shape, frozen output weights, hidden states.

The hidden states come from specdraft's own target model (``TargetModel.hidden_states``,
a teacher-forced forward), so the head learns exactly the hiddens the engine hands it: the
final hidden, or the outputs of the layers the cache holds (``cache.layers``), side by
side, as the engine captures them for a proposer that names them. The
target's embedding, final norm and LM head are read from the model file in float32 (a GGUF
file through :mod:`specdraft.gguf_tensors`, a Hugging Face folder as safetensors through
:func:`specdraft.quantize.read_safetensors`; both check the untrusted file before reading).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from specdraft.train.cache import HiddenCache
from specdraft.train.data import Conversation, TokenizedConversation
from specdraft.train.progress import Progress

__all__ = [
    "REPLY_CORPUS_SUFFIX",
    "TargetShape",
    "TargetWeights",
    "eval_prompt",
    "extract_eval",
    "extract_replies",
    "extract_train",
    "read_target_weights",
    "target_rows",
    "target_shape",
]

#: Training sequences of the target's own replies are cached under their corpus name with
#: this suffix, so a cache shared with teacher-forced text keeps the two apart.
REPLY_CORPUS_SUFFIX = ":target-replies"


@dataclass(frozen=True)
class TargetShape:
    """The target's sizes that the head copies (one decoder layer of the same shape)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    num_hidden_layers: int
    rms_norm_eps: float
    rope_theta: float
    model_type: str
    max_position_embeddings: int = 2048


def target_shape(config: Any) -> TargetShape:  # noqa: ANN401 - specdraft.ModelConfig
    """The :class:`TargetShape` of a ``specdraft.ModelConfig``."""
    return TargetShape(
        hidden=int(config.hidden_size),
        heads=int(config.num_attention_heads),
        kv_heads=int(config.num_key_value_heads),
        head_dim=int(config.head_dim),
        ffn=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        num_hidden_layers=int(config.num_hidden_layers),
        rms_norm_eps=float(config.rms_norm_eps),
        rope_theta=float(config.rope_theta),
        model_type=str(config.model_type),
        max_position_embeddings=int(config.max_position_embeddings),
    )


@dataclass(frozen=True)
class TargetWeights:
    """The target's frozen float32 weights that the head shares.

    Embedding ``[vocab, hidden]``, final norm ``[hidden]`` and LM head ``[vocab, hidden]``
    (the embedding when tied).
    """

    embed: np.ndarray
    final_norm: np.ndarray
    lm_head: np.ndarray


def _gguf_weights(path: Path) -> TargetWeights:
    from specdraft.gguf_tensors import read_gguf_tensors

    # specdraft's bounded reader, not gguf.GGUFReader: the file is untrusted input.
    names = ("token_embd.weight", "output_norm.weight", "output.weight")
    tensors = read_gguf_tensors(path, names)
    for name in names[:2]:
        if name not in tensors:
            raise ValueError(f"{path}: no tensor {name!r}")
    embed = tensors["token_embd.weight"]
    return TargetWeights(embed, tensors["output_norm.weight"], tensors.get("output.weight", embed))


def _safetensors_weights(folder: Path) -> TargetWeights:
    from specdraft.quantize import read_safetensors, to_float32

    raw: dict[str, tuple[str, list[int], bytes]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw.update(read_safetensors(f))
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        if name not in raw:
            raise ValueError(f"{folder}: no tensor {name!r}")
    embed = to_float32(*raw["model.embed_tokens.weight"])
    lm = to_float32(*raw["lm_head.weight"]) if "lm_head.weight" in raw else embed
    return TargetWeights(embed, to_float32(*raw["model.norm.weight"]), lm)


def read_target_weights(path: str | os.PathLike[str]) -> TargetWeights:
    """The embedding, final norm and LM head of a ``.gguf`` file or a checkpoint folder."""
    p = Path(path)
    return _safetensors_weights(p) if p.is_dir() else _gguf_weights(p)


def target_rows(
    model: Any,  # noqa: ANN401 - specdraft.TargetModel
    cache: HiddenCache,
    tokens: Sequence[int],
) -> np.ndarray:
    """The rows ``cache`` holds for a teacher-forced forward over ``tokens`` (float32).

    Raises ``RuntimeError`` when the cache needs layers that this build's
    ``TargetModel.hidden_states`` cannot return.
    """
    if not cache.layers:
        return model.hidden_states(tokens)
    try:
        return model.hidden_states(tokens, layers=list(cache.layers))
    except TypeError as e:
        raise RuntimeError(
            f"this build's TargetModel.hidden_states takes no layers= ({e}); the cache needs "
            f"the outputs of layers {list(cache.layers)}: rebuild the extension"
        ) from e


def extract_train(
    model: Any,  # noqa: ANN401 - specdraft.TargetModel
    cache: HiddenCache,
    conversations: Sequence[TokenizedConversation],
    deadline: float | None = None,
) -> int:
    """Cache the target's hiddens over each training sequence not cached yet, in order.

    Each is listed with its reply's start (``TokenizedConversation.start``), where training
    begins to learn. Stops before the next sequence once ``time.monotonic()`` has reached
    ``deadline``, so a long corpus is cut to what the time allows (the sequences cached so
    far stay cached and a later call goes on from there). Returns the number of tokens
    cached by this call.
    """
    todo = [c for c in conversations if not cache.has(c.corpus, c.id, "train")]
    if not todo:
        return 0
    bar = Progress(sum(len(c.tokens) for c in todo), "target hiddens (train)", "tok")
    cached = 0
    for conv in todo:
        if deadline is not None and time.monotonic() >= deadline:
            break
        hiddens = target_rows(model, cache, conv.tokens)
        cache.append(conv.corpus, conv.id, "train", conv.tokens, hiddens, start=conv.start)
        bar.update(len(conv.tokens))
        cached += len(conv.tokens)
    bar.close()
    return cached


def eval_prompt(
    tokenizer: Any,  # noqa: ANN401 - specdraft.tokenizer.Tokenizer
    conv: Conversation,
) -> list[int]:
    """A held-out conversation's prompt, as token ids.

    Its messages before the first assistant turn, rendered with the generation prompt;
    empty when no user turn comes first.
    """
    messages = []
    for m in conv.messages:
        if m["role"] == "assistant":
            break
        messages.append(m)
    if not any(m["role"] == "user" for m in messages):
        return []
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(tokenizer.encode(text))


def extract_eval(
    model: Any,  # noqa: ANN401 - specdraft.TargetModel
    tokenizer: Any,  # noqa: ANN401 - specdraft.tokenizer.Tokenizer
    cache: HiddenCache,
    conversations: Sequence[Conversation],
    prompts: int,
    new_tokens: int,
    max_prompt: int,
) -> None:
    """Cache up to ``prompts`` evaluation sequences with the target's hiddens over them.

    A sequence is a held-out prompt followed by the target's own greedy continuation.

    On such text every token after the prompt is the target's greedy choice, so drafts
    compared with it are accepted or rejected exactly as the engine's greedy verify would.
    """
    have = len(cache.split("eval"))
    if have >= prompts:
        return
    bar = Progress(prompts - have, "target greedy continuations (eval)", "seq")
    for conv in conversations:
        if have >= prompts:
            break
        if cache.has(conv.corpus, conv.id, "eval"):
            continue
        prompt = eval_prompt(tokenizer, conv)
        if not prompt or len(prompt) > max_prompt:
            continue
        generated = list(model.generate_greedy(prompt, new_tokens))
        if len(generated) < 2:
            continue
        seq = prompt + generated
        rows = target_rows(model, cache, seq)
        cache.append(conv.corpus, conv.id, "eval", seq, rows, start=len(prompt))
        have += 1
        bar.update(1)
    bar.close()


def extract_replies(
    generate: Callable[[list[list[int]], int], list[list[int]]],
    model: Any,  # noqa: ANN401 - specdraft.TargetModel
    tokenizer: Any,  # noqa: ANN401 - specdraft.tokenizer.Tokenizer
    cache: HiddenCache,
    conversations: Sequence[Conversation],
    max_len: int,
    reply_tokens: int,
    tokens: int,
    batch: int = 8,
    deadline: float | None = None,
) -> int:
    """Cache training sequences of the target's own replies after the corpus's prompts.

    A sequence is a conversation's prompt (as :func:`eval_prompt`), then what the target
    generates after it: ``generate(prompts, n)`` returns each prompt's greedy continuation
    (at most ``n`` ids), and takes the prompts ``batch`` at a time, so that the engine
    decodes them side by side. A reply is cut where the sequence reaches ``max_len``;
    prompts leaving fewer than 16 positions for one are passed over. A sequence's drafts
    start at its prompt's end (``start``), and it is cached under its corpus name plus
    :data:`REPLY_CORPUS_SUFFIX`.

    This is the text the head drafts on in use: every token after the prompt is the target's
    own greedy choice, where teacher-forced corpus text is someone else's. Stops once the
    cache holds ``tokens`` such tokens, or before the next batch once ``time.monotonic()`` has
    reached ``deadline``; returns the number of tokens cached by this call.
    """
    have = sum(s.length for s in cache.split("train") if s.corpus.endswith(REPLY_CORPUS_SUFFIX))
    if have >= tokens:
        return 0
    # Prompts are rendered as their batch is taken: a run that needs few replies, or resumes
    # with the budget nearly cached, does not render every conversation first.
    pending = (
        (conv, prompt)
        for conv in conversations
        if not cache.has(conv.corpus + REPLY_CORPUS_SUFFIX, conv.id, "train")
        for prompt in [eval_prompt(tokenizer, conv)]
        if prompt and len(prompt) + 16 <= max_len
    )
    bar: Progress | None = None
    cached = 0
    while have + cached < tokens:
        if deadline is not None and time.monotonic() >= deadline:
            break
        group = list(islice(pending, batch))
        if not group:
            break
        if bar is None:
            bar = Progress(tokens - have, "target replies (train)", "tok")
        replies = generate([prompt for _, prompt in group], reply_tokens)
        if len(replies) != len(group):
            raise RuntimeError(f"{len(replies)} replies to {len(group)} prompts")
        for (conv, prompt), reply in zip(group, replies, strict=True):
            seq = (prompt + list(reply))[:max_len]
            if len(seq) < len(prompt) + 2:
                continue
            cache.append(
                conv.corpus + REPLY_CORPUS_SUFFIX,
                conv.id,
                "train",
                seq,
                target_rows(model, cache, seq),
                start=len(prompt),
            )
            bar.update(len(seq))
            cached += len(seq)
    if bar is not None:
        bar.close()
    return cached
