"""``specdraft train --method mtp|eagle3|dflash``: the command line of the draft-head trainer.

``specdraft train-mtp`` is ``train --method mtp`` by its older name.

The parser imports nothing heavy; the trainer's dependencies (``jax``, ``optax``) come with
the optional extra ``specdraft[train]`` and are imported only when the command runs. Both
commands share every option and default; ``train`` adds ``--method``, ``--aux-layers`` and
DFlash's ``--draft-layers``, ``--block-size`` and ``--mask-token``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdraft.train.methods import METHODS

__all__ = ["add_train", "add_train_mtp", "run_train", "run_train_mtp"]

#: Bytes a token of the SmolLM2 cache (hidden 576, BF16) holds, per method: the final hidden;
#: three captured layers and the final hidden (one cache for eagle3 and dflash).
_CACHE_BYTES = (
    "mtp: 2 x hidden bytes a token (1.1 KB for SmolLM2), eagle3: 8 x hidden (4.6 KB), dflash: "
    "the same cache as eagle3 for the same layers"
)


def run_train(args: argparse.Namespace) -> int:
    """Run ``specdraft train`` (or ``train-mtp``) with parsed arguments.

    Returns the exit status.
    """
    command = f"specdraft {args.command}"
    try:
        from specdraft.train.pipeline import RunOptions, train_head
        from specdraft.train.trainer import TrainSettings
    except ImportError as e:
        print(
            f"{command} needs the training extra ({e}); "
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
        method=args.method,
        target=args.model,
        out=Path(args.out or f"smollm2-{args.method}"),
        corpora=tuple(args.data),
        tokens=args.tokens,
        draft_vocab=args.draft_vocab,
        aux_layers=args.aux_layers,
        draft_layers=args.draft_layers,
        block_size=args.block_size,
        mask_token=args.mask_token,
        eval_prompts=args.eval_prompts,
        eval_new_tokens=args.eval_new_tokens,
        eval_fraction=args.eval_fraction,
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
        skip_prompts=args.skip_prompts,
        settings=settings,
    )
    try:
        report = train_head(opts)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"{command}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report["acceptance"], indent=2))
    return 0


def run_train_mtp(args: argparse.Namespace) -> int:
    """Run ``specdraft train-mtp``: ``train --method mtp``."""
    return run_train(args)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or a positive integer, not {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), not {text}")
    return value


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected layer ids separated by commas (2,15,27), not {text}"
        ) from None
    if any(i < 1 for i in ids):
        raise argparse.ArgumentTypeError(f"layer ids are positive (1 is the first), not {text}")
    return ids


def _add_options(p: argparse.ArgumentParser) -> None:
    """The options ``train`` and ``train-mtp`` share."""
    p.add_argument("--model", default="smollm2", help="target: a .gguf, a folder or a known name")
    p.add_argument(
        "--data",
        nargs="+",
        default=["sharegpt", "chitchat"],
        choices=["sharegpt", "chitchat"],
        help="corpora (downloaded once into the cache folder)",
    )
    p.add_argument(
        "--tokens",
        type=_positive,
        default=300_000,
        help=f"training tokens to take (cached on disk, {_CACHE_BYTES})",
    )
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
    p.add_argument(
        "--skip-prompts",
        type=_non_negative,
        default=0,
        help=(
            "pass over the first N training prompts of the seed's order: a later run then "
            "learns from prompts an earlier one never saw (its cache is a folder of its own)"
        ),
    )
    p.add_argument("--epochs", type=_positive, default=1, help="passes over the training tokens")
    p.add_argument(
        "--draft-vocab",
        type=_positive,
        default=16384,
        help=(
            "draft vocabulary size N: mtp drafts over the first N token ids (mtp_vocab_size; "
            "16384 holds SmolLM2's greedy choice at 94.6%% of positions, 8192 at 87.7%%), "
            "eagle3 over the N ids the target chooses most often on the training replies (d2t), "
            "dflash over the first N ids of the target's LM head, which it shares"
        ),
    )
    p.add_argument(
        "--unroll",
        type=_positive,
        default=3,
        help="draft steps trained per row (dflash: a block drafts block-size - 1)",
    )
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
    p.add_argument("--out", default=None, help="output folder (default: smollm2-METHOD)")
    p.add_argument("--cache", default=None, help="hidden-state cache folder")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--max-steps", type=_positive, default=None, help="stop after this step")
    p.add_argument(
        "--init-from",
        default=None,
        help=(
            "start the weights from a checkpoint (a state.npz), a trained head (its folder, "
            "its mtp.safetensors or an eagle3 head's model.safetensors: the eagle3 head then "
            "keeps its draft vocabulary) or a shipped head by name (smollm2-mtp), with a "
            "fresh optimizer and schedule"
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
        help=(
            "training positions the draft-vocabulary coverage is measured on (eagle3: the "
            "reply positions its draft vocabulary is chosen on)"
        ),
    )
    p.add_argument("--eval-prompts", type=_positive, default=16, help="held-out prompts")
    p.add_argument(
        "--eval-fraction",
        type=_fraction,
        default=0.02,
        help="share of distinct prompts held out (by a hash of the prompt and --seed); the "
        "cache folder is keyed by it",
    )
    p.add_argument(
        "--eval-new-tokens", type=_positive, default=96, help="greedy tokens per held-out prompt"
    )


def add_train(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft train``."""
    p = subparsers.add_parser(
        "train",
        help="train a draft head (MTP, EAGLE-3 or DFlash) for a target model by self-distillation",
        description=(
            "Train a draft head for a target model: the target's hidden states over a "
            "conversation corpus are cached (BF16; mtp: the final hidden, eagle3 and dflash: "
            f"three captured layers and the final hidden; {_CACHE_BYTES}), then the head learns "
            "the target's distribution for the tokens after the next, unrolled over several "
            "drafts (dflash: drafted side by side in blocks). --method mtp writes a "
            "DeepSeek-V3-style MTP head, --method eagle3 an EAGLE-3 head in the speculators "
            "format, --method dflash a DFlash block drafter in z-lab's layout. Progress goes to "
            "stderr; the held-out acceptance is printed as JSON. Needs: pip install "
            "'specdraft[train]'."
        ),
    )
    p.add_argument("--method", choices=list(METHODS), default="mtp", help="the head to train")
    p.add_argument(
        "--aux-layers",
        type=_layer_ids,
        default=None,
        help=(
            "eagle3: the layers whose entering hidden is fused, comma-separated (vLLM's ids; "
            "default 2,L/2,L-3, for SmolLM2 2,15,27: the outputs of layers 1,14,26 are "
            "captured); dflash: the layers whose output is fused (z-lab's target_layer_ids; "
            "default the layers eagle3 captures, 1,14,26 for SmolLM2, so the two share a cache)"
        ),
    )
    p.add_argument(
        "--draft-layers",
        type=_positive,
        default=None,
        help="dflash: draft decoder layers (default 2)",
    )
    p.add_argument(
        "--block-size",
        type=_positive,
        default=None,
        help="dflash: rows of a block, the anchor and block-size - 1 drafts (default 8)",
    )
    p.add_argument(
        "--mask-token",
        type=int,
        default=None,
        help=(
            "dflash: the id of the blocks' mask token (default: the highest-id special token "
            "that is no chat marker and never occurs in the cached text; SmolLM2: 16)"
        ),
    )
    _add_options(p)
    p.set_defaults(run=run_train)
    return p


def add_train_mtp(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``specdraft train-mtp``, the older name of ``train --method mtp``."""
    p = subparsers.add_parser(
        "train-mtp",
        help="train an MTP draft head (specdraft train --method mtp)",
        description=(
            "Train a DeepSeek-V3-style MTP draft head for a target model: the target's hidden "
            "states over a conversation corpus are cached (BF16, 2 x hidden bytes a token: "
            "1.1 KB for SmolLM2), then the head learns the target's distribution for the token "
            "after next, unrolled over several drafts. The same as specdraft train --method "
            "mtp. Progress goes to stderr; the held-out acceptance is printed as JSON. "
            "Needs: pip install 'specdraft[train]'."
        ),
    )
    _add_options(p)
    p.set_defaults(
        run=run_train_mtp,
        method="mtp",
        aux_layers=None,
        draft_layers=None,
        block_size=None,
        mask_token=None,
    )
    return p
