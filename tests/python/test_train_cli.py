"""``specdraft train-mtp`` without the training extra: the command line and the package
import without JAX, and the command says how to install what it needs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from specdraft.cli import build_parser


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_the_package_and_its_command_line_do_not_import_jax():
    out = _python(
        "import sys, specdraft, specdraft.cli; specdraft.cli.build_parser();"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'optax')))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_without_the_extra_the_command_names_it():
    out = _python(
        "import sys; sys.modules['jax'] = None; sys.modules['optax'] = None\n"
        "from specdraft.cli import main; sys.exit(main(['train-mtp']))"
    )
    assert out.returncode == 2, out.stderr
    assert "pip install 'specdraft[train]'" in out.stderr


def test_the_command_line_documents_its_options(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-mtp", "--help"])
    text = capsys.readouterr().out
    for option in [
        "--model",
        "--data",
        "--tokens",
        "--epochs",
        "--draft-vocab",
        "--unroll",
        "--lr",
        "--batch",
        "--seq-len",
        "--out",
        "--resume",
        "--seed",
        "--init-from",
        "--max-minutes",
        "--warmup",
        "--width-step",
        "--extract-minutes",
        "--train-steps",
        "--responses",
        "--reply-tokens",
        "--eval-fraction",
        "--skip-prompts",
    ]:
        assert option in text
    args = build_parser().parse_args(["train-mtp"])
    assert (args.unroll, args.draft_vocab, args.model) == (3, 16384, "smollm2")
    assert (args.responses, args.reply_tokens) == ("corpus", 256)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-mtp", "--responses", "both"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-mtp", "--batch", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-mtp", "--max-minutes", "0"])
    assert args.skip_prompts == 0
    assert build_parser().parse_args(["train-mtp", "--skip-prompts", "0"]).skip_prompts == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-mtp", "--skip-prompts", "-1"])


def test_the_held_out_fraction_reaches_the_run_and_is_bounded(monkeypatch, capsys):
    pytest.importorskip("jax")
    import specdraft.train.pipeline as pipeline
    from specdraft.train.cli import run_train

    seen = []

    def capture(opts):
        seen.append(opts)
        raise ValueError("stopped before any work")

    monkeypatch.setattr(pipeline, "train_head", capture)
    args = build_parser().parse_args(["train", "--method", "eagle3", "--eval-fraction", "0.1"])
    assert run_train(args) == 1
    assert "stopped before any work" in capsys.readouterr().err
    assert (seen[0].method, seen[0].eval_fraction, seen[0].skip_prompts) == ("eagle3", 0.1, 0)
    args = build_parser().parse_args(["train", "--skip-prompts", "9000"])
    assert run_train(args) == 1 and seen[1].skip_prompts == 9000
    assert build_parser().parse_args(["train"]).eval_fraction == 0.02
    for bad in ("0", "1", "-0.5", "nan"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", "--eval-fraction", bad])
