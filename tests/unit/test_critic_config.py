"""A critic in the config: its ranks in the role map, and what is refused before launch, in
one line naming the ``critic.`` field."""

from __future__ import annotations

import pytest

from rl.checks import check
from rl.companion.critic import checkpoint_of
from rl.companion.settings import with_head
from rl.compose import compose
from rl.config.errors import ConfigError
from rl.config.roles import RoleMap

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
    m = with_head(cfg.model, "score")
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
         "critic.init='reward_model' is not supported (supported: policy, hf)"),
        ([*PPO, "critic.clip=0"], "critic.clip=0.0 must be > 0 (or null: no clip)"),
        ([*PPO, "critic.trainer.tp=4"],
         "critic.trainer.tp=4 does not divide model.num_attention_heads=6"),
        ([*PPO, "critic.trainer.global_batch_size=32"],
         "critic.trainer.global_batch_size=32 must be the policy's "
         "trainer.global_batch_size=64: the critic trains on each RL batch whole"),
        ([*PPO, "critic.epochs=0"], "critic.epochs=0 must be an integer >= 1"),
        ([*PPO, "critic.minibatches=3"],
         "critic.minibatches=3 does not cut the batch of 64 rows into minibatches of whole "
         "critic.trainer micro-batches (64 rows)"),
        ([*PPO, "critic.trainer.lora.rank=8"],
         "critic.trainer.lora.rank=8: only the policy has LoRA"),
    ],
)  # fmt: skip
def test_a_critic_that_cannot_work_is_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        check(compose(overrides))
    assert str(err.value) == line


def test_ppo_with_a_critic_passes_every_check():
    check(compose(PPO))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    from tests.helpers.hf_models import make_model

    root, tiny = tmp_path_factory.mktemp("critic_hf"), {"vocab_size": 32, "num_hidden_layers": 2}
    return {
        "rm": str(make_model("qwen2", root / "rm", score=True, extra=tiny)),
        "causal": str(make_model("llama", root / "causal", extra=tiny)),
        "other": str(make_model("llama", root / "other", score=True)),
    }


def test_a_critic_starts_from_a_reward_model_of_another_family(hf_dirs):
    from rl.companion.critic import model

    cfg = compose([*PPO, "critic.init=hf", f"critic.hf_checkpoint={hf_dirs['rm']}"])
    check(cfg)
    m = model(cfg)
    assert (m.architecture, m.num_layers) == ("Qwen2ForSequenceClassification", 2)


@pytest.mark.parametrize(
    ("kind", "more", "line"),
    [
        ("causal", ["critic.init=hf"],
         "critic.hf_checkpoint='{causal}' is a LlamaForCausalLM: a critic starts from a scalar "
         "head (*ForSequenceClassification, num_labels=1)"),
        ("other", ["critic.init=hf"],
         "critic.hf_checkpoint='{other}' has vocab_size=99, the policy 32: it values the "
         "policy's token ids, so the two must share a tokenizer"),
        ("rm", [], "critic.hf_checkpoint is set but critic.init=policy: set critic.init=hf to "
         "start from it"),
        ("rm", ["critic.init=hf", "critic.trainer.tp=3"],
         "critic.trainer.tp=3 does not divide the critic's num_attention_heads=4"),
    ],
)  # fmt: skip
def test_a_critic_from_an_hf_checkpoint_that_cannot_work_is_refused(hf_dirs, kind, more, line):
    with pytest.raises(ConfigError) as err:
        check(compose([*PPO, *more, f"critic.hf_checkpoint={hf_dirs[kind]}"]))
    assert str(err.value) == line.format(**hf_dirs)
