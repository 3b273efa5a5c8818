"""The model executors as a user runs them: PPO with a critic (``critic=tiny
algorithm/advantage=gae``), a reward model (``reward_model=cpu``, weighed with the rule's
reward by ``reward.combine``) and a teacher (``teacher=cpu algorithm.distill_coef``), each
on a rank of its own, with real SGLang.

The reward model is a smaller decoder than the policy (2 layers of 64), trained for a few
steps by ``tools/train_reward_model.py`` on the arithmetic task's pairs, from a random
decoder that shares the policy's character vocabulary. The teacher is a random Qwen3 (2
layers of 64: another family and size than the Llama policy) with that vocabulary.

Two runs of one job in one run directory, in order:

1. three RL steps: every step logs the critic's and the reward model's figures; every
   sample's reward is its rule score plus 0.5 times transformers' score of its sequence
   (``AutoModelForSequenceClassification``'s own pooling); the teacher's log-prob of every sampled
   token is transformers' (``AutoModelForCausalLM``); the advantages the trainer logged
   (unwhitened here) are GAE's formula, written out below, applied to the values and
   rewards of the batch the job saved (``rl.save_batches``), plus the distillation term
   ``coef * (log pi_teacher - log mu)``; the critic's checkpoint sits beside the policy's
   and the resume point names it;
2. the job resumed: the critic's LR ramp goes on where it stopped (its optimizer and
   schedule were loaded); then its rank is SIGKILLed and the job fails within seconds in
   one line naming "critic rank 0", leaving no process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.hf_models import make_model
from tests.helpers.procs import ROOT, TaggedJob, assert_tagged_gone, state_step

TAG = "MSRL_TEST_CRITIC"
ARGS = [
    "critic=tiny", "algorithm/advantage=gae", "algorithm.group_size=1",
    "algorithm.advantage.whiten=false", "sft.steps=5", "sft.eval_every=5",
    "task.eval_size=16", "rl.prompts_per_step=64", "rl.eval_every=0", "rl.save_interval=1",
    "rl.save_batches=true", "reward_model=cpu", "reward_model.normalize=none",
    "reward.combine.rule=1", "reward.combine.model=0.5", "teacher=cpu",
    "algorithm.distill_coef=0.1", "critic.epochs=2", "critic.minibatches=2",
    "critic.trainer.micro_batch_size=32",
]  # fmt: skip
W_MODEL, DISTILL = 0.5, 0.1
TINY = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2}
GAMMA, LAM = 1.0, 0.95  # gae's defaults
STOP_S = 10.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("critic") / "run"


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rm")
    init = make_model("llama", root / "init", seed=3, extra=TINY)
    subprocess.run(
        [sys.executable, "tools/train_reward_model.py", "--init", str(init), "--out",
         str(root / "rm"), "--arithmetic", "320", "--batch", "32", "--log-every", "5"],
        check=True, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    stats = json.loads((root / "rm" / "reward_stats.json").read_text())
    assert stats["steps"] == 9 and stats["held_out_pairs"] == 32
    return root / "rm"


@pytest.fixture(scope="module")
def models(tmp_path_factory, reward_model) -> list[str]:
    """The job's overrides naming the reward model and the teacher."""
    teacher = make_model("qwen3", tmp_path_factory.mktemp("teacher") / "hf", seed=4, extra=TINY)
    return [f"reward_model.hf_checkpoint={reward_model}", f"teacher.hf_checkpoint={teacher}"]


