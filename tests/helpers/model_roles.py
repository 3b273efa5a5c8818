"""References for a job's model roles: a reward model and a teacher made for a test, and
what transformers (and GAE written out) say their figures must be.

The reward model is a smaller decoder than the policy (2 layers of 64), trained for a few
steps by ``tools/train_reward_model.py`` on the arithmetic task's pairs, from a random
decoder that shares the policy's character vocabulary. The teacher is a random Qwen3 (2
layers of 64: another family and size than the Llama policy) with that vocabulary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers.hf_models import make_model

ROOT = Path(__file__).resolve().parents[2]
TINY = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2}
GAMMA, LAM = 1.0, 0.95  # gae's defaults


def make_reward_model(root: Path) -> Path:
    init = make_model("llama", root / "init", seed=3, extra=TINY)
    subprocess.run(
        [sys.executable, "tools/train_reward_model.py", "--init", str(init), "--out",
         str(root / "rm"), "--arithmetic", "320", "--batch", "32", "--log-every", "5"],
        check=True, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    stats = json.loads((root / "rm" / "reward_stats.json").read_text())
    assert stats["steps"] == 9 and stats["held_out_pairs"] == 32
    return root / "rm"


def make_teacher(root: Path) -> Path:
    return make_model("qwen3", root / "teacher", seed=4, extra=TINY)


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


def gae_by_hand(
    rewards: list[float],
    values: list[list[float]],
    mask: list[list[float]],
    dense: list[list[float]],
) -> list[float]:
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
