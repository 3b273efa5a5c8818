"""On-policy distillation's dense term (rl/algorithms/distill.py) and a teacher in the
config: its ranks, and what is refused before launch in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl.algorithms.distill import distill_advantages
from rl.algorithms.registry import with_advantages
from rl.batch import TrainBatch
from rl.checks import check
from rl.compose import compose
from rl.config.errors import ConfigError
from rl.config.roles import RoleMap
from tests.helpers.hf_models import make_model

TINY_VOCAB = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2}


def _batch() -> TrainBatch:
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    return TrainBatch(
        torch.zeros(2, 4, dtype=torch.long), mask,
        behaviour_logprobs=torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, 0.0, 0.0]]),
        teacher_logprobs=torch.tensor([[0.0, -0.5, -3.0, 0.0], [0.0, -0.5, 0.0, 0.0]]),
    )  # fmt: skip


def test_each_sampled_token_gains_the_teachers_log_ratio():
    adv = torch.ones(2, 4) * _batch().loss_mask
    out, stats = distill_advantages(adv, _batch(), coef=2.0)
    # token (0,1): teacher -0.5 vs mu -1 -> +2*0.5; (0,2): -3 vs -2 -> -2*1; (1,1): equal
    assert out.tolist() == [[0.0, 2.0, -1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert stats["distill_kl"] == pytest.approx((-0.5 + 1.0 + 0.0) / 3)
    only, _ = distill_advantages(adv, _batch(), coef=2.0, only=True)
    assert only.tolist() == [[0.0, 1.0, -2.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="teacher_logprobs"):
        distill_advantages(adv, TrainBatch(torch.zeros(2, 4), _batch().loss_mask), 1.0)


def test_the_trainers_advantages_carry_the_dense_term():
    a = compose(["algorithm.distill_coef=0.5", "algorithm.group_size=2"]).algorithm
    batch = _batch()
    batch.rewards = torch.tensor([1.0, 0.0])
    plain, _ = with_advantages(compose(["algorithm.group_size=2"]).algorithm, batch)
    got, figures = with_advantages(a, batch)
    assert plain.advantages is not None and got.advantages is not None
    dense = 0.5 * (batch.teacher_logprobs - batch.behaviour_logprobs) * batch.loss_mask
    assert torch.equal(got.advantages, plain.advantages + dense)
    assert figures["adv_distill_kl"] == pytest.approx(1 / 6)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("teacher_config")
    return {
        "teacher": make_model("qwen3", root / "teacher", extra=TINY_VOCAB),
        "score": make_model("llama", root / "score", score=True, extra=TINY_VOCAB),
        "other_vocab": make_model("llama", root / "other"),
    }


def test_a_teacher_of_another_family_gets_ranks_of_its_own(dirs):
    cfg = compose(["teacher=cpu", f"teacher.hf_checkpoint={dirs['teacher']}",
                   "algorithm.distill_coef=1", "teacher.trainer.pp=2",
                   "teacher.trainer.max_tokens_per_microbatch=null"])  # fmt: skip
    check(cfg)
    roles = RoleMap.from_config(cfg)
    assert (
        roles.describe()
        == "controller 1 + trainer 2 + generator 1 + reward 1 + teacher 2 = 7 ranks"
    )


@pytest.mark.parametrize(
    ("kind", "more", "line"),
    [
        (None, ["algorithm.distill_coef=1"],
         "algorithm.distill_coef=1.0 needs a teacher: set teacher=cpu teacher.hf_checkpoint=DIR"),
        (None, ["algorithm.distill_only=true"],
         "algorithm.distill_only=true with algorithm.distill_coef=0: nothing would be learned "
         "(set algorithm.distill_coef > 0)"),
        ("teacher", ["algorithm.distill_coef=1", "algorithm.distill_only=true",
                     "algorithm.drop_uniform_groups=true"],
         "algorithm.drop_uniform_groups=true with algorithm.distill_only=true: a group of "
         "equal rewards still carries the teacher's signal (set it to false)"),
        ("teacher", [],
         "teacher.enabled=true but algorithm.distill_coef=0: the teacher would be unused (set "
         "algorithm.distill_coef > 0)"),
        ("score", ["algorithm.distill_coef=1"],
         "teacher.hf_checkpoint='{score}' is a LlamaForSequenceClassification: a teacher needs "
         "an LM head (*ForCausalLM)"),
        ("other_vocab", ["algorithm.distill_coef=1"],
         "teacher.hf_checkpoint='{other_vocab}' has vocab_size=99, the policy 32: it scores "
         "the policy's token ids, so the two must share a tokenizer"),
        ("teacher", ["algorithm.distill_coef=1", "teacher.trainer.pp=3",
                     "teacher.trainer.max_tokens_per_microbatch=null"],
         "teacher.trainer.pp=3 does not divide the teacher's num_layers=2"),
    ],
)  # fmt: skip
def test_a_teacher_that_cannot_work_is_refused_in_one_line(dirs, kind, more, line):
    paths = {k: str(v) for k, v in dirs.items()}
    args = ["teacher=cpu", f"teacher.hf_checkpoint={paths[kind]}", *more] if kind else more
    with pytest.raises(ConfigError) as err:
        check(compose(args))
    assert str(err.value) == line.format(**paths)
