"""Sample reuse: several optimizer steps per RL batch (PPO's epochs and minibatches).

``algorithm.epochs`` passes over the batch, each cut into ``algorithm.minibatches`` equal
minibatches, one optimizer step each. The rows are shuffled afresh every epoch from the
run's seed and the step number, so every rank cuts the same minibatches, and a resumed
run the same ones as the uninterrupted run.

With more than one update the trainer scores the batch once before the first one: those
are pi_old's log-probs (rl.batch.TrainBatch.old_logprobs). The losses keep their ratio
against the behaviour policy mu that sampled the tokens, so the clip and the correction
bound the whole move from mu (the lag plus this batch's updates) and, from the second
update on, act on a policy that really moved. pi_old only splits what is logged:
``mismatch_abs_logp`` |log pi_old - log mu| is the train/rollout mismatch (lag, numerics)
and ``policy_change_abs_logp`` |log pi - log pi_old| the policy's own move within the
batch.

Pure logic: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Metrics that are not per-token means: how each combines over a batch's updates.
_SUMMED = ("step_seconds", "skipped")
_LAST = ("lr",)


@dataclass(frozen=True)
class Reuse:
    epochs: int = 1
    minibatches: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "minibatches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"algorithm.{name}={v!r} must be an integer >= 1")

    @property
    def updates(self) -> int:
        """Optimizer steps per RL batch."""
        return self.epochs * self.minibatches

    def minibatch_rows(self, rows: int, step: int) -> list[torch.Tensor]:
        """The row indices of each update of RL step ``step``, in order: ``epochs`` times
        a fresh permutation of ``range(rows)`` cut into ``minibatches`` equal parts (one
        update, unshuffled: every row once)."""
        if rows % self.minibatches:
            raise ValueError(
                f"a batch of {rows} rows does not split into algorithm.minibatches="
                f"{self.minibatches} equal minibatches"
            )
        if self.updates == 1:
            return [torch.arange(rows)]
        out: list[torch.Tensor] = []
        for epoch in range(self.epochs):
            g = torch.Generator().manual_seed(_mix(self.seed, step, epoch))
            out.extend(torch.randperm(rows, generator=g).chunk(self.minibatches))
        return out


def _mix(*parts: int) -> int:
    """One 63-bit seed from several integers (FNV-style mixing: the same on every rank and
    every Python, and neighbouring steps get unrelated permutations)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = ((x ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return x >> 1


def combine(updates: list[dict[str, float]], epochs: int = 1) -> dict[str, float]:
    """One RL step's metrics from its updates' (each a MegatronTrainer.train_step result): the
    loss statistics averaged over every trained token (``seq_`` ones: sequence) of every update,
    time and skipped updates summed, the last learning rate, the rest (grad norm, MoE load)
    averaged over updates; plus ``updates``. ``num_tokens`` is what one of the ``epochs`` passes
    over the batch trains on, ``tokens_per_s`` counts every pass."""
    if not updates:
        raise ValueError("no updates to combine")
    if len(updates) == 1:
        return {**updates[0], "updates": 1.0}
    ntok = [u["num_tokens"] for u in updates]
    nseq = [u.get("num_seqs", 1.0) for u in updates]
    total = sum(ntok)
    out: dict[str, float] = {}
    per_token = _per_token_keys(updates[0])
    for k in updates[0]:
        vals = [u[k] for u in updates]
        if k in _SUMMED:
            out[k] = sum(vals)
        elif k in _LAST:
            out[k] = vals[-1]
        elif k in per_token and k.startswith("seq_"):  # a per-sequence mean
            out[k] = sum(v * n for v, n in zip(vals, nseq, strict=True)) / sum(nseq)
        elif k in per_token:
            out[k] = sum(v * n for v, n in zip(vals, ntok, strict=True)) / total
        else:
            out[k] = sum(vals) / len(vals)
    seconds = max(out["step_seconds"], 1e-9)
    out["tokens_per_s"] = sum(u["tokens_per_s"] * u["step_seconds"] for u in updates) / seconds
    out["num_tokens"] = total / epochs
    if "num_seqs" in out:
        out["num_seqs"] = sum(nseq) / epochs
    out["updates"] = float(len(updates))
    return out


def _per_token_keys(first: dict[str, float]) -> set[str]:
    """The loss statistics: everything train_step reports that is not its own bookkeeping
    (these are means over the update's tokens)."""
    own = {"grad_norm", "lr", "num_tokens", "num_seqs", "step_seconds", "skipped",
           "tokens_per_s"}  # fmt: skip
    return {k for k in first if k not in own and not k.startswith("moe_")}
