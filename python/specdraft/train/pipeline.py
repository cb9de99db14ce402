"""``train_mtp``: corpus, target hiddens, draft vocabulary, training, evaluation, files.

Each stage is cached or checkpointed, so an interrupted run picks up where it was.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import jax.numpy as jnp
import numpy as np

from specdraft.train import data as corpus
from specdraft.train.cache import HiddenCache, bf16_bits, from_bf16_bits
from specdraft.train.evaluate import Acceptance, evaluate
from specdraft.train.export import read_head, start_weights, write_head
from specdraft.train.head import head_dims, init_params
from specdraft.train.progress import Progress
from specdraft.train.targets import (
    extract_eval,
    extract_replies,
    extract_train,
    read_target_weights,
    target_shape,
)
from specdraft.train.trainer import Batches, Trainer, TrainSettings
from specdraft.train.vocab import target_choices, vocab_coverage

__all__ = ["RunOptions", "train_mtp"]

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
#: Prompts the engine decodes side by side when it writes the target's replies: a step of 16
#: rows gives about 15% more tokens a second than one of 8 on a 2-core CPU (model_decode's
#: verify table: 16 rows 3.3x a one-row forward, 8 rows 1.9x).
REPLY_BATCH = 16
#: Steps the progress line's running mean of the loss covers.
RUNNING_MEAN_STEPS = 50


@dataclass(frozen=True)
class RunOptions:
    """Everything ``specdraft train-mtp`` takes (see its ``--help``)."""

    target: str = "smollm2"
    out: Path = Path("smollm2-mtp")
    corpora: tuple[str, ...] = ("sharegpt", "chitchat")
    tokens: int = 300_000
    draft_vocab: int = 16384
    eval_prompts: int = 16
    eval_new_tokens: int = 96
    eval_fraction: float = 0.02
    cache: Path | None = None
    resume: bool = False
    max_steps: int | None = None
    #: A checkpoint (``state.npz``), a trained head (its folder or ``mtp.safetensors``) or
    #: a shipped head's name, whose weights the head starts from, with a fresh optimizer and
    #: this run's schedule (ignored when ``resume`` finds a checkpoint).
    init_from: Path | None = None
    #: Stop training after this many seconds of it (then evaluate and write the head).
    max_seconds: float | None = None
    #: Stop extracting training hiddens after this many seconds of it; training then uses
    #: the sequences cached so far (a later run with a larger limit goes on from there).
    max_extract_seconds: float | None = None
    #: The run's length in steps: the learning-rate schedule decays over this many (at most
    #: the epochs' steps), and training ends there.
    train_steps: int | None = None
    #: Training positions the draft-vocabulary coverage is measured on (each costs a
    #: full-vocabulary LM head, so it is a sample).
    coverage_tokens: int = 20_000
    #: ``"corpus"``: train on the conversations as written (teacher forcing); ``"target"``:
    #: on each conversation's prompt followed by the target's own greedy reply.
    responses: str = "corpus"
    #: With ``responses="target"``: the most ids of a generated reply.
    reply_tokens: int = 256
    settings: TrainSettings = field(default_factory=TrainSettings)


def _log(stream: TextIO, message: str) -> None:
    stream.write(message + "\n")
    stream.flush()


def _frozen(weights: Any, draft_vocab: int) -> dict[str, Any]:  # noqa: ANN401
    return {
        "embed": jnp.asarray(weights.embed),
        "lm_head": jnp.asarray(weights.lm_head[:draft_vocab]),
        "target_norm": jnp.asarray(weights.final_norm),
    }


def _card(opts: RunOptions, report: dict[str, Any]) -> str:
    acc = report["acceptance"]
    by_pos = ", ".join(f"{x:.1%}" for x in acc["acceptance_by_position"])
    cov = report["draft_vocab_coverage"]
    licences = "; ".join(corpus.LICENCES.get(c, f"{c}: not stated") for c in opts.corpora)
    replies = (
        ", their prompts followed by the target's own greedy replies"
        if opts.responses == "target"
        else ""
    )
    # As report.json records it, so the card and the report name the same start.
    start = (
        "from fresh weights"
        if report["init_from"] is None
        else f"starting from the weights of `{report['init_from']}`"
    )
    return f"""# MTP draft head for {report["target"]["name"]}

A DeepSeek-V3-style multi-token-prediction module (one decoder layer; the target's
embedding, final norm and LM head are shared, not stored here) trained by
`specdraft train-mtp` to draft for `{report["target"]["file"]}`.

