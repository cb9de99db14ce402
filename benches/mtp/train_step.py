"""Seconds per MTP-head training step on a hidden-state cache, as JSON.

    python benches/mtp/train_step.py --cache DIR --model smollm2 [--batch 1] [--seq-len 512]
        [--steps 5] [--draft-vocab 8192] [--threads N] [--width-step N]

Builds the trainer exactly as ``specdraft train-mtp`` does (same head, frozen weights and
loss), runs ``--steps`` batches once to compile every width they need, then times the same
batches again and prints ``{"s_per_step", "tokens_per_s", "valid_tokens_per_s", ...}``
(``tokens_per_s`` counts padding, ``valid_tokens_per_s`` only the sequences' own tokens).
``--width-step`` overrides the batch-width rounding (``--width-step 512`` pads every batch
to ``seq_len``, as fixed-shape batches do). ``--threads``
sets XLA's CPU intra-op threads (before JAX is imported); compare settings within one
invocation of the shell, back to back, because the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    """Parse the options, time the steps and print the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=0, help="XLA CPU threads (0: XLA's default)")
    p.add_argument("--width-step", type=int, default=0, help="batch width rounding (0: default)")
    args = p.parse_args()
    if args.threads:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + " --xla_cpu_multi_thread_eigen="
            + ("true" if args.threads > 1 else "false")
            + f" intra_op_parallelism_threads={args.threads}"
        )

    import numpy as np
    import specdraft
    from specdraft.models import resolve_model
    from specdraft.train.cache import HiddenCache
    from specdraft.train.head import head_dims, init_params
    from specdraft.train.pipeline import _frozen
    from specdraft.train.targets import read_target_weights, target_shape
    from specdraft.train.trainer import WIDTH_STEP, Batches, Trainer, TrainSettings

    path = resolve_model(args.model)
    model = specdraft.load_model(args.model)
    shape = target_shape(model.config)
    del model
    meta = json.loads((Path(args.cache) / "index.json").read_text())
    cache = HiddenCache(Path(args.cache), meta["target"], shape.hidden)
    settings = TrainSettings(
        batch=args.batch, seq_len=args.seq_len, width_step=args.width_step or WIDTH_STEP
    )
    batches = Batches(cache, settings)
    d = head_dims(shape)
    trainer = Trainer(
        d, _frozen(read_target_weights(path), args.draft_vocab), settings, batches.per_epoch
    )
    state = trainer.init_state(init_params(d, 0))
    picked = [batches.batch(i) for i in range(args.steps)]
    t0 = time.perf_counter()
    for batch in picked:
        state, _, _ = trainer.step(state, batch)
    compile_s = time.perf_counter() - t0
    valid = tokens = 0
    t0 = time.perf_counter()
    for batch in picked:
        valid += int(np.sum(batch[2]))
        tokens += batch[2].size
        state, loss, _ = trainer.step(state, batch)
    dt = (time.perf_counter() - t0) / args.steps
    out = {
        "batch": args.batch,
        "seq_len": args.seq_len,
        "threads": args.threads,
        "width_step": settings.width_step,
        "first_pass_with_compiles_s": round(compile_s, 2),
        "s_per_step": round(dt, 3),
        "tokens_per_s": round(tokens / args.steps / dt, 1),
        "valid_tokens_per_s": round(valid / args.steps / dt, 1),
        "last_loss": round(loss, 4),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
