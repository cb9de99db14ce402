"""How much a trained MTP head uses the target's hidden state, as JSON.

    python benches/mtp/hidden_ablation.py --cache DIR --checkpoint STATE.npz
        [--model smollm2] [--draft-vocab 8192] [--drafts 3] [--out DIR]

Evaluates the head of a training checkpoint (``specdraft train-mtp``'s ``state.npz``) on
the cache's held-out sequences three times, exactly as the trainer's final evaluation
does: with the target hiddens as cached, with them zeroed, and with each sequence's
hiddens shuffled across its positions. A head that has learned to read the hidden loses
most of its acceptance without it; one that drafts from the token's embedding alone does
not. Prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> int:
    """Parse the options, evaluate the three variants and print their JSON lines."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--out", default=None, help="folder for the altered caches (default: temp)")
    args = p.parse_args()

    import numpy as np
    import specdraft
    from specdraft.models import resolve_model
    from specdraft.train.cache import HiddenCache, from_bf16_bits
    from specdraft.train.evaluate import evaluate
    from specdraft.train.head import head_dims, init_params
    from specdraft.train.pipeline import _frozen
    from specdraft.train.targets import read_target_weights, target_shape
    from specdraft.train.trainer import Trainer, TrainSettings

    model = specdraft.load_model(args.model)
    shape = target_shape(model.config)
    del model
    d = head_dims(shape)
    meta = json.loads((Path(args.cache) / "index.json").read_text())
    cache = HiddenCache(Path(args.cache), meta["target"], shape.hidden)
    frozen = _frozen(read_target_weights(resolve_model(args.model)), args.draft_vocab)
    trainer = Trainer(d, frozen, TrainSettings(steps=args.drafts), 1)
    params = trainer.load(trainer.init_state(init_params(d, 0)), Path(args.checkpoint)).params
    tokens, hiddens = cache.open_arrays()
    rng = np.random.default_rng(0)
    out = Path(args.out or tempfile.mkdtemp(prefix="hidden-ablation-"))
    variants = {
        "as_cached": lambda h: h,
        "zeroed": np.zeros_like,
        "shuffled": lambda h: h[rng.permutation(len(h))],
    }
    for name, alter in variants.items():
        altered = HiddenCache(out / name, meta["target"], shape.hidden)
        for s in cache.split("eval"):
            if altered.has(s.corpus, s.id, "eval"):
                continue
            rows = from_bf16_bits(hiddens[s.offset : s.offset + s.length])
            ids = tokens[s.offset : s.offset + s.length].tolist()
            altered.append(s.corpus, s.id, "eval", ids, alter(rows), s.start)
        result = evaluate(params, frozen, d, altered, args.drafts).to_dict()
        print(json.dumps({"bench": "mtp_hidden_ablation", "hidden": name, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
