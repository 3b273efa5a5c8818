"""What ``python -m rl.train`` refuses before it writes a file or starts a rank: each kind of
bad value, bad data file, model directory and reward function, through the pre-launch
check Hydra runs first (rl.checks.PrelaunchCheck). In this process: that the command line
prints this one line, writes nothing and starts no rank is tests/multiproc/
test_prelaunch_cli.py's (it launches rl.train itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl.checks import PrelaunchCheck
from rl.compose import compose


def _refused(tmp_path: Path, *args: str) -> str:
    """The line rl.train exits with for ``args`` (the run directory under ``tmp_path``)."""
    cfg = compose([f"run.output_dir={tmp_path / 'run'}", *args])
    with pytest.raises(SystemExit) as e:
        PrelaunchCheck().on_run_start(config=cfg)
    assert not (tmp_path / "run").exists()  # nothing written
    return str(e.value.code)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["algorithm.max_policy_lag=-1"], "algorithm.max_policy_lag=-1 must be >= 0"),
        (["algorithm.correction.rho=0"], "algorithm.correction.rho=0.0 must be > 0"),
        (["cluster.roles.reward=0"], "cluster.roles.reward=0: rl.steps=200 needs at least one"),
        (["model=tiny_moe", "trainer.ep=2"], "trainer.ep=2 does not divide trainer.dp=1"),
    ],
)
def test_bad_config_is_refused_in_one_line(args, message, tmp_path):
    said = _refused(tmp_path, *args)
    assert said.startswith(f"config error: {message}") and "\n" not in said, said


@pytest.fixture(scope="module")
def hf_policy(tmp_path_factory):
    """A tiny HF checkpoint with a tokenizer (no chat template) and a prompt file."""
    from tests.helpers.hf_models import make_model, make_tokenizer

    root = tmp_path_factory.mktemp("hf_policy")
    make_tokenizer(make_model("llama", root / "model"))
    make_model("llama", root / "no_tokenizer")
    rows = [{"question": f"w{i} w{i + 1}", "answer": str(i)} for i in range(20)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "bad.jsonl").write_text('{"question": "w1", "answer": "1"}\n{"q": "w2"}\n')
    (root / "empty.jsonl").write_text("")
    (root / "score.py").write_text("def score(prompt, response):\n    return 1.0\n")
    return root


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["task.train_files=[{root}/nope.jsonl]"], "task.train_files: no file matches"),
        (["task.train_files=[{root}/bad.jsonl]"], "{root}/bad.jsonl line 2: no key 'question'"),
        (["task.train_files=[{root}/empty.jsonl]"], "task.train_files: no rows in"),
        (["task.max_prompt_tokens=1"], "task.max_prompt_tokens=1 drops every prompt"),
        (["model.hf_checkpoint={root}"], "model.hf_checkpoint='{root}' has no config.json"),
        (["model.hf_checkpoint={root}/no_tokenizer"],
         "model.hf_checkpoint='{root}/no_tokenizer' has no tokenizer"),
        (["reward.fn={root}/score.py:score"], "reward.fn '{root}/score.py:score': takes"),
        (["reward.fn=no_such_module:score"], "reward.fn 'no_such_module:score'"),
    ],
    ids=["missing-file", "no-prompt-key", "empty", "all-too-long", "no-config-json",
         "no-tokenizer", "reward-signature", "reward-import"],
)  # fmt: skip
def test_bad_dataset_input_is_refused_in_one_line(hf_policy, args, message, tmp_path):
    base = [
        "task=dataset",
        f"model.hf_checkpoint={hf_policy}/model",
        f"task.train_files=[{hf_policy}/train.jsonl]",
        "task.prompt_key=question",
        "task.label_key=answer",
        "task.apply_chat_template=false",
        "task.eval_size=4",
        "trainer.tp=1",
    ]
    said = _refused(tmp_path, *base, *(a.format(root=hf_policy) for a in args))
    assert said.startswith(f"config error: {message.format(root=hf_policy)}"), said
    assert "\n" not in said