def hf_logprobs(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' log-prob of each next token (index t scores token t+1), ``[B, S]``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    out = torch.zeros(tokens.shape)
    out[:, :-1] = logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    return out


def hf_sequence_scores(path: Path, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' own score of each row's prompt and response (which ends one token
    after the last masked position), fed alone: ``AutoModelForSequenceClassification``'s
    logit, at the rightmost token that is not the model's pad id (0, the task's PAD, which
    a barely warmed-up policy samples, also as a response's last token)."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    assert model.config.pad_token_id == 0
    lengths = [int(m.nonzero().max()) + 2 for m in mask]
    with torch.no_grad():
        return torch.cat([model(tokens[i : i + 1, :n]).logits[:, 0]
                          for i, n in enumerate(lengths)])  # fmt: skip


def _rl_records(out: Path) -> list[dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in recs if r["phase"] == "rl"]


def gae_by_hand(
    rewards: list[float],
    values: list[list[float]],
    mask: list[list[float]],
    dense: list[list[float]],
):
    """Every masked token's advantage, row by row, from the last one back:
    ``delta = r + GAMMA * V_next - V``, ``A = delta + GAMMA * LAM * A_next``, the reward
    on a row's last masked token only; then each token's ``dense`` term added."""
    out = []
    for r, v, m, d in zip(rewards, values, mask, dense, strict=True):
        at = [t for t, x in enumerate(m) if x > 0]
        adv, next_v, next_a = [], 0.0, 0.0
        for i, t in enumerate(reversed(at)):
            reward = r if i == 0 else 0.0
            a = reward + GAMMA * next_v - v[t] + GAMMA * LAM * next_a
            adv.append(a + d[t])
            next_v, next_a = v[t], a
        out.extend(adv)
    return out


def test_1_the_critic_trains_beside_the_policy_and_gae_uses_its_values(
    run_dir, reward_model, models
):
    job = TaggedJob(run_dir, [*ARGS, *models, "rl.steps=3"], TAG)
    job.ended(600)
    assert job.proc.returncode == 0, "\n".join(job.err[-40:])
    recs = _rl_records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for k in ("critic_loss", "critic_value_mean", "critic_grad_norm", "critic_values_s",
                  "reward_model_mean", "reward_model_std", "reward_rule", "teacher_logprobs_s",
                  "reward_model_s", "critic_step_seconds",
                  "adv_distill_kl"):  # fmt: skip
            assert k in r, k
        assert r["reward_model_all_pad"] == 0  # every sample has a BOS to score
    assert all(r["critic_updates"] == 4 for r in recs)  # 2 epochs of 2 minibatches
    assert all(r["critic_lag"] == 1 for r in recs)  # values from the critic one step behind
    lrs = [r["critic_lr"] for r in recs]
    assert lrs == sorted(lrs) and lrs[0] < lrs[-1]  # its own warm-up ramp
    for r in recs:
        b = torch.load(run_dir / "batches" / f"step_{r['step']:06d}.pt")
        mask, values = b["loss_mask"], b["values"]
        assert values.abs().sum() > 0 and (values * (1 - mask)).abs().sum() == 0
        model = hf_sequence_scores(reward_model, b["tokens"], mask)
        rule = b["rewards"] - W_MODEL * model
        assert ((rule - rule.round()).abs() < 1e-4).all(), rule  # 0 or 1, plus the model's
        assert set(rule.round().tolist()) <= {0.0, 1.0}
        assert r["reward_model_mean"] == pytest.approx(model.double().mean().item(), abs=1e-4)
        assert r["reward_rule"] == pytest.approx(rule.round().mean().item(), abs=1e-6)
        teacher = hf_logprobs(Path(models[1].split("=", 1)[1]), b["tokens"]) * mask
        assert (b["teacher_logprobs"] - teacher).abs().max() < 1e-4
        dense = DISTILL * (b["teacher_logprobs"] - b["behaviour_logprobs"])
        adv = torch.tensor(gae_by_hand(b["rewards"].tolist(), values.tolist(), mask.tolist(),
                                       dense.tolist()))  # fmt: skip

        assert r["adv_mean"] == pytest.approx(adv.double().mean().item(), abs=1e-5)
        assert r["adv_std"] == pytest.approx(adv.double().std().item(), abs=1e-5)
    state = json.loads((run_dir / "rl_state.json").read_text())
    assert state["companions"] == [str(run_dir / "checkpoint_critic")]
    assert (run_dir / "checkpoint_critic" / "metadata.json").is_file()


def test_2_a_resumed_critic_goes_on_and_its_killed_rank_ends_the_job(run_dir, models):
    assert state_step(run_dir) == 3, "the first test leaves step 3's checkpoint"
    job = TaggedJob(run_dir, [*ARGS, *models, "rl.steps=200"], TAG)
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
