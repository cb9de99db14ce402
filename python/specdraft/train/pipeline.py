"""``train_head``: corpus, target hiddens, draft vocabulary, training, evaluation, files.

The same stages for every head; what differs is the method's (``RunOptions.method``, see
:mod:`specdraft.train.methods`): the layers the cache holds, the draft vocabulary's ids,
the loss, the evaluation's row forward and the files. Each stage is cached or
checkpointed, so an interrupted run picks up where it was.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import jax.numpy as jnp
import numpy as np

from specdraft.train import data as corpus
from specdraft.train.cache import HiddenCache, bf16_bits, describe_layers, from_bf16_bits
from specdraft.train.evaluate import Acceptance
from specdraft.train.export import start_weights
from specdraft.train.layer import head_dims
from specdraft.train.methods import TrainMethod, load_method
from specdraft.train.progress import Progress
from specdraft.train.targets import (
    extract_eval,
    extract_replies,
    extract_train,
    read_target_weights,
    target_shape,
)
from specdraft.train.trainer import Batches, Trainer, TrainSettings
from specdraft.train.vocab import coverage_of, heldout_choices, target_choices, vocab_coverage

__all__ = ["RunOptions", "default_cache_folder", "train_head", "train_mtp"]

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
#: Prompts the engine decodes side by side when it writes the target's replies: a step of 16
#: rows gives about 15% more tokens a second than one of 8 on a 2-core CPU (model_decode's
#: verify table: 16 rows 3.3x a one-row forward, 8 rows 1.9x).
REPLY_BATCH = 16
#: Steps the progress line's running mean of the loss covers.
RUNNING_MEAN_STEPS = 50


@dataclass(frozen=True)
class RunOptions:
    """Everything ``specdraft train`` takes (see its ``--help``)."""

    #: The head to train: a name of :data:`specdraft.train.methods.METHODS`.
    method: str = "mtp"
    target: str = "smollm2"
    out: Path = Path("smollm2-mtp")
    corpora: tuple[str, ...] = ("sharegpt", "chitchat")
    tokens: int = 300_000
    draft_vocab: int = 16384
    #: EAGLE-3: the aux layer ids (the hidden entering each), else vLLM's default; DFlash:
    #: its target layer ids (the output of each), else EAGLE-3's captured layers.
    aux_layers: tuple[int, ...] | None = None
    #: DFlash: draft decoder layers (None: the method's default).
    draft_layers: int | None = None
    #: DFlash: rows of a block, the anchor and the drafts (None: the method's default).
    block_size: int | None = None
    #: DFlash: the mask token's id (None: a special token the cached text never holds).
    mask_token: int | None = None
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
    #: Training prompts of the seed's order passed over before any is taken, so that a later
    #: run learns from prompts an earlier one (with the same seed) never saw. Such a run
    #: caches into a folder of its own (``<split>-skip<N>``).
    skip_prompts: int = 0
    settings: TrainSettings = field(default_factory=TrainSettings)


def _log(stream: TextIO, message: str) -> None:
    stream.write(message + "\n")
    stream.flush()


def _frozen(
    weights: Any,  # noqa: ANN401 - TargetWeights
    draft_vocab: int,
    draft_ids: np.ndarray | None = None,
) -> dict[str, Any]:
    """The target's frozen weights a head trains against (see :mod:`.head`).

    The LM head's rows are the first ``draft_vocab``, or those of ``draft_ids`` (then kept
    as ``draft_ids``).
    """
    if draft_ids is None:
        rows = weights.lm_head[:draft_vocab]
    else:
        rows = weights.lm_head[np.asarray(draft_ids)]
    frozen = {
        "embed": jnp.asarray(weights.embed),
        "lm_head": jnp.asarray(rows),
        "target_norm": jnp.asarray(weights.final_norm),
    }
    if draft_ids is not None:
        frozen["draft_ids"] = jnp.asarray(np.asarray(draft_ids), jnp.int32)
    return frozen


def default_cache_folder(root: Path, method: TrainMethod, target: Path, tag: str) -> Path:
    """The cache folder of a run under ``root``.

    One per target, layers and split: the MTP head's is ``train-mtp/<target>/<split>``, as
    it always was; a cache of captured layers is the same whichever head reads it, so every
    method that captures layers shares ``train-eagle3/<target>/layers-<ids>/<split>`` (where
    EAGLE-3, the first of them, made its caches): DFlash's default layers read EAGLE-3's.
    """
    name = "eagle3" if method.cache_layers else method.name
    folder = root / f"train-{name}" / target.stem
    if method.cache_layers:
        folder = folder / ("layers-" + "-".join(str(i) for i in method.cache_layers))
    return folder / tag


def _card(
    opts: RunOptions, method: TrainMethod, report: dict[str, Any], choice: dict[str, float]
) -> str:
    acc = report["acceptance"]
    by_pos = ", ".join(f"{x:.1%}" for x in acc["acceptance_by_position"])
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
    s = opts.settings
    objective = method.card_objective(s) or (
        "forward KL from the target's distribution (its stored hidden through its frozen "
        f"final norm and LM head) to the head's, {s.steps} unrolled drafts feeding the head "
        "its own hidden, weights 0.8^j"
    )
    walked = method.card_walk(acc) or (
        f"engine walk {acc['engine_mean_acceptance_length']:.3f}; with "
        f"`SPECDRAFT_MTP_KV_EXACT=1` {acc['exact_kv_engine_mean_acceptance_length']:.3f}"
    )
    return f"""{method.card_head(report["target"])}

