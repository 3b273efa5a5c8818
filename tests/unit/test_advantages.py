"""Advantage estimators, GSPO's sequence ratio and the loss aggregations against values
computed by hand (milliseconds, pure logic; rl/algorithms/advantages/, losses.py,
aggregation.py).

The group example: two prompts of three samples each, rewards [[1, 0, 2], [0, 0, 3]],
one response token per sample. Both groups have mean 1; group 0's deviations are
[0, -1, 1] (unbiased std 1), group 1's [-1, -1, 2] (std sqrt(3)).
"""

from __future__ import annotations

import math

import pytest
import torch

from rl.algorithms.advantages.gae import GaeConfig
from rl.algorithms.advantages.grpo import GrpoConfig
from rl.algorithms.advantages.reinforce_pp import ReinforcePpConfig
from rl.algorithms.aggregation import aggregator
from rl.algorithms.losses import gspo_loss
from rl.algorithms.registry import check_config, estimators, loss_agg, with_advantages
from rl.batch import TrainBatch
from rl.config.errors import ConfigError
from rl.config.schema import AdvantageConfig, AlgorithmConfig
from tests.helpers.configs import composed

REWARDS = [1.0, 0.0, 2.0, 0.0, 0.0, 3.0]


def _batch(rewards: list[float], lengths: list[int], **fields: torch.Tensor) -> TrainBatch:
    """Rows of a one-token prompt and ``lengths[i]`` response tokens (index t scores
    token t+1, so the response's mask starts at column 0), right-padded."""
    seq = max(lengths) + 1
    mask = torch.zeros(len(lengths), seq)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    tokens = torch.zeros(len(lengths), seq, dtype=torch.long)
    return TrainBatch(tokens, mask, rewards=torch.tensor(rewards), **fields)


def _estimate(advantage: AdvantageConfig, batch: TrainBatch, **alg) -> tuple[TrainBatch, dict]:
    return with_advantages(AlgorithmConfig(advantage=advantage, **alg), batch)


def _per_sample(name: str, **alg) -> list[float]:
    """The named estimator's advantage of each sample of the group example."""
    config = estimators()[name].config()
    b, _ = _estimate(config, _batch(REWARDS, [1] * 6), group_size=3, **alg)
    assert b.advantages is not None
    return b.advantages[:, 0].tolist()


def test_grpo_divides_by_the_groups_std():
    s3 = math.sqrt(3)
    want = [0, -1, 1, -1 / s3, -1 / s3, 2 / s3]
    assert _per_sample("grpo") == pytest.approx([w / (1 + 1e-6) for w in want[:3]] + [
        w * s3 / (s3 + 1e-6) for w in want[3:]], abs=1e-6)  # fmt: skip


def test_dr_grpo_keeps_the_scale_of_the_rewards():
    assert _per_sample("dr_grpo") == pytest.approx([0, -1, 1, -1, -1, 2], abs=1e-6)


def test_rloo_leaves_each_sample_out_of_its_baseline():
    # group 0: baselines (3 - r_i) / 2 = [1, 1.5, 0.5]; group 1: [1.5, 1.5, 0]
    assert _per_sample("rloo") == pytest.approx([0, -1.5, 1.5, -1.5, -1.5, 3], abs=1e-6)


def test_reinforce_pp_normalises_over_the_whole_batch():
    # one token each: returns = rewards; batch mean 1, deviations [0,-1,1,-1,-1,2],
    # unbiased variance 8/5
    std = math.sqrt(8 / 5)
    want = [d / (std + 1e-6) for d in [0, -1, 1, -1, -1, 2]]
    assert _per_sample("reinforce_pp") == pytest.approx(want, abs=1e-6)


