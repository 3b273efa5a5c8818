"""RL losses and advantages against hand-computed values (milliseconds, pure logic).

One sequence of three scored tokens (the last position never counts): log pi =
[-1, -2, -0.5], log mu = [-1.5, -0.5, -0.5], advantages [2, 2, -1]. Ratios pi/mu are
e^0.5 = 1.6487, e^-1.5 = 0.2231 and 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl.algorithms.advantages import group_advantages, token_advantages
from rl.algorithms.losses import aipo_loss, ppo_clip_loss

R0, R1 = math.exp(0.5), math.exp(-1.5)


def _batch(ref: list[float] | None = None):
    lp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], requires_grad=True)
    mb = {
        "loss_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        "behaviour_logprobs": torch.tensor([[-1.5, -0.5, -0.5, 0.0]]),
        "advantages": torch.tensor([[2.0, 2.0, -1.0, 0.0]]),
    }
    if ref is not None:
        mb["ref_logprobs"] = torch.tensor([[*ref, 0.0]])
    return lp, mb


def test_aipo_value_and_stats():
    lp, mb = _batch()
    out = aipo_loss(rho=1.5)(lp, mb)
    # weights min(ratio, 1.5) = [1.5, e^-1.5, 1]; per token -(w * A * log pi)
    want = -(1.5 * 2 * -1.0) - (R1 * 2 * -2.0) - (1.0 * -1 * -0.5)
    assert out.loss_sum.item() == pytest.approx(want, rel=1e-6)
    assert out.num_tokens.item() == 3
    assert out.stats["truncated_frac"].item() == 1  # only the first ratio exceeds rho
    assert out.stats["mismatch_abs_logp"].item() == pytest.approx(0.5 + 1.5 + 0.0)
    assert out.stats["is_ratio"].item() == pytest.approx(R0 + R1 + 1.0, rel=1e-6)


def test_aipo_gradient_flows_only_through_log_pi():
    """The truncated weight is a constant: d loss / d log pi = -min(ratio, rho) * A, with
    no term from differentiating the ratio (which would add -w * A * log pi)."""
    lp, mb = _batch()
    aipo_loss(rho=1.5)(lp, mb).loss_sum.backward()
    want = torch.tensor([[-1.5 * 2, -R1 * 2, -1.0 * -1, 0.0]])
    torch.testing.assert_close(lp.grad, want)


def test_aipo_without_truncation_is_the_importance_weighted_gradient():
    lp, mb = _batch()
    aipo_loss(rho=100.0)(lp, mb).loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-R0 * 2, -R1 * 2, 1.0, 0.0]]))


def test_ppo_clip_value_and_gradient():
    lp, mb = _batch()
    out = ppo_clip_loss(clip_eps=0.2)(lp, mb)
    # t0: min(1.6487*2, 1.2*2) = 2.4 (clipped: no gradient); t1: min(0.2231*2, 0.8*2);
    # t2: ratio 1 -> -1.
    want = -2.4 - R1 * 2 + 1.0
    assert out.loss_sum.item() == pytest.approx(want, rel=1e-6)
    assert "truncated_frac" not in out.stats
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -2 * R1, 1.0, 0.0]]))


def test_kl_penalty_to_reference():
    lp, mb = _batch(ref=[-1.0, -1.0, -1.0])
    base = aipo_loss(rho=1.5)(lp, mb).loss_sum.item()
    out = aipo_loss(rho=1.5, kl_coef=0.1)(lp, mb)
    # k3 = e^r - r - 1 with r = ref - log pi = [0, 1, -0.5]
    kl = [0.0, math.e - 2, math.exp(-0.5) - 0.5]
    assert out.stats["kl_ref"].item() == pytest.approx(sum(kl), rel=1e-6)
    assert out.loss_sum.item() == pytest.approx(base + 0.1 * sum(kl), rel=1e-6)


def test_masked_positions_change_nothing():
    lp, mb = _batch()
    mb["advantages"][0, 3] = 100.0
    mb["behaviour_logprobs"][0, 3] = -50.0
    out = aipo_loss(rho=1.5)(lp, mb)
    out.loss_sum.backward()
    assert lp.grad[0, 3].item() == 0.0
    assert out.stats["truncated_frac"].item() == 1


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: aipo_loss(rho=0.0), "rho=0.0 must be > 0"),
        (lambda: aipo_loss(rho=-1.0), "rho=-1.0"),
        (lambda: ppo_clip_loss(clip_eps=1.5), "clip_eps=1.5"),
    ],
)
def test_bad_hyperparameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_group_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, normalize_std=False)
    torch.testing.assert_close(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.all(adv[1] == 0)  # all equal: no signal
    torch.testing.assert_close(adv[2], torch.tensor([2.25, -0.75, -0.75, -0.75]))
    norm = group_advantages(rewards)
    std0 = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # unbiased, as torch.std
    torch.testing.assert_close(norm[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std0)
    assert torch.all(norm[1] == 0)
    with pytest.raises(ValueError, match=r"\[groups, samples>=2\]"):
        group_advantages(torch.ones(4, 1))


def test_token_advantages_follow_the_mask():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    got = token_advantages(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(got, torch.tensor([[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, -1.0, 0.0]]))


def test_loss_from_composed_config():
    from rl.algorithms.losses import loss_from_config
    from rl.config import compose

    lp, mb = _batch()
    aipo = loss_from_config(compose(["algorithm.rho=1.5"]).algorithm)(lp, mb)
    assert aipo.loss_sum.item() == pytest.approx(aipo_loss(1.5)(lp, mb).loss_sum.item())
    grpo = loss_from_config(compose(["algorithm=grpo"]).algorithm)(lp, mb)
    assert grpo.loss_sum.item() == pytest.approx(ppo_clip_loss(0.2)(lp, mb).loss_sum.item())
