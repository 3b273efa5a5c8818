"""PPO with a critic (``critic=tiny algorithm/advantage=gae``) as a user runs it: real
SGLang, the critic on a rank of its own.

Two runs of one job in one run directory, in order:

1. three RL steps: every step logs the critic's figures; the advantages the trainer logged
   (unwhitened here) are GAE's formula, written out below, applied to the values and
   rewards of the batch the job saved (``rl.save_batches``); the critic's checkpoint sits
   beside the policy's and the resume point names it;
2. the job resumed: the critic's LR ramp goes on where it stopped (its optimizer and
   schedule were loaded); then its rank is SIGKILLed and the job fails within seconds in
   one line naming "critic rank 0", leaving no process behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.procs import TaggedJob, assert_tagged_gone, state_step

TAG = "MSRL_TEST_CRITIC"
ARGS = [
    "critic=tiny", "algorithm/advantage=gae", "algorithm.group_size=1",
    "algorithm.advantage.whiten=false", "sft.steps=5", "sft.eval_every=5",
    "task.eval_size=16", "rl.prompts_per_step=64", "rl.eval_every=0", "rl.save_interval=1",
    "rl.save_batches=true",
]  # fmt: skip
GAMMA, LAM = 1.0, 0.95  # gae's defaults
STOP_S = 10.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("critic") / "run"


def _rl_records(out: Path) -> list[dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in recs if r["phase"] == "rl"]


def gae_by_hand(rewards: list[float], values: list[list[float]], mask: list[list[float]]):
    """Every masked token's advantage, row by row, from the last one back:
    ``delta = r + GAMMA * V_next - V``, ``A = delta + GAMMA * LAM * A_next``, the reward
    on a row's last masked token only."""
    out = []
    for r, v, m in zip(rewards, values, mask, strict=True):
        at = [t for t, x in enumerate(m) if x > 0]
        adv, next_v, next_a = [], 0.0, 0.0
        for i, t in enumerate(reversed(at)):
            reward = r if i == 0 else 0.0
            a = reward + GAMMA * next_v - v[t] + GAMMA * LAM * next_a
            adv.append(a)
            next_v, next_a = v[t], a
        out.extend(adv)
    return out


def test_1_the_critic_trains_beside_the_policy_and_gae_uses_its_values(run_dir):
    job = TaggedJob(run_dir, [*ARGS, "rl.steps=3"], TAG)
    job.ended(600)
    assert job.proc.returncode == 0, "\n".join(job.err[-40:])
    recs = _rl_records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for k in ("critic_loss", "critic_value_mean", "critic_grad_norm", "critic_values_s"):
            assert k in r, k
    lrs = [r["critic_lr"] for r in recs]
    assert lrs == sorted(lrs) and lrs[0] < lrs[-1]  # its own warm-up ramp
    for r in recs:
        b = torch.load(run_dir / "batches" / f"step_{r['step']:06d}.pt")
        mask, values = b["loss_mask"], b["values"]
        assert values.abs().sum() > 0 and (values * (1 - mask)).abs().sum() == 0
        adv = torch.tensor(gae_by_hand(b["rewards"].tolist(), values.tolist(), mask.tolist()))
        assert r["adv_mean"] == pytest.approx(adv.double().mean().item(), abs=1e-5)
        assert r["adv_std"] == pytest.approx(adv.double().std().item(), abs=1e-5)
    state = json.loads((run_dir / "rl_state.json").read_text())
    assert state["companions"] == [str(run_dir / "checkpoint_critic")]
    assert (run_dir / "checkpoint_critic" / "metadata.json").is_file()


def test_2_a_resumed_critic_goes_on_and_its_killed_rank_ends_the_job(run_dir):
    assert state_step(run_dir) == 3, "the first test leaves step 3's checkpoint"
    job = TaggedJob(run_dir, [*ARGS, "rl.steps=200"], TAG)
    job.wait_for(lambda: state_step(run_dir) >= 4, "a first checkpoint after the resume")
    recs = {r["step"]: r for r in _rl_records(run_dir)}
    assert recs[4]["critic_lr"] > recs[3]["critic_lr"]  # the ramp resumed, not restarted
    job.rank("msrl:critic:0").kill()
    job.ended(STOP_S)
    assert job.proc.returncode == 1, "\n".join(job.err[-40:])
    first = next(i for i, x in enumerate(job.err) if x.startswith("error: "))
    assert job.err[first] == "error: critic rank 0 was killed by SIGKILL (exited with code -9)"
    assert not any("Traceback" in x for x in job.err), "\n".join(job.err)
    assert_tagged_gone(TAG, job.tag)
