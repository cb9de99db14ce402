"""Tokens per second of the trainer's hidden-state extraction, against plain prefill, as JSON.

    python benches/mtp/extract_speed.py [--model smollm2] [--tokens 8000] [--seq-len 512]
        [--data sharegpt chitchat]

Takes the first training conversations of the corpora (rendered and cut exactly as
``specdraft train-mtp`` does, ``--tokens`` of them), then in one invocation, back to back:
``prefill`` (``TargetModel.logits`` over each sequence: the batched prefill path, full logits
rows), and ``extract`` (``specdraft.train.targets.extract_train`` into a fresh cache folder: the
trainer's own extraction, hiddens written to disk). Prints ``{"prefill_tok_s",
"extract_tok_s", "extract_vs_prefill", ...}``; compare ratios, the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    """Parse the options, time both paths and print the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--data", nargs="+", default=["sharegpt", "chitchat"])
    args = p.parse_args()

    import specdraft
    from specdraft.models import resolve_model
    from specdraft.tokenizer import load_tokenizer
    from specdraft.train import data as corpus
    from specdraft.train.cache import HiddenCache
    from specdraft.train.targets import extract_train

    path = resolve_model(args.model)
    model = specdraft.load_model(args.model, max_seq_len=max(args.seq_len, 1024))
    tokenizer = load_tokenizer(path)
    convs = [c for name in args.data for c in corpus.read_conversations(name)]
    # The training split, in the trainer's order (seed 0, its default held-out fraction).
    order = [c for c in corpus.shuffled(convs, 0) if not corpus.is_held_out(0, c, 0.02)]
    seqs = corpus.tokenize_conversations(tokenizer, order, args.seq_len, args.tokens)
    n = sum(len(s.tokens) for s in seqs)

    t0 = time.perf_counter()
    for s in seqs:
        model.logits(s.tokens)
    prefill_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        cache = HiddenCache(Path(tmp), str(path), int(model.config.hidden_size))
        t0 = time.perf_counter()
        extract_train(model, cache, seqs)
        extract_s = time.perf_counter() - t0
        if cache.tokens != n:
            print(f"extract cached {cache.tokens} tokens, expected {n}", file=sys.stderr)
            return 1

    out = {
        "sequences": len(seqs),
        "tokens": n,
        "prefill_tok_s": round(n / prefill_s, 1),
        "extract_tok_s": round(n / extract_s, 1),
        "extract_vs_prefill": round(prefill_s / extract_s, 3),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
