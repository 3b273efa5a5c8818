"""A reward model in the config and in the controller's hands: its ranks, what is refused
before launch in one line, how its scores become rewards, and its thread beside the rule's
reward ranks (a stand-in handle; the real model runs in the deterministic job of
tests/servers/test_rl_resume.py)."""

from __future__ import annotations

import importlib.util
import json
import math
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from rl.batch import TrainBatch
from rl.checks import check
from rl.companion.reward_model import (
    Normaliser,
    pad_token_id,
    scored_positions,
    sequence_scores,
    weights,
)
from rl.compose import compose
from rl.config.errors import ConfigError
from rl.config.roles import RoleMap
from rl.controller.model_reward import ModelReward
from rl.generator.types import Rollout
from rl.tasks.scoring import ScoreResult, rule_fn
from tests.helpers.hf_models import make_model

ROOT = Path(__file__).resolve().parents[2]
TINY_VOCAB = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm_config")
    return {
        "rm": make_model("llama", root / "rm", score=True, extra=TINY_VOCAB),
        "causal": make_model("llama", root / "causal", extra=TINY_VOCAB),
        "other_vocab": make_model("llama", root / "other", score=True),
    }


def rm_args(path: Path, *more: str) -> list[str]:
    return ["reward_model=cpu", f"reward_model.hf_checkpoint={path}", *more]


def test_a_reward_model_gets_ranks_of_its_own_and_the_rule_still_scores_evaluation(dirs):
    cfg = compose(rm_args(dirs["rm"], "reward.fn=model", "reward_model.trainer.tp=2"))
    check(cfg)
    roles = RoleMap.from_config(cfg)
    assert roles.describe() == (
        "controller 1 + trainer 2 + generator 1 + reward 1 + reward_model 2 = 7 ranks"
    )
    assert roles.ranks("reward_model") == [5, 6]
    assert rule_fn(cfg.reward) == "exact" and weights(cfg.reward) == {"model": 1.0}
    both = compose(rm_args(dirs["rm"], "reward.combine.rule=1", "reward.combine.model=0.5"))
    check(both)
    assert rule_fn(both.reward) == "exact"
    assert weights(both.reward) == {"rule": 1.0, "model": 0.5}
    assert "reward_model" not in RoleMap.from_config(compose([])).describe()


@pytest.mark.parametrize(
    ("kind", "more", "line"),
    [
        (None, ["reward.fn=model"],
         "reward.fn=model needs a reward model: set reward_model=cpu "
         "reward_model.hf_checkpoint=DIR"),
        (None, ["reward.combine.model=0.5"],
         "reward.combine.model=0.5 needs a reward model: set reward_model=cpu "
         "reward_model.hf_checkpoint=DIR"),
        ("rm", [],
         "reward_model.enabled=true but the reward does not use it: set reward.fn=model or "
         "reward.combine.model"),
        ("rm", ["reward.fn=model", "reward.combine.rule=1"],
         "reward.combine.rule=1.0 with reward.fn=model: there is no rule to weigh (set "
         "reward.fn to the rule, e.g. exact)"),
        ("rm", ["reward.fn=model", "reward_model.normalize=zscore"],
         "reward_model.normalize='zscore' is not one of none, standard, sigmoid"),
        ("rm", ["reward.fn=model", "reward_model.std=0"], "reward_model.std=0.0 must be > 0"),
        ("causal", ["reward.fn=model"],
         "reward_model.hf_checkpoint='{causal}' is a LlamaForCausalLM: a reward model needs a "
         "classification head (*ForSequenceClassification, num_labels=1)"),
        ("other_vocab", ["reward.fn=model"],
         "reward_model.hf_checkpoint='{other_vocab}' has vocab_size=99, the policy 32: it "
         "scores the policy's token ids, so the two must share a tokenizer"),
        ("rm", ["reward.fn=model", "reward_model.trainer.tp=3"],
         "reward_model.trainer.tp=3 does not divide the reward model's num_attention_heads=4"),
        ("missing", ["reward.fn=model"],
         "reward_model.hf_checkpoint='{missing}' does not exist"),
    ],
)  # fmt: skip
def test_a_reward_model_that_cannot_work_is_refused_in_one_line(dirs, tmp_path, kind, more, line):
    paths = {**{k: str(v) for k, v in dirs.items()}, "missing": str(tmp_path / "nowhere")}
    args = rm_args(Path(paths[kind]), *more) if kind else more
    with pytest.raises(ConfigError) as err:
        check(compose(args))
    assert str(err.value) == line.format(**paths)


def test_scores_are_normalised_with_the_checkpoints_own_statistics(tmp_path):
    (tmp_path / "reward_stats.json").write_text(json.dumps({"mean": 2.0, "std": 4.0}))
    cfg = compose(rm_args(tmp_path, "reward.fn=model"))
    n = Normaliser.from_config(cfg.reward_model)
    assert (n.mode, n.mean, n.std) == ("standard", 2.0, 4.0) and n(10.0) == 2.0
    s = Normaliser.from_config(compose(rm_args(tmp_path, "reward_model.normalize=sigmoid",
                                               "reward_model.mean=1")).reward_model)  # fmt: skip
    assert s(5.0) == pytest.approx(1 / (1 + math.exp(-1.0)))
    assert Normaliser("none", 2.0, 4.0)(10.0) == 10.0
    assert Normaliser.from_config(compose(rm_args(tmp_path / "x")).reward_model).std == 1.0