def test_reinforce_pp_takes_the_kl_as_a_per_token_reward():
    """One response of 3 tokens, reward 1, log mu - log pi_ref = [0.1, -0.2, 0.3],
    kl_coef 0.5: token rewards [-0.05, 0.1, 0.85]; with gamma 0.5 the returns are
    [0.2125, 0.525, 0.85] (G_t = r_t + 0.5 G_t+1), whitened over the 3 tokens."""
    mu = torch.tensor([[0.1, -0.2, 0.3, 0.0]])
    b = _batch([1.0], [3], behaviour_logprobs=mu, ref_logprobs=torch.zeros(1, 4))
    out, figures = _estimate(ReinforcePpConfig(gamma=0.5), b, group_size=1, kl_coef=0.5)
    g = torch.tensor([0.2125, 0.525, 0.85], dtype=torch.float64)
    want = (g - g.mean()) / (g.std() + 1e-6)
    assert out.advantages is not None
    torch.testing.assert_close(out.advantages[0, :3].double(), want, atol=1e-6, rtol=0)
    assert out.advantages[0, 3] == 0
    assert figures["adv_baseline_mean"] == pytest.approx(g.mean().item())
    assert figures["adv_kl_ref"] == pytest.approx(0.2 / 3)
    # the KL is in the reward, so the loss carries no KL term (it would need ref_logprobs)
    a = composed(["algorithm/advantage=reinforce_pp", "algorithm.kl_coef=0.5"]).algorithm
    assert estimators()["reinforce_pp"].kl_in_reward and a.kl_coef == 0.5