- Data: {", ".join(opts.corpora)} conversations rendered through the target's chat
  template{replies}, one per distinct prompt, {report["train_tokens"]} training tokens in
  {report["train_sequences"]} sequences of at most {opts.settings.seq_len} tokens, of which
  this run's steps took {report["trained_tokens"]}; the loss learns on each sequence's reply
  only (from its first assistant turn on). {report["eval_sequences"]} held-out prompts
  (split by the hash of the prompt's text, seed {opts.settings.seed}, fraction
  {opts.eval_fraction}) with the target's greedy continuations for evaluation.
- Recipe: self-distillation, {objective}; AdamW lr {s.lr}, batch {s.batch},
  {report["steps"]} steps ({s.epochs} epoch(s)), seed {s.seed},
  {report["train_seconds"]:.0f} s of training, {start}.
{method.card_vocab(opts.draft_vocab, choice)}
- Held-out greedy acceptance at {acc["drafts"]} drafts: by position [{by_pos}], mean
  acceptance length {acc["mean_acceptance_length"]:.3f} ({walked}).

Data licences: {licences}.

`report.json` holds every figure.
"""


def train_mtp(
    opts: RunOptions,
    stream: TextIO | None = None,
    conversations: list[corpus.Conversation] | None = None,
) -> dict[str, Any]:
    """:func:`train_head` for the MTP head (``specdraft train-mtp``)."""
    return train_head(replace(opts, method="mtp"), stream, conversations)


def _choose_draft_ids(
    opts: RunOptions,
    method: TrainMethod,
    choices: np.ndarray,
    vocab: int,
    resume_from: Path | None,
    start: Path | None,
) -> np.ndarray:
    """The run's draft vocabulary.

    A resumed run's or a starting head's where it fixes one (its weights were trained over
    those ids), else the method's choice.
    """
    ids = None
    if resume_from is not None:
        ids = method.start_draft_ids(resume_from)
    elif start is not None:
        ids = method.start_draft_ids(start)
    if ids is None:
        ids = method.choose_draft_ids(choices, opts.draft_vocab, vocab)
    if len(ids) != opts.draft_vocab:
        where = resume_from or start
        raise ValueError(
            f"{where} drafts over {len(ids)} ids, not --draft-vocab {opts.draft_vocab}; pass "
            f"--draft-vocab {len(ids)} to continue it"
        )
    return np.asarray(ids, np.int64)


def train_head(
    opts: RunOptions,
    stream: TextIO | None = None,
    conversations: list[corpus.Conversation] | None = None,
) -> dict[str, Any]:
    """Run the whole pipeline for ``opts.method``; returns the report.

    The head is written into ``opts.out``. ``conversations`` replaces the named corpora
    (for tests and for your own data).
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
    if opts.skip_prompts < 0:
        raise ValueError(f"skip_prompts must not be negative, not {opts.skip_prompts}")
    start = None if opts.init_from is None else start_weights(opts.init_from)
    path = resolve_model(opts.target)
    model = specdraft.load_model(opts.target, max_seq_len=max(s.seq_len, 1024))
    shape = target_shape(model.config)
    method = load_method(
        opts.method,
        shape,
        opts.aux_layers,
        draft_layers=opts.draft_layers,
        block_size=opts.block_size,
        mask_token=opts.mask_token,
    )
    label = f"train-{method.name}"
    if opts.draft_vocab > shape.vocab:
        raise ValueError(f"draft vocabulary {opts.draft_vocab} > target vocabulary {shape.vocab}")
    tokenizer = load_tokenizer(path)
    # One cache per split: a cache holds the held-out prompts of the split it was made for,
    # and would leak them into training under another seed or fraction. And one per set of
    # layers: a row of other layers would be read as these.
    split = corpus.split_record(s.seed, opts.eval_fraction)
    tag = corpus.split_tag(s.seed, opts.eval_fraction)
    if opts.skip_prompts:
        tag += f"-skip{opts.skip_prompts}"
    folder = opts.cache or default_cache_folder(cache_dir(), method, Path(str(path)), tag)
    cache = HiddenCache(folder, str(path), shape.hidden, split=split, layers=method.cache_layers)
    _log(
        log,
        f"{label}: target {path} ({shape.hidden} hidden), cache {folder} "
        f"({describe_layers(cache.layers)}, {2 * cache.width} bytes a token)",
    )

    convs = conversations
    if convs is None:
        convs = [c for name in opts.corpora for c in corpus.read_conversations(name)]
    unique = corpus.deduplicated(convs)
    order = corpus.shuffled(unique, s.seed)
    held = [c for c in order if corpus.is_held_out(s.seed, c, opts.eval_fraction)]
    train = [c for c in order if not corpus.is_held_out(s.seed, c, opts.eval_fraction)]
    _log(
        log,
        f"{label}: {len(convs)} conversations, {len(unique)} with distinct prompts: "
        f"{len(train)} training and {len(held)} held-out",
    )
    if opts.skip_prompts:
        if opts.skip_prompts >= len(train):
            raise ValueError(
                f"skip_prompts {opts.skip_prompts} passes over every one of the "
                f"{len(train)} training prompts"
            )
        train = train[opts.skip_prompts :]
        _log(log, f"{label}: passing over the first {opts.skip_prompts} training prompts")
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
        _log(log, f"{label}: cached target hiddens of {extracted} new tokens ({rate:.1f} tok/s)")
    del model
    method = method.bind(cache, tokenizer)

    weights = read_target_weights(path)
    full = {"target_norm": jnp.asarray(weights.final_norm), "lm_head": jnp.asarray(weights.lm_head)}
    choices = target_choices(
        cache,
        full,
        shape.rms_norm_eps,
        limit=opts.coverage_tokens,
        replies_only=method.choices_on_replies,
    )
    coverage = vocab_coverage(choices, (*COVERAGE_SIZES, opts.draft_vocab))
    _log(
        log,
        f"{label}: draft vocabulary coverage of the target's choices: "
        + ", ".join(f"{n}: {c:.1%}" for n, c in sorted(coverage.items())),
    )
    ckpt = opts.out / "checkpoint" / "state.npz"
    resumed = opts.resume and ckpt.exists()
    draft_ids = _choose_draft_ids(
        opts, method, choices, shape.vocab, ckpt if resumed else None, start
    )
    heldout = heldout_choices(cache)
    first_n = np.arange(opts.draft_vocab)
    choice = {
        "chosen_train": coverage_of(choices, draft_ids),
        "first_n_train": coverage_of(choices, first_n),
        "chosen_heldout": coverage_of(heldout, draft_ids),
        "first_n_heldout": coverage_of(heldout, first_n),
    }
    _log(
        log,
        f"{label}: the draft vocabulary's {opts.draft_vocab} ids hold the target's choice at "
        f"{choice['chosen_train']:.1%} of {len(choices)} training positions and "
        f"{choice['chosen_heldout']:.1%} of {len(heldout)} held-out ones (the first "
        f"{opts.draft_vocab} ids: {choice['first_n_train']:.1%}, "
        f"{choice['first_n_heldout']:.1%})",
    )

    d = head_dims(shape)
    frozen = _frozen(weights, opts.draft_vocab, draft_ids)
    batches = Batches(cache, s)
    planned = batches.per_epoch * s.epochs
    trainer = Trainer(
        d, frozen, s, min(planned, opts.train_steps or planned), loss=method.loss_fn(d, s.steps)
    )
    state = trainer.init_state(method.init_params(d, s.seed, weights.lm_head[draft_ids]))
    if resumed:
        state = trainer.load(state, ckpt)
        _log(log, f"{label}: resumed from {ckpt} at step {state.step}")
    elif start is not None:
        if start.suffix == ".npz":
            state = trainer.load_params(state, start)
        else:
            state = trainer.init_state(method.read_head(start, shape, d, draft_ids))
        _log(log, f"{label}: starting from the weights of {start}")
    # Beside the checkpoint, so that a resumed run drafts over the ids it trained on.
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    np.save(ckpt.parent / "draft_ids.npy", draft_ids)
    bar = Progress(trainer.total_steps, label, "step")
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
            f"loss {loss:.4f} (mean of last {len(recent)}: {np.mean(recent):.4f}) by draft "
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
    acceptance: Acceptance = method.evaluate(written, frozen, d, cache, s.steps)
    _log(log, f"{label}: held-out " + acceptance.describe())
    train_tokens = sum(x.length for x in batches.sequences)
    trained_tokens = batches.tokens_in(state.step)
    report = {
        "method": method.name,
        **method.report(),
        "cache_layers": list(cache.layers),
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
        "skip_prompts": opts.skip_prompts,
        "total_steps": trainer.total_steps,
        "train_seconds": round(state.seconds, 1),
        "first_losses": first_losses,
        "last_losses": last_losses,
        "draft_vocab": opts.draft_vocab,
        "draft_vocab_coverage": {str(k): round(v, 4) for k, v in sorted(coverage.items())},
        "draft_vocab_choice": {k: round(v, 4) for k, v in choice.items()},
        "acceptance": acceptance.to_dict(),
        "settings": asdict(s),
    }
    card = _card(opts, method, report, choice)
    method.write_head(opts.out, params, shape, d, draft_ids, s.steps, report["target"], card)
    (opts.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _log(log, f"{label}: wrote {opts.out}")
    return report