class _Handle:
    """The reward model's handle: every token's value is its id times 10 plus its column."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def forward(self, batch) -> torch.Tensor:
        self.batches.append(batch.tokens)
        cols = torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens)
        return (batch.tokens * 10 + cols).float()


def test_a_groups_rewards_weigh_the_rules_score_with_the_models_last_token_score():
    handle = _Handle()
    scorer = ModelReward(handle, Normaliser("standard", 1.0, 2.0),  # type: ignore[arg-type]
                         {"rule": 1.0, "model": 0.5}, pad_id=0, pad_token_id=None,
                         rows_multiple=3)  # fmt: skip
    group = [Rollout([5, 6], None, output_ids=[7, 8, 2]), Rollout([5, 6], None, output_ids=[9])]  # type: ignore[arg-type]
    rule: Future[list[ScoreResult]] = Future()
    out = scorer.score(group, rule)
    while not handle.batches:  # the model scores on its own thread while the rule waits
        pass
    assert handle.batches[0].tolist() == [[5, 6, 7, 8, 2], [5, 6, 9, 0, 0], [0] * 5]
    assert not out.done()
    rule.set_result([ScoreResult(1.0, {"x": 3.0}), ScoreResult(0.0)])
    got = out.result(timeout=10)
    raw = [2 * 10 + 4, 9 * 10 + 2]  # each row's last token: 2 at column 4, 9 at column 2
    assert [r.metrics["model_raw"] for r in got] == raw
    assert got[0].metrics["model_s"] == got[1].metrics["model_s"] >= 0  # the group's forward
    assert got[0].score == pytest.approx(1.0 + 0.5 * (raw[0] - 1) / 2)
    assert got[1].score == pytest.approx(0.0 + 0.5 * (raw[1] - 1) / 2)
    assert got[0].metrics["rule"] == 1.0 and got[0].metrics["x"] == 3.0
    assert sequence_scores(torch.arange(6.0).view(2, 3), [2, None]) == [2.0, 0.0]
    failed: Future[list[ScoreResult]] = Future()
    bad = scorer.score(group, failed)
    failed.set_exception(RuntimeError("reward rank lost"))
    with pytest.raises(RuntimeError, match="reward rank lost"):
        bad.result(timeout=10)
    scorer.close()


def test_the_scored_token_is_the_rightmost_that_is_not_the_pad_id(tmp_path):
    seqs = [[1, 5, 6, 0], [1, 5, 0, 0], [1, 0, 0, 6], [1, 5, 6], [0, 0], [], [0, 7]]
    assert scored_positions(seqs, 0) == [2, 1, 3, 2, None, None, 1]
    assert scored_positions(seqs, None) == [3, 3, 3, 2, 1, None, 1]  # no pad id: the last
    # A config with a text_config: transformers reads that one's (get_text_config()).
    (tmp_path / "config.json").write_text(
        json.dumps({"pad_token_id": 5, "text_config": {"pad_token_id": 7}})
    )
    assert pad_token_id(str(tmp_path)) == 7


class _HFValues:
    """The reward model's handle, run by transformers: its score head on every token."""

    def __init__(self, model) -> None:
        self.model = model

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        with torch.no_grad():
            return self.model.score(self.model.model(batch.tokens).last_hidden_state)[..., 0]


def test_each_sample_is_scored_where_transformers_pools_it(dirs):
    """Each sample's score is ``AutoModelForSequenceClassification``'s logit of it alone:
    responses that end in the model's pad id (0), one with pad ids inside, one with none;
    the batch is padded with another id (the policy's, here 3). A sample of pad ids only
    scores 0 and is counted. Without a pad id in its config, transformers scores one row
    at its last token, and so does the job. ``tools/train_reward_model.py`` pools the same
    way, so the models it trains read back as they were trained."""
    import transformers

    assert pad_token_id(str(dirs["rm"])) == 0 and pad_token_id(str(dirs["causal"])) is None
    model = transformers.AutoModelForSequenceClassification.from_pretrained(dirs["rm"]).eval()
    outs = [[7, 8, 0], [7, 0, 0], [0, 9, 0, 8], [7, 8, 9, 2]]
    group = [Rollout([1, 5, 6], None, output_ids=o) for o in outs]  # type: ignore[arg-type]
    seqs = [[*r.prompt_ids, *r.output_ids] for r in group]

    def logit(ids: list[int]) -> float:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, 0].item()

    rm = ModelReward(_HFValues(model), Normaliser(), {"model": 1.0}, pad_id=3, pad_token_id=0,  # type: ignore[arg-type]
                     rows_multiple=4)  # fmt: skip
    empty = Rollout([0], None, output_ids=[0, 0])  # type: ignore[arg-type]
    raw, _ = rm.scores([*group, empty])
    want = [logit(s) for s in seqs]
    assert max(abs(a - b) for a, b in zip(raw, want, strict=False)) < 1e-5
    assert raw[4] == 0.0 and rm.all_pad == 1
    at_pad = _HFValues(model).forward(TrainBatch(torch.tensor(seqs[:1])))[0, -1].item()
    assert abs(want[0] - at_pad) > 1e-3  # the last token's value would be another score
    spec = importlib.util.spec_from_file_location("train_rm", ROOT / "tools/train_reward_model.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with torch.no_grad():
        trained = tool.scores(model, [*seqs, [0, 0, 0]], 0).tolist()
    assert max(abs(a - b) for a, b in zip(trained, [*want, 0.0], strict=True)) < 1e-5
    model.config.pad_token_id = None
    no_pad = ModelReward(_HFValues(model), Normaliser(), {"model": 1.0}, pad_id=3,  # type: ignore[arg-type]
                         pad_token_id=None)  # fmt: skip
    raw, _ = no_pad.scores([*group, empty])
    want = [logit(s) for s in [*seqs, [0, 0, 0]]]
    assert max(abs(a - b) for a, b in zip(raw, want, strict=True)) < 1e-5
    assert no_pad.all_pad == 0
    rm.close()
    no_pad.close()
