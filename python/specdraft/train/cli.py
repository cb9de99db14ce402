"""``specdraft train-mtp``: the command line of the MTP head trainer.

The parser imports nothing heavy; the trainer's dependencies (``jax``, ``optax``) come with
the optional extra ``specdraft[train]`` and are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_train_mtp", "run_train_mtp"]


def run_train_mtp(args: argparse.Namespace) -> int:
    """Run ``specdraft train-mtp`` with parsed arguments; returns the exit status."""
    try:
        from specdraft.train.pipeline import RunOptions, train_mtp
        from specdraft.train.trainer import TrainSettings
    except ImportError as e:
        print(
            f"specdraft train-mtp needs the training extra ({e}); "
            "install it with: pip install 'specdraft[train]'",
            file=sys.stderr,
        )
        return 2
    settings = TrainSettings(
        epochs=args.epochs,
        steps=args.unroll,
        lr=args.lr,
        warmup=args.warmup,
        width_step=args.width_step,
        batch=args.batch,
        seq_len=args.seq_len,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
    )
    opts = RunOptions(
        target=args.model,
        out=Path(args.out),
        corpora=tuple(args.data),
        tokens=args.tokens,
        draft_vocab=args.draft_vocab,
        eval_prompts=args.eval_prompts,
        eval_new_tokens=args.eval_new_tokens,
        cache=Path(args.cache) if args.cache else None,
        resume=args.resume,
        max_steps=args.max_steps,
        init_from=Path(args.init_from) if args.init_from else None,
        max_seconds=args.max_minutes * 60.0 if args.max_minutes else None,
        max_extract_seconds=args.extract_minutes * 60.0 if args.extract_minutes else None,
        train_steps=args.train_steps,
        coverage_tokens=args.coverage_tokens,
        responses=args.responses,
        reply_tokens=args.reply_tokens,
        settings=settings,
    )
    try:
        report = train_mtp(opts)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"specdraft train-mtp: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report["acceptance"], indent=2))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def add_train_mtp(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft train-mtp``."""
    p = subparsers.add_parser(
        "train-mtp",
        help="train an MTP draft head for a target model by self-distillation",
        description=(
            "Train a DeepSeek-V3-style MTP draft head for a target model: the target's hidden "
            "states over a conversation corpus are cached (BF16), then the head learns the "
            "target's distribution for the token after next, unrolled over several drafts. "
            "Progress goes to stderr; the held-out acceptance is printed as JSON. "
            "Needs: pip install 'specdraft[train]'."
        ),
    )
    p.add_argument("--model", default="smollm2", help="target: a .gguf, a folder or a known name")
    p.add_argument(
        "--data",
        nargs="+",
        default=["sharegpt", "chitchat"],
        choices=["sharegpt", "chitchat"],
        help="corpora (downloaded once into the cache folder)",
    )
    p.add_argument("--tokens", type=_positive, default=300_000, help="training tokens to take")
    p.add_argument(
        "--responses",
        choices=["corpus", "target"],
        default="corpus",
        help=(
            "train on the conversations as written (corpus), or on each one's prompt followed "
            "by the target's own greedy reply (target: the text the head drafts on in use)"
        ),
    )
    p.add_argument(
        "--reply-tokens",
        type=_positive,
        default=256,
        help="with --responses target: the most tokens of a generated reply",
    )
    p.add_argument("--epochs", type=_positive, default=1, help="passes over the training tokens")
    p.add_argument(
        "--draft-vocab",
        type=_positive,
        default=16384,
        help=(
            "mtp_vocab_size: the head drafts over the first N token ids (16384 holds SmolLM2's "
            "greedy choice at 94.6%% of positions, 8192 at 87.7%%)"
        ),
    )
    p.add_argument("--unroll", type=_positive, default=3, help="draft steps trained per row")
    p.add_argument("--lr", type=float, default=3e-4, help="peak AdamW learning rate")
    p.add_argument(
        "--warmup", type=_positive, default=20, help="warm-up steps (then cosine decay to lr/10)"
    )
    p.add_argument(
        "--width-step",
        type=_positive,
        default=64,
        help="batch widths are multiples of this (each width compiles the step once)",
    )
    p.add_argument("--batch", type=_positive, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=_positive, default=512, help="tokens per sequence (cut)")
    p.add_argument("--seed", type=int, default=0, help="weights, data order and split")
    p.add_argument("--out", default="smollm2-mtp", help="output folder")
    p.add_argument("--cache", default=None, help="hidden-state cache folder")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--max-steps", type=_positive, default=None, help="stop after this step")
    p.add_argument(
        "--init-from",
        default=None,
        help=(
            "start the weights from a checkpoint (a state.npz), a trained head (its folder "
            "or its mtp.safetensors) or a shipped head by name (smollm2-mtp), with a fresh "
            "optimizer and schedule"
        ),
    )
    p.add_argument(
        "--max-minutes",
        type=_positive_float,
        default=None,
        help="stop training after this long (then evaluate and write the head)",
    )
    p.add_argument(
        "--extract-minutes",
        type=_positive_float,
        default=None,
        help="stop caching training hiddens after this long and train on what is cached",
    )
    p.add_argument(
        "--train-steps",
        type=_positive,
        default=None,
        help="the run's length in steps (the learning rate decays over them; default: epochs)",
    )
    p.add_argument(
        "--checkpoint-every", type=_positive, default=50, help="steps between checkpoints"
    )
    p.add_argument(
        "--coverage-tokens",
        type=_positive,
        default=20_000,
        help="training positions the draft-vocabulary coverage is measured on",
    )
    p.add_argument("--eval-prompts", type=_positive, default=16, help="held-out prompts")
    p.add_argument(
        "--eval-new-tokens", type=_positive, default=96, help="greedy tokens per held-out prompt"
    )
    p.set_defaults(run=run_train_mtp)
    return p
