"""The dataset task: user files -> rendered prompts, labels and metadata; bad data fails in
one line naming the file and line. A tiny word-level tokenizer with a chat template is
made here (no download), so these run in about a second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rl.checks import check_task
from rl.config import ConfigError
from rl.config.schema import EnvConfig
from rl.tasks import TaskError, build_task, sft_batch
from rl.tasks.common import take
from rl.tasks.kinds.dataset import DatasetTaskConfig
from tests.helpers.configs import composed

WORDS = ["<pad>", "<eos>", "<|user|>", "<|system|>", "<|assistant|>"]
WORDS += [f"w{i}" for i in range(40)] + [str(i) for i in range(20)]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tok")
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=TEMPLATE
    )
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    return path


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tok_dir: Path, **task) -> OmegaConf:
    base = OmegaConf.structured(DatasetTaskConfig(eval_size=0, tokenizer=str(tok_dir)))
    return OmegaConf.create({
        "task": OmegaConf.merge(base, task), "env": OmegaConf.structured(EnvConfig),
        "model": {"hf_checkpoint": None, "max_position_embeddings": 64, "vision": None,
                  "max_pixels": None},
        "rollout": {"sampling": {"max_new_tokens": 8}}, "rl": {"steps": 1},
    })  # fmt: skip


def _rows(n: int, key: str = "q") -> list[dict]:
    return [{key: f"w{i % 40} w{(i + 1) % 40}", "ans": str(i % 20), "src": "t"} for i in range(n)]


def test_prompts_render_through_the_chat_template(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    f = _write(tmp_path / "d.jsonl", _rows(5))
    task = build_task(_cfg(tok_dir, train_files=[str(f)], prompt_key="q", label_key="ans",
                           metadata_keys=["src"], system_prompt="w39"))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ex = task.train[0]
    msgs = [{"role": "system", "content": "w39"}, {"role": "user", "content": "w0 w1"}]
    want = tok.apply_chat_template(msgs, add_generation_prompt=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert list(ex.prompt_ids) == want
    assert ex.prompt_text == "<|system|> w39 <|user|> w0 w1 <|assistant|>"
    assert ex.label == "0" and ex.metadata == {"src": "t"} and ex.uid == f"{f} line 1"
    assert task.codec.eos_ids == (1, 4)  # the tokenizer's EOS, then generation_config's
    assert ex.target_ids == (WORDS.index("0"), 1)  # the label's text, then the end token
    assert task.codec.response_text([WORDS.index("w3"), WORDS.index("5"), 4, 9]) == "w3 5"


def test_messages_json_and_parquet_files(tok_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [{"role": "user", "content": "w5"}]
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": msgs, "label": 3}] * 2))
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "w6", "label": "4"}] * 3), tmp_path / "b.parquet"
    )
    task = build_task(_cfg(tok_dir, train_files=[str(tmp_path / "*.json"),
                                                 str(tmp_path / "*.parquet")]))  # fmt: skip
    assert len(task.train) == 5
    assert [e.label for e in task.train] == [3, 3, "4", "4", "4"]
    assert task.train[2].uid.endswith("b.parquet row 0")
    # A conversation column holding JSON text is used as the messages list it spells.
    rows = [{"prompt": json.dumps(msgs), "label": "5"}, {"prompt": "[{not json", "label": "6"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    task = build_task(_cfg(tok_dir, train_files=[str(tmp_path / "c.parquet")]))
    listed = build_task(_cfg(tok_dir, train_files=[str(tmp_path / "a.json")])).train[0]
    assert task.train[0].prompt_ids == listed.prompt_ids
    assert "[{not json" in task.train[1].prompt_text  # not JSON: the text itself
    bad = [{"prompt": json.dumps([{"role": "user"}]), "label": "7"}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "d.parquet")
    with pytest.raises(TaskError, match=r"d.parquet row 0: 'prompt' must be a string or a"):
        build_task(_cfg(tok_dir, train_files=[str(tmp_path / "d.parquet")]))


def test_stream_shuffles_per_epoch_reproducibly_and_holds_out_eval(tok_dir, tmp_path):
    f = _write(tmp_path / "d.jsonl", _rows(30))
    cfg = _cfg(tok_dir, train_files=[str(f)], prompt_key="q", label_key="ans", eval_size=10,
               epochs=2, seed=3)  # fmt: skip
    task = build_task(cfg)
    assert len(task.train) == 20 and len(task.eval_sets["eval"]) == 10
    assert not {e.uid for e in task.train} & {e.uid for e in task.eval_sets["eval"]}
    first = [e.uid for e in take(task.train_stream(), 40)]
    assert sorted(first[:20]) == sorted(first[20:]) == sorted(e.uid for e in task.train)
    assert first[:20] != first[20:]  # each epoch its own order
    assert first == [e.uid for e in take(build_task(cfg).train_stream(), 40)]
    with pytest.raises(TaskError, match="ran out"):
        take(task.train_stream(), 41)
    assert {e.uid for e in task.validation_set} <= {e.uid for e in task.train}


@pytest.mark.parametrize("drawn", [0, 7, 20, 33])
def test_stream_resumes_at_its_epoch_and_offset(tok_dir, tmp_path, drawn):
    """A new stream from a saved position yields exactly what the original would have
    yielded next, across an epoch boundary too: each prompt once per epoch."""
    f = _write(tmp_path / "d.jsonl", _rows(30))
    cfg = _cfg(tok_dir, train_files=[str(f)], prompt_key="q", label_key="ans", eval_size=10,
               epochs=3, seed=3)  # fmt: skip
    task = build_task(cfg)
    whole = [e.uid for e in take(task.train_stream(), 60)]
    original = task.train_stream()
    take(original, drawn)
    pos = json.loads(json.dumps(original.position()))
    epoch = (drawn - 1) // 20 if drawn else 0  # an epoch ends at offset 20, not at 0
    assert (pos["epoch"], pos["offset"], pos["seed"]) == (epoch, drawn - 20 * epoch, 3)
    resumed = build_task(cfg).train_stream(pos)
    assert [e.uid for e in take(resumed, 60 - drawn)] == whole[drawn:]
    with pytest.raises(TaskError, match="ran out"):
        next(resumed)
    other = build_task(_cfg(tok_dir, train_files=[str(f)], prompt_key="q", label_key="ans",
                            eval_size=10, seed=4))  # fmt: skip
    with pytest.raises(TaskError, match="saved prompt stream has seed=3 but this task has 4"):
        other.train_stream(pos)
    with pytest.raises(TaskError, match="offset=21 is past the epoch's 20 prompts"):
        task.train_stream({**pos, "offset": 21})


def test_long_prompts_are_dropped_and_counted(tok_dir, tmp_path):
    rows = [{"prompt": "w1 " * n, "label": "1"} for n in (1, 2, 8, 9)]
    f = _write(tmp_path / "d.jsonl", rows)
    task = build_task(_cfg(tok_dir, train_files=[str(f)], max_prompt_tokens=6))
    assert len(task.train) == 2 and task.dropped == 2
    assert "2 longer than task.max_prompt_tokens=6" in task.describe()


def test_sft_batch_masks_prompt_and_padding(tok_dir, tmp_path):
    rows = [{"prompt": "w1", "label": "12"}, {"prompt": "w1 w2 w3", "label": "3"}]
    task = build_task(_cfg(tok_dir, train_files=[str(_write(tmp_path / "d.jsonl", rows))]))
    b = sft_batch(task.train, task.codec.pad_id)
    for i, e in enumerate(task.train):
        p, t = len(e.prompt_ids), len(e.target_ids)
        assert b.tokens[i, : p + t].tolist() == [*e.prompt_ids, *e.target_ids]
        assert b.tokens[i, p + t :].eq(task.codec.pad_id).all()
        mask = b.loss_mask[i]
        assert mask.nonzero().flatten().tolist() == list(range(p - 1, p - 1 + t))


@pytest.mark.parametrize(
    ("make", "overrides", "fragments"),
    [
        (None, {"train_files": ["nope/*.jsonl"]}, ["task.train_files", "nope/*.jsonl"]),
        ([{"prompt": "w1"}, {"x": "w2"}], {}, ["d.jsonl line 2", "no key 'prompt'", "has x"]),
        ([], {}, ["task.train_files: no rows"]),
        ([{"prompt": "w1 w2 w3"}] * 3, {"max_prompt_tokens": 2},
         ["task.max_prompt_tokens=2", "3 of 3", "shortest has"]),
        ("{bad json\n", {}, ["d.jsonl line 1", "not valid JSON"]),
        ([{"prompt": 5}], {}, ["line 1", "'prompt' must be a string"]),
        ([{"prompt": "w1", "label": "1"}], {"metadata_keys": ["src"]},
         ["line 1", "no key 'src'"]),
        ([{"prompt": "w1"}] * 3, {"eval_size": 3}, ["task.eval_size=3", "every one of the 3"]),
    ],
    ids=["missing", "no-prompt-key", "empty", "all-too-long", "bad-json", "bad-prompt",
         "no-metadata", "eval-takes-all"],
)  # fmt: skip
def test_bad_data_fails_in_one_line(tok_dir, tmp_path, make, overrides, fragments):
    f = tmp_path / "d.jsonl"
    if isinstance(make, str):
        f.write_text(make)
    elif make is not None:
        _write(f, make)
    cfg = _cfg(tok_dir, **{"train_files": [str(f)], **overrides})
    with pytest.raises(TaskError) as info:
        build_task(cfg)
    msg = str(info.value)
    assert "\n" not in msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_tokenizer_and_checkpoint_problems_are_named(tok_dir, tmp_path):
    f = str(_write(tmp_path / "d.jsonl", _rows(3, "prompt")))
    with pytest.raises(TaskError, match="has no tokenizer"):
        build_task(_cfg(tmp_path, train_files=[f]))
    no_tok = _cfg(tok_dir, train_files=[f])
    no_tok.task.tokenizer = None
    no_tok.model.hf_checkpoint = None
    with pytest.raises(TaskError, match="needs a tokenizer"):
        build_task(no_tok)
    # model.hf_checkpoint without config.json: refused when the config is resolved
    from rl.checks import resolve_model

    cfg = composed(["task=dataset", f"task.train_files=[{f}]", f"model.hf_checkpoint={tok_dir}"])
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        resolve_model(cfg)


def test_prompt_plus_response_must_fit_the_context(tok_dir, tmp_path):
    f = _write(tmp_path / "d.jsonl", [{"prompt": "w1 " * 50, "label": "1"}] * 4)
    over = [f"task.train_files=[{f}]", f"task.tokenizer={tok_dir}", "task.eval_size=1"]
    cfg = composed(["task=dataset", *over, "rollout.sampling.max_new_tokens=16"])
    with pytest.raises(ConfigError, match="exceeds the context of 64 tokens"):
        check_task(cfg)
    cfg = composed(["task=dataset", *over, "sft.steps=5", "rl.steps=0",
                   "task.label_key=missing", "rollout.sampling.max_new_tokens=4"])  # fmt: skip
    with pytest.raises(ConfigError, match="needs a target on every prompt"):
        check_task(cfg)
