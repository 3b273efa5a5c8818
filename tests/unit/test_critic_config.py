"""A critic in the config: its ranks in the role map, and what is refused before launch, in
one line naming the ``critic.`` field."""

from __future__ import annotations

import pytest

from rl.checks import check
from rl.compose import compose
from rl.config.errors import ConfigError
from rl.config.roles import RoleMap
from rl.critic.settings import checkpoint_of, critic_model

PPO = ["critic=tiny", "algorithm/advantage=gae", "algorithm.group_size=1", "rl.prompts_per_step=64"]


def test_a_critic_gets_ranks_of_its_own_after_the_others():
    roles = RoleMap.from_config(compose([*PPO, "critic.trainer.tp=2"]))
    assert roles.describe() == (
        "controller 1 + trainer 2 + generator 1 + reward 1 + critic 2 = 7 ranks"
    )
    assert roles.ranks("critic") == [5, 6]
    assert roles.role_of(6) == ("critic", 1)
    assert "critic" not in RoleMap.from_config(compose([])).describe()
    assert "critic" not in RoleMap.from_config(compose([*PPO, "rl.steps=0"])).describe()


def test_the_critic_is_the_policys_decoder_with_a_scalar_head():
    cfg = compose(PPO)
    m = critic_model(cfg.model)
    assert m.architecture == "LlamaForSequenceClassification"
    assert m.num_layers == cfg.model.num_layers and m.vocab_size == cfg.model.vocab_size
    assert checkpoint_of("/run/checkpoint/") == "/run/checkpoint_critic"


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["algorithm/advantage=gae", "algorithm.group_size=1", "rl.prompts_per_step=64"],
         "algorithm/advantage=gae needs a critic's value for every token, and this run has "
         "no critic"),
        (["critic=tiny"],
         "critic.enabled=true but algorithm/advantage=grpo uses no critic: the critic learns "
         "the returns of an estimator that uses its values (algorithm/advantage=gae)"),
        ([*PPO, "critic.init=reward_model"],
         "critic.init='reward_model' is not supported (supported: policy)"),
        ([*PPO, "critic.clip=0"], "critic.clip=0.0 must be > 0 (or null: no clip)"),
        ([*PPO, "critic.trainer.tp=4"],
         "critic.trainer.tp=4 does not divide model.num_attention_heads=6"),
        ([*PPO, "critic.trainer.global_batch_size=32"],
         "critic.trainer.global_batch_size=32 must be the policy's "
         "trainer.global_batch_size=64: the critic trains on each RL batch whole"),
        ([*PPO, "critic.trainer.lora.rank=8"],
         "critic.trainer.lora.rank=8: a critic trains in full"),
    ],
)  # fmt: skip
def test_a_critic_that_cannot_work_is_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        check(compose(overrides))
    assert str(err.value) == line


def test_ppo_with_a_critic_passes_every_check():
    check(compose(PPO))