def test_gae_by_hand_over_five_tokens_skipping_an_observation():
    """Reward 1 on the last of 5 tokens, V = [0.5, 0.4, 0.6, 0.7, 0.2], gamma 1, lambda
    0.5: deltas [-0.1, 0.2, 0.1, -0.5, 0.8], advantages (A_t = delta_t + 0.5 A_t+1)
    [0.0125, 0.225, 0.05, -0.1, 0.8], returns A + V [0.5125, 0.625, 0.65, 0.6, 1.0]. An
    environment's token between the 2nd and 3rd is off the mask and skipped."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 9.0, 0.6, 0.7, 0.2, 9.0]])
    b = TrainBatch(torch.zeros(1, 7, dtype=torch.long), mask, rewards=torch.tensor([1.0]),
                   values=values)  # fmt: skip
    e = estimators()["gae"]
    c = GaeConfig(gamma=1.0, lam=0.5, whiten=False)
    adv, _, returns = e.estimate(c, AlgorithmConfig(advantage=c, group_size=1), b)
    on = mask[0] > 0
    assert adv[0, on].tolist() == pytest.approx([0.0125, 0.225, 0.05, -0.1, 0.8])
    assert returns is not None
    assert returns[0, on].tolist() == pytest.approx([0.5125, 0.625, 0.65, 0.6, 1.0])
    assert adv[0, ~on].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"batch has no values"):
        e.estimate(c, AlgorithmConfig(advantage=c), _batch([1.0], [2]))


def test_every_estimator_reports_its_figures():
    _, figures = _estimate(GrpoConfig(), _batch([1.0, 1.0, 0.0, 1.0], [1, 1, 2, 2]), group_size=2)
    assert set(figures) == {"adv_baseline_mean", "adv_mean", "adv_std", "adv_zero_frac"}
    assert figures["adv_baseline_mean"] == pytest.approx(0.75)
    assert figures["adv_zero_frac"] == pytest.approx(2 / 6)  # group 0 is uniform: 2 tokens


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["algorithm/advantage=gae"], ["algorithm/advantage=gae needs a critic's value"]),
        (["algorithm/advantage=rloo", "algorithm.group_size=1"],
         ["algorithm/advantage=rloo needs groups", "algorithm.group_size=1"]),
        (["algorithm.loss_agg=seq_sum"], ["algorithm.loss_agg='seq_sum' must be one of"]),
        (["algorithm/objective=gspo"], ["algorithm.correction='aipo' must be 'none'"]),
        (["algorithm/objective=gspo", "algorithm/correction=none",
          "algorithm.objective.clip_low=1.5"], ["algorithm.objective.clip_low=1.5"]),
    ],
)  # fmt: skip
def test_a_mismatch_is_refused_in_one_line(overrides: list[str], fragments: list[str]):
    with pytest.raises(ConfigError) as info:
        check_config(composed(overrides).algorithm, max_response_tokens=4)
    assert "\n" not in str(info.value)
    for f in fragments:
        assert f in str(info.value)


def test_reinforce_pp_runs_with_one_sample_per_prompt():
    a = composed(["algorithm/advantage=reinforce_pp", "algorithm.group_size=1"]).algorithm
    check_config(a, max_response_tokens=4)
    check_config(composed(["algorithm/advantage=gae"]).algorithm, 4, critic=True)


def test_each_choice_names_its_loss_aggregation():
    def agg(*o: str) -> str:
        return loss_agg(composed(list(o)).algorithm)

    assert agg() == "token_mean"  # the default, both presets
    assert agg("algorithm=grpo") == "token_mean"
    assert agg("algorithm/advantage=dr_grpo") == "seq_mean_token_sum_norm"
    assert agg("algorithm/objective=gspo", "algorithm/correction=none") == "seq_mean_token_mean"
    assert agg("algorithm/advantage=dr_grpo", "algorithm.loss_agg=token_mean") == "token_mean"


# ------------------------------------------------------------------ aggregations
# Three responses of 1, 2 and 3 tokens with per-token losses [[2], [1, 3], [0, 3, 6]].
LOSS = torch.tensor([[2.0, 0, 0], [1, 3, 0], [0, 3, 6]])
MASK = torch.tensor([[1.0, 0, 0], [1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("token_mean", 15 / 6),  # every token alike: 15 over 6 tokens
        ("seq_mean_token_mean", (2 + 2 + 3) / 3),  # each response's mean, then their mean
        ("seq_mean_token_sum_norm", 15 / (3 * 4)),  # 15 over 3 responses x L = 4
    ],
)
def test_aggregations_by_hand(mode: str, want: float):
    total, den = aggregator(mode, max_tokens=4)(LOSS, MASK)
    assert (total / den).item() == pytest.approx(want)
    assert den.dtype == torch.int  # Megatron sums the denominators as ints
    # any split of the rows (micro-batches, DP ranks) sums to the same loss
    parts = [aggregator(mode, 4)(LOSS[rows], MASK[rows]) for rows in ([0], [1, 2])]
    assert (sum(p[0] for p in parts) / sum(p[1] for p in parts)).item() == pytest.approx(want)


def test_a_response_with_no_counted_token_is_not_a_sequence():
    mask = MASK.clone()
    mask[0] = 0
    total, den = aggregator("seq_mean_token_mean")(LOSS, mask)
    assert (den.item(), total.item()) == (2, pytest.approx(2 + 3))


# ------------------------------------------------------------------ GSPO
def test_gspo_ratio_and_clip_by_hand():
    """Two responses of two tokens, log pi = [-1, -2], log mu = [-1.2, -1.6]: token
    log-ratios [0.2, -0.4], sequence ratio s = exp(-0.1) = 0.904837 for both. Band
    [0.95, 1.05]. Advantage +1: min(s, 0.95) = s, not clipped, loss -s, each token's
    gradient -s/2 (seq_mean_token_mean). Advantage -1: min(-s, -0.95) = -0.95, clipped:
    loss 0.95, no gradient."""
    lp = torch.tensor([[-1.0, -2.0, 0.0]] * 2, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 2)
    mb = TrainBatch(torch.zeros(2, 3, dtype=torch.long), mask,
                    behaviour_logprobs=torch.tensor([[-1.2, -1.6, 0.0]] * 2),
                    advantages=torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]]))  # fmt: skip
    out = gspo_loss(0.05, 0.05, agg=aggregator("seq_mean_token_mean"))(lp, mb)
    s = math.exp(-0.1)
    assert out.denominator is not None and out.denominator.item() == 2
    assert out.loss_sum.item() == pytest.approx(-s + 0.95, abs=1e-6)
    assert out.stats["seq_is_ratio"].item() == pytest.approx(2 * s, abs=1e-6)
    assert out.stats["seq_clipped_frac"].item() == 1.0  # the second response
    out.loss_sum.backward()
    assert lp.grad is not None
    torch.testing.assert_close(
        lp.grad, torch.tensor([[-s / 2, -s / 2, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6, rtol=0
    )


def test_gspo_works_from_pi_old_as_sample_reuse_gives_it():
    """With several updates per batch the ratio stays against mu; pi_old only splits the
    logged mismatch from the policy's move."""
    lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    mb = TrainBatch(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[1.0, 1.0, 0.0]]),
                    behaviour_logprobs=torch.tensor([[-1.2, -1.6, 0.0]]),
                    advantages=torch.tensor([[1.0, 1.0, 0.0]]),
                    old_logprobs=torch.tensor([[-1.1, -1.9, 0.0]]))  # fmt: skip
    out = gspo_loss(0.2, 0.2)(lp, mb)
    assert out.stats["seq_is_ratio"].item() == pytest.approx(math.exp(-0.1), abs=1e-6)
    assert out.stats["policy_change_abs_logp"].item() == pytest.approx(0.2, abs=1e-6)