- Data: {", ".join(opts.corpora)} conversations rendered through the target's chat
  template{replies}, one per distinct prompt, {report["train_tokens"]} training tokens in
  {report["train_sequences"]} sequences of at most {opts.settings.seq_len} tokens, of which
  this run's steps took {report["trained_tokens"]}; the loss learns on each sequence's reply
  only (from its first assistant turn on). {report["eval_sequences"]} held-out prompts
  (split by the hash of the prompt's text, seed {opts.settings.seed}, fraction
  {opts.eval_fraction}) with the target's greedy continuations for evaluation.
- Recipe: self-distillation, forward KL from the target's distribution (its stored hidden
  through its frozen final norm and LM head) to the head's, {opts.settings.steps} unrolled
  drafts feeding the head its own hidden, weights 0.8^j; AdamW lr {opts.settings.lr},
  batch {opts.settings.batch}, {report["steps"]} steps ({opts.settings.epochs} epoch(s)),
  seed {opts.settings.seed}, {report["train_seconds"]:.0f} s of training, {start}.
- Draft vocabulary: the first {opts.draft_vocab} token ids (`mtp_vocab_size`), which hold
  the target's greedy choice at {cov.get(str(opts.draft_vocab), 0.0):.1%} of training
  positions.
- Held-out greedy acceptance at {acc["drafts"]} drafts: by position [{by_pos}], mean
  acceptance length {acc["mean_acceptance_length"]:.3f} (engine walk
  {acc["engine_mean_acceptance_length"]:.3f}; with `SPECDRAFT_MTP_KV_EXACT=1`
  {acc["exact_kv_engine_mean_acceptance_length"]:.3f}).

Data licences: {licences}.

