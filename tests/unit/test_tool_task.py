"""tools/make_tool_task.py and the experiment that trains on it (conf/experiment/
tiny_tools.yaml): seeded, disjoint rows whose demonstrations the calculator agrees with,
a tokenizer within the model's vocabulary, and a task the pre-launch checks accept."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rl.checks import check, check_task
from rl.envs.tools import calculate
from tests.helpers.configs import composed

ROOT = Path(__file__).resolve().parents[2]


def _maker():
    spec = importlib.util.spec_from_file_location(
        "make_tool_task", ROOT / "tools" / "make_tool_task.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_task_files_and_the_experiment_on_them(tmp_path):
    maker = _maker()
    out = tmp_path / "tool_task"
    assert maker.main(["--out", str(out), "--train", "60", "--eval", "20"]) == 0
    train = [json.loads(x) for x in (out / "train.jsonl").open()]
    evals = [json.loads(x) for x in (out / "eval.jsonl").open()]
    assert len(train) == 60 and len(evals) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    for r in train:
        call, result, answer = r["demo"]
        expr = json.loads(call["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert calculate(expr["arguments"]["expression"]) == result["content"] == r["label"]
        assert (
            answer["content"] == r["label"]
            and f"is {expr['arguments']['expression']}?" in r["prompt"]
        )
    assert all("demo" not in r for r in evals)
    again = tmp_path / "again"
    maker.main(["--out", str(again), "--train", "60", "--eval", "20"])
    for name in ("train.jsonl", "eval.jsonl", "tokenizer/tokenizer.json"):
        assert (out / name).read_bytes() == (again / name).read_bytes(), name

    files = [f"task.tokenizer={out / 'tokenizer'}", f"task.train_files=[{out / 'train.jsonl'}]",
             f"task.eval_files=[{out / 'eval.jsonl'}]"]  # fmt: skip
    cfg = composed(["experiment=tiny_tools", *files])
    check(cfg)
    task = check_task(cfg)  # every prompt and demonstration rendered, the context checked
    ex = task.train[0]
    assert ex.target_mask.count(False) > 0 and ex.target_mask[-1]  # the result not trained on
    assert max(ex.prompt_ids + ex.target_ids) < cfg.model.vocab_size
    assert len(ex.prompt_ids) + len(ex.target_ids) <= cfg.model.max_position_embeddings
