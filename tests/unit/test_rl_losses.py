"""RL losses and advantages against hand-computed values (milliseconds, pure logic).

One sequence of three scored tokens (the last position never counts): log pi =
[-1, -2, -0.5], log mu = [-1.5, -0.5, -0.5], advantages [2, 2, -1]. Ratios pi/mu are
e^0.5 = 1.6487, e^-1.5 = 0.2231 and 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl.algorithms.advantages.grpo import GrpoConfig, group_advantages
from rl.algorithms.corrections.aipo import aipo_weight
from rl.algorithms.corrections.icepop import icepop_weight
from rl.algorithms.corrections.none import no_weight
from rl.algorithms.corrections.tis import tis_weight
from rl.algorithms.estimator import per_sequence
from rl.algorithms.losses import LossFn, pg_loss, ppo_clip_loss
from rl.algorithms.registry import corrections, loss_from_config, objectives
from rl.batch import TrainBatch
from rl.config.schema import AlgorithmConfig, CorrectionConfig

R0, R1 = math.exp(0.5), math.exp(-1.5)


def alg(
    correction: str = "aipo", objective: str = "pg", kl_coef: float = 0.0, **fields: float
) -> AlgorithmConfig:
    """The algorithm config that ``algorithm/objective=<objective>`` and
    ``algorithm/correction=<correction>`` compose, the correction's own ``fields`` set (an
    unknown name keeps the base config, as a hand-set ``name`` would)."""
    known = corrections().get(correction)
    chosen = known.config(**fields) if known else CorrectionConfig(name=correction)
    return AlgorithmConfig(objectives()[objective].config(), chosen, GrpoConfig(), kl_coef=kl_coef)


def aipo_loss(rho: float = 4.0, kl_coef: float = 0.0) -> LossFn:
    """AIPO (LlamaRL): ``-stopgrad(min(pi/mu, rho)) * A * log pi`` per token, as
    ``algorithm=aipo`` builds it."""
    return pg_loss(aipo_weight(rho), kl_coef)


def _mb(**fields: torch.Tensor) -> TrainBatch:
    """A microbatch of these fields (the losses never read its tokens)."""
    return TrainBatch(torch.zeros_like(fields["loss_mask"], dtype=torch.long), **fields)


def _batch(ref: list[float] | None = None):
    lp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], requires_grad=True)
    mb = _mb(
        loss_mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        behaviour_logprobs=torch.tensor([[-1.5, -0.5, -0.5, 0.0]]),
        advantages=torch.tensor([[2.0, 2.0, -1.0, 0.0]]),
    )
    if ref is not None:
        mb.ref_logprobs = torch.tensor([[*ref, 0.0]])
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
    assert out.stats["truncated_frac"].item() == 1  # t0: the clip took its gradient
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
    mb.advantages[0, 3] = 100.0
    mb.behaviour_logprobs[0, 3] = -50.0
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
    got = per_sequence(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(got, torch.tensor([[0.0, 2.0, 2.0, 0.0], [0.0, 0.0, -1.0, 0.0]]))


def test_loss_from_composed_config():
    from tests.helpers.configs import composed

    lp, mb = _batch()
    aipo = loss_from_config(composed(["algorithm.correction.rho=1.5"]).algorithm)(lp, mb)
    assert aipo.loss_sum.item() == pytest.approx(aipo_loss(1.5)(lp, mb).loss_sum.item())
    grpo_cfg = composed(["algorithm=grpo"]).algorithm
    grpo = loss_from_config(grpo_cfg)(lp, mb)
    assert grpo.loss_sum.item() == pytest.approx(ppo_clip_loss(0.2)(lp, mb).loss_sum.item())


# ------------------------------------------------------------ off-policy corrections
# Four scored tokens and one masked position with a wild ratio (it must change nothing):
# log pi = [-1, -2, -0.5, -1], log mu = [-1.5, -0.5, -0.5, -2], A = [2, 2, -1, -3], so
# r = pi/mu = [e^0.5 = 1.6487, e^-1.5 = 0.2231, 1, e^1 = 2.7183] and, for w = 1, the
# per-token -A * log pi = [2, 4, -0.5, -3]. Masked position: log pi 0, log mu -5 (r = e^5).
IS_RATIO4 = math.exp(0.5) + math.exp(-1.5) + 1 + math.e  # 5.5901
MISMATCH4 = 0.5 + 1.5 + 0.0 + 1.0


def _batch4(ref: list[float] | None = None):
    lp = torch.tensor([[-1.0, -2.0, -0.5, -1.0, 0.0]], requires_grad=True)
    mb = _mb(
        loss_mask=torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]),
        behaviour_logprobs=torch.tensor([[-1.5, -0.5, -0.5, -2.0, -5.0]]),
        advantages=torch.tensor([[2.0, 2.0, -1.0, -3.0, 7.0]]),
    )
    if ref is not None:
        mb.ref_logprobs = torch.tensor([[*ref, 0.0]])
    return lp, mb


def _run(a: AlgorithmConfig, ref: list[float] | None = None):
    lp, mb = _batch4(ref)
    out = loss_from_config(a)(lp, mb)
    out.loss_sum.backward()
    return out, lp.grad


def _close(t: torch.Tensor, want: list[float]):
    torch.testing.assert_close(t, torch.tensor([want]), rtol=1e-5, atol=1e-6)


def test_correction_aipo_on_four_tokens():
    out, grad = _run(alg("aipo", rho=1.5))
    # w = min(r, 1.5) = [1.5, e^-1.5, 1, 1.5]; -w*A*log pi = [3, 4e^-1.5 = 0.8925, -0.5, -4.5]
    assert out.loss_sum.item() == pytest.approx(-1.1074794, rel=1e-6)
    _close(grad, [-3.0, -0.4462603, 1.0, 4.5, 0.0])  # -w*A; -2e^-1.5 = -0.44626
    assert out.num_tokens.item() == 4
    assert out.stats["truncated_frac"].item() == 2  # t0 and t3 above rho; not the masked one
    assert out.stats["is_ratio"].item() == pytest.approx(IS_RATIO4, rel=1e-6)
    assert out.stats["mismatch_abs_logp"].item() == pytest.approx(MISMATCH4, rel=1e-6)
    assert "masked_frac" not in out.stats


def test_correction_tis_clips_both_sides():
    out, grad = _run(alg("tis", clip=2.0, clip_low=0.5))
    # w = clamp(r, 0.5, 2) = [e^0.5, 0.5 (raised), 1, 2 (cut)];
    # -w*A*log pi = [2e^0.5 = 3.29744, 2, -0.5, -6] -> 2e^0.5 - 4.5 = -1.2025575
    assert out.loss_sum.item() == pytest.approx(-1.2025575, rel=1e-6)
    _close(grad, [-3.2974425, -1.0, 1.0, 6.0, 0.0])  # -w*A
    assert out.num_tokens.item() == 4
    assert out.stats["truncated_frac"].item() == 2  # t1 below, t3 above
    assert out.stats["is_ratio"].item() == pytest.approx(IS_RATIO4, rel=1e-6)
    assert out.stats["mismatch_abs_logp"].item() == pytest.approx(MISMATCH4, rel=1e-6)


def test_correction_tis_default_low_clip_only_cuts_above():
    out, grad = _run(alg("tis"))  # clip=2, clip_low=0
    # w = [e^0.5, e^-1.5, 1, 2]: 2e^0.5 + 4e^-1.5 - 0.5 - 6 = -2.3100368
    assert out.loss_sum.item() == pytest.approx(-2.3100368, rel=1e-6)
    _close(grad, [-3.2974425, -0.4462603, 1.0, 6.0, 0.0])
    assert out.stats["truncated_frac"].item() == 1


def test_correction_icepop_masks_tokens_outside_the_band():
    out, grad = _run(alg("icepop", beta=2.0))
    # band [0.5, 2]: t1 (0.2231) and t3 (2.7183) are masked, w = [e^0.5, 0, 1, 0];
    # -w*A*log pi = [2e^0.5, 0, -0.5, 0] -> 2e^0.5 - 0.5 = 2.7974425
    assert out.loss_sum.item() == pytest.approx(2.7974425, rel=1e-6)
    _close(grad, [-3.2974425, 0.0, 1.0, 0.0, 0.0])
    assert out.num_tokens.item() == 4  # masked tokens still count in the normalisation
    assert out.stats["masked_frac"].item() == 2  # not the loss-masked position (r = e^5)
    assert "truncated_frac" not in out.stats
    assert out.stats["is_ratio"].item() == pytest.approx(IS_RATIO4, rel=1e-6)


def test_correction_icepop_masks_the_kl_term_too():
    out, grad = _run(
        alg("icepop", kl_coef=0.1, beta=2.0),
        ref=[-1.0, -1.0, -1.0, -1.0],
    )
    # k3 with d = ref - log pi = [0, 1, -0.5, 0]: [0, e-2, e^-0.5-0.5, 0]; d k3/d log pi =
    # 1 - e^d = [0, 1-e, 1-e^-0.5, 0]. t1 is masked, so its KL gradient (0.1(1-e)) is gone:
    # grad t2 = 1 + 0.1(1 - e^-0.5) = 1.0393469; loss = 2e^0.5 - 0.5 + 0.1(e^-0.5 - 0.5).
    assert out.loss_sum.item() == pytest.approx(2.8080956, rel=1e-6)
    _close(grad, [-3.2974425, 0.0, 1.0393469, 0.0, 0.0])
    # kl_ref still measures every counted token: (e-2) + (e^-0.5-0.5) = 0.8248125
    assert out.stats["kl_ref"].item() == pytest.approx(0.8248125, rel=1e-6)


def test_correction_none_is_the_plain_policy_gradient():
    out, grad = _run(alg("none"))
    # w = 1: -A*log pi = [2, 4, -0.5, -3] -> 2.5
    assert out.loss_sum.item() == pytest.approx(2.5, rel=1e-6)
    _close(grad, [-2.0, -2.0, 1.0, 3.0, 0.0])  # -A
    assert out.stats["is_ratio"].item() == pytest.approx(IS_RATIO4, rel=1e-6)
    assert "truncated_frac" not in out.stats and "masked_frac" not in out.stats


def test_none_and_aipo_agree_only_on_policy():
    lp, mb = _batch4()
    none, aipo = pg_loss(no_weight()), aipo_loss(rho=4.0)
    assert none(lp, mb).loss_sum.item() != pytest.approx(aipo(lp, mb).loss_sum.item())
    mb.behaviour_logprobs = lp.detach().clone()  # r == 1 exactly
    grads = []
    for fn in (none, aipo):
        lp.grad = None
        out = fn(lp, mb)
        out.loss_sum.backward()
        grads.append((out.loss_sum.detach(), lp.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_aipo_correction_is_bit_identical_to_the_old_aipo():
    """The pre-refactor formula, inline: the default config must reproduce it exactly."""
    g = torch.Generator().manual_seed(0)
    lp0 = -torch.rand(3, 7, generator=g) * 3
    mu = lp0 + torch.randn(3, 7, generator=g)
    mb = _mb(
        loss_mask=(torch.rand(3, 7, generator=g) > 0.3).float(),
        behaviour_logprobs=mu,
        advantages=torch.randn(3, 7, generator=g),
    )
    lp_old = lp0.clone().requires_grad_()
    w = torch.clamp(torch.exp((lp_old - mu).detach()), max=1.5)
    old = (-(w * mb.advantages * lp_old) * mb.loss_mask).sum()
    old.backward()
    lp_new = lp0.clone().requires_grad_()
    new = loss_from_config(alg(rho=1.5))(lp_new, mb)
    new.loss_sum.backward()
    assert torch.equal(new.loss_sum.detach(), old.detach())
    assert torch.equal(lp_new.grad, lp_old.grad)
    want_truncated = ((torch.exp(lp0 - mu) > 1.5).float() * mb.loss_mask).sum()
    assert torch.equal(new.stats["truncated_frac"], want_truncated)


@pytest.mark.parametrize("correction", ["aipo", "tis", "icepop"])
def test_grpo_refuses_a_correction(correction):
    with pytest.raises(ValueError, match=r"algorithm\.correction='" + correction):
        loss_from_config(alg(correction, "ppo_clip"))
    loss_from_config(alg("none", "ppo_clip"))  # the one allowed


@pytest.mark.parametrize(
    "a,match",
    [
        (alg("tis", clip=0.0), r"algorithm\.correction\.clip=0\.0 must be > 0"),
        (alg("tis", clip_low=-0.1), r"algorithm\.correction\.clip_low=-0\.1"),
        (alg("tis", clip_low=2.0), r"algorithm\.correction\.clip_low=2\.0"),
        (alg("icepop", beta=1.0), r"algorithm\.correction\.beta=1\.0"),
        (alg("aipo", rho=0.0), r"algorithm\.correction\.rho=0\.0"),
        (alg("is"), r"algorithm/correction='is'.*aipo, icepop, none, tis"),
        (
            alg("is", "ppo_clip"),
            r"algorithm/correction='is'.*aipo",
        ),
    ],
)
def test_bad_correction_parameters(a, match):
    with pytest.raises(ValueError, match=match):
        loss_from_config(a)


def test_weight_builders_validate_on_their_own():
    for make in (lambda: tis_weight(-1.0), lambda: icepop_weight(0.5), lambda: aipo_weight(-2)):
        with pytest.raises(ValueError, match="algorithm\\."):
            make()


# ------------------------------------------------------------ sample reuse (pi_old != pi)
# A later update of one batch (algorithm.epochs/minibatches): the generator sampled at
# log mu = log pi_old = -1 for each token, and the first update moved the policy to log pi
# = [-0.5, -1.5, -1]; advantages [1, -1, 1]. Ratios pi/mu: e^0.5 = 1.6487, e^-0.5 =
# 0.6065, 1.
def _moved():
    lp = torch.tensor([[-0.5, -1.5, -1.0, 0.0]], requires_grad=True)
    mb = _mb(
        loss_mask=torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        behaviour_logprobs=torch.tensor([[-1.0, -1.0, -1.0, 0.0]]),
        advantages=torch.tensor([[1.0, -1.0, 1.0, 0.0]]),
        old_logprobs=torch.tensor([[-1.0, -1.0, -1.0, 0.0]]),
    )
    return lp, mb


def test_ppo_clip_acts_once_the_policy_moved_within_the_batch():
    lp, mb = _moved()
    out = ppo_clip_loss(clip_eps=0.2)(lp, mb)
    # t0: min(1.6487*1, 1.2*1) = 1.2 (clipped); t1: min(-0.6065, -0.8) = -0.8 (clipped);
    # t2: ratio 1 -> 1.
    assert out.loss_sum.item() == pytest.approx(-(1.2 - 0.8 + 1.0), rel=1e-6)
    assert out.stats["truncated_frac"].item() == 2
    out.loss_sum.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -1.0, 0.0]]))
    # On policy, nothing of this is mismatch: it is the policy's own move.
    assert out.stats["mismatch_abs_logp"].item() == 0
    assert out.stats["policy_change_abs_logp"].item() == pytest.approx(0.5 + 0.5 + 0.0)


def test_aipo_weight_follows_the_moved_policy():
    lp, mb = _moved()
    out = aipo_loss(rho=1.5)(lp, mb)
    out.loss_sum.backward()
    # w = min(pi/mu, 1.5) = [1.5, e^-0.5, 1], a constant: d/d log pi = -w * A.
    want = torch.tensor([[-1.5, math.exp(-0.5), -1.0, 0.0]])
    torch.testing.assert_close(lp.grad, want)
    assert out.stats["truncated_frac"].item() == 1


def test_mismatch_is_measured_at_pi_old_under_lag():
    """Lagged samples (mu != pi_old) in a later update: mismatch |pi_old - mu|, the
    policy change |pi - pi_old|, and the ratio still pi/mu (the same loss as without
    pi_old)."""
    lp, mb = _batch()  # log pi [-1, -2, -0.5], log mu [-1.5, -0.5, -0.5]
    plain = aipo_loss(rho=1.5)(lp, mb)
    mb.old_logprobs = torch.tensor([[-1.25, -0.5, -0.5, 0.0]])
    out = aipo_loss(rho=1.5)(lp, mb)
    assert out.loss_sum.item() == pytest.approx(plain.loss_sum.item(), rel=1e-6)
    assert out.stats["mismatch_abs_logp"].item() == pytest.approx(0.25)
    assert out.stats["policy_change_abs_logp"].item() == pytest.approx(0.25 + 1.5)
    assert out.stats["is_ratio"].item() == pytest.approx(R0 + R1 + 1.0, rel=1e-6)