`report.json` holds every figure.
"""


def train_mtp(
    opts: RunOptions,
    stream: TextIO | None = None,
    conversations: list[corpus.Conversation] | None = None,
) -> dict[str, Any]:
    """Run the whole pipeline and write the head into ``opts.out``; returns the report.

    ``conversations`` replaces the named corpora (for tests and for your own data).
    """
    import specdraft
    from specdraft.models import cache_dir, resolve_model
    from specdraft.tokenizer import load_tokenizer

    log = stream or sys.stderr
    s = opts.settings
    if opts.draft_vocab < 1 or s.steps < 1 or s.batch < 1 or s.seq_len < s.steps + 2:
        raise ValueError(
            "draft_vocab, unroll steps and batch must be positive and seq_len > steps + 1"
        )
    if opts.responses not in ("corpus", "target"):
        raise ValueError(f"responses must be 'corpus' or 'target', not {opts.responses!r}")
    start = None if opts.init_from is None else start_weights(opts.init_from)
    path = resolve_model(opts.target)
    model = specdraft.load_model(opts.target, max_seq_len=max(s.seq_len, 1024))
    shape = target_shape(model.config)
    if opts.draft_vocab > shape.vocab:
        raise ValueError(f"draft vocabulary {opts.draft_vocab} > target vocabulary {shape.vocab}")
    tokenizer = load_tokenizer(path)
    # One cache per split: a cache holds the held-out prompts of the split it was made for,
    # and would leak them into training under another seed or fraction.
    split = corpus.split_record(s.seed, opts.eval_fraction)
    tag = corpus.split_tag(s.seed, opts.eval_fraction)
    folder = opts.cache or cache_dir() / "train-mtp" / Path(str(path)).stem / tag
    cache = HiddenCache(folder, str(path), shape.hidden, split=split)
    _log(log, f"train-mtp: target {path} ({shape.hidden} hidden), cache {folder}")

    convs = conversations
    if convs is None:
        convs = [c for name in opts.corpora for c in corpus.read_conversations(name)]
    unique = corpus.deduplicated(convs)
    order = corpus.shuffled(unique, s.seed)
    held = [c for c in order if corpus.is_held_out(s.seed, c, opts.eval_fraction)]
    train = [c for c in order if not corpus.is_held_out(s.seed, c, opts.eval_fraction)]
    _log(
        log,
        f"train-mtp: {len(convs)} conversations, {len(unique)} with distinct prompts: "
        f"{len(train)} training and {len(held)} held-out",
    )
    t0 = time.monotonic()
    max_prompt = max(s.seq_len - opts.eval_new_tokens, s.seq_len // 2)
    extract_eval(model, tokenizer, cache, held, opts.eval_prompts, opts.eval_new_tokens, max_prompt)
    eval_tokens = sum(x.length for x in cache.split("eval"))
    t_extract = time.monotonic()
    deadline = None if opts.max_extract_seconds is None else t_extract + opts.max_extract_seconds
    if opts.responses == "target":
        engine = specdraft.SpecEngine(model, None)

        def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
            out = []
            for r in engine.generate(prompts, max_tokens=n):
                if r.error is not None:
                    raise RuntimeError(f"the target failed to generate a reply: {r.error}")
                out.append(list(r.tokens))
            return out

        extracted = extract_replies(
            generate,
            model,
            tokenizer,
            cache,
            train,
            s.seq_len,
            opts.reply_tokens,
            opts.tokens,
            batch=REPLY_BATCH,
            deadline=deadline,
        )
        del engine
    else:
        seqs = corpus.tokenize_conversations(tokenizer, train, s.seq_len, opts.tokens)
        extracted = extract_train(model, cache, seqs, deadline=deadline)
    extract_seconds = time.monotonic() - t0
    if extracted:
        rate = extracted / max(time.monotonic() - t_extract, 1e-9)
        _log(log, f"train-mtp: cached target hiddens of {extracted} new tokens ({rate:.1f} tok/s)")
    del model

    weights = read_target_weights(path)
    full = {"target_norm": jnp.asarray(weights.final_norm), "lm_head": jnp.asarray(weights.lm_head)}
    choices = target_choices(cache, full, shape.rms_norm_eps, limit=opts.coverage_tokens)
    coverage = vocab_coverage(choices, (*COVERAGE_SIZES, opts.draft_vocab))
    _log(
        log,
        "train-mtp: draft vocabulary coverage of the target's choices: "
        + ", ".join(f"{n}: {c:.1%}" for n, c in sorted(coverage.items())),
    )

    d = head_dims(shape)
    frozen = _frozen(weights, opts.draft_vocab)
    batches = Batches(cache, s)
    planned = batches.per_epoch * s.epochs
    trainer = Trainer(d, frozen, s, min(planned, opts.train_steps or planned))
    state = trainer.init_state(init_params(d, s.seed))
    ckpt = opts.out / "checkpoint" / "state.npz"
    if opts.resume and ckpt.exists():
        state = trainer.load(state, ckpt)
        _log(log, f"train-mtp: resumed from {ckpt} at step {state.step}")
    elif start is not None:
        if start.suffix == ".npz":
            state = trainer.load_params(state, start)
        else:
            state = trainer.init_state(read_head(start, shape, d))
        _log(log, f"train-mtp: starting from the weights of {start}")
    bar = Progress(trainer.total_steps, "train-mtp", "step")
    bar.update(state.step)
    first_losses: list[float] = []
    last_losses: list[float] = []
    recent: list[float] = []

    def on_step(st: Any, loss: float, kls: np.ndarray) -> None:  # noqa: ANN401
        if len(first_losses) < 10:
            first_losses.append(loss)
        last_losses.append(loss)
        del last_losses[:-10]
        # One batch's loss swings with its text; the running mean shows the trend.
        recent.append(loss)
        del recent[:-RUNNING_MEAN_STEPS]
        bar.update(
            1,
            f"loss {loss:.4f} (mean of last {len(recent)}: {np.mean(recent):.4f}) kl/step "
            + " ".join(f"{k:.3f}" for k in kls),
        )

    t1 = time.monotonic()
    deadline = None if opts.max_seconds is None else t1 + opts.max_seconds
    state = trainer.run(
        state, batches, ckpt, stop_at=opts.max_steps, on_step=on_step, deadline=deadline
    )
    bar.close()

    params = {k: np.asarray(v) for k, v in state.params.items()}
    # The weights as written (BF16), which the engine loads.
    written = {k: jnp.asarray(from_bf16_bits(bf16_bits(v))) for k, v in params.items()}
    acceptance: Acceptance = evaluate(written, frozen, d, cache, s.steps)
    _log(log, "train-mtp: held-out " + acceptance.describe())
    train_tokens = sum(x.length for x in batches.sequences)
    trained_tokens = batches.tokens_in(state.step)
    report = {
        "target": {"name": opts.target, "file": Path(str(path)).name},
        "train_sequences": len(batches.sequences),
        "train_tokens": train_tokens,
        "trained_tokens": trained_tokens,
        "eval_sequences": len(cache.split("eval")),
        "eval_tokens": eval_tokens,
        "extract_seconds": round(extract_seconds, 1),
        "steps": state.step,
        "init_from": None if opts.init_from is None else str(opts.init_from),
        "responses": opts.responses,
        "total_steps": trainer.total_steps,
        "train_seconds": round(state.seconds, 1),
        "first_losses": first_losses,
        "last_losses": last_losses,
        "draft_vocab": opts.draft_vocab,
        "draft_vocab_coverage": {str(k): round(v, 4) for k, v in sorted(coverage.items())},
        "acceptance": acceptance.to_dict(),
        "settings": asdict(s),
    }
    write_head(opts.out, params, shape, d, opts.draft_vocab, report["target"], _card(opts, report))
    (opts.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(log, f"train-mtp: wrote {opts.out}")
    return report
