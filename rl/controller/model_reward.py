"""Rewards from a reward model (``reward.fn=model`` or ``reward.combine``), beside the rule's.

A group's samples go to the reward model (rl/companion/reward_model.py) as one batch, on a
thread of this module's own, while its rule scores come from the reward ranks and the
generator keeps generating: scoring is off the step's critical path as the rule's is. A
sample's trained reward is the weighted sum of the rule's score and the model's normalised
score; both stay in its metrics (``rule``, ``model``), and the held-out evaluation and the
logged accuracy are the rule's alone.

The model's score of a sample is its value where the checkpoint's own class pools it: its
rightmost token that is not the checkpoint's ``pad_token_id``
(:func:`~rl.companion.reward_model.scored_positions`). A sample of pad ids only scores 0
and is counted (:attr:`ModelReward.all_pad`, logged ``reward_model_all_pad``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

import torch

from rl.batch import TrainBatch
from rl.companion.reward_model import Normaliser, scored_positions, sequence_scores
from rl.tasks.scoring import ScoreResult
from rl.threads import thread_pool

if TYPE_CHECKING:
    from rl.companion.service import CompanionHandle
    from rl.generator.types import Rollout

A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")


class ModelReward:
    """:meth:`score` a group: its rule scores (a future) combined with the model's."""

    def __init__(
        self,
        handle: CompanionHandle,
        norm: Normaliser,
        weights: dict[str, float],
        *,
        pad_id: int,
        pad_token_id: int | None,
        rows_multiple: int = 1,
    ):
        """``pad_id``: the batch's right padding (the policy's; never scored);
        ``pad_token_id``: the reward model's own (its config's), which its pooling skips;
        ``rows_multiple``: the model's batches are padded with empty rows to a multiple of
        it (its micro-batch rows times its DP size)."""
        self.handle, self.norm, self.weights, self.pad_id = handle, norm, weights, pad_id
        self.pad_token_id, self.rows_multiple = pad_token_id, rows_multiple
        self.all_pad = 0  # samples of the model's pad id only (scored 0); the run's total
        self._pool = thread_pool("reward-model", 1)

    def scores(self, rollouts: Sequence[Rollout]) -> tuple[list[float], float]:
        """The model's raw score of each (prompt + response), and the seconds it took."""
        seqs = [[*r.prompt_ids, *r.output_ids] for r in rollouts]
        width, rows = max(len(s) for s in seqs), -(-len(seqs) // self.rows_multiple)
        tokens = torch.full((rows * self.rows_multiple, width), self.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        at = scored_positions(seqs, self.pad_token_id)
        self.all_pad += at.count(None)  # this thread alone writes it
        t0 = time.perf_counter()
        values = self.handle.forward(TrainBatch(tokens))
        return sequence_scores(values, at), time.perf_counter() - t0

    def score(
        self, rollouts: Sequence[Rollout], rule: Future[list[ScoreResult]]
    ) -> Future[list[ScoreResult]]:
        model = self._pool.submit(self.scores, list(rollouts))
        return _both(rule, model, self._combine)

    def _combine(
        self, rule: list[ScoreResult], model: tuple[list[float], float]
    ) -> list[ScoreResult]:
        w_rule, w_model = self.weights.get("rule", 0.0), self.weights.get("model", 0.0)
        raws, seconds = model
        out = []
        for r, raw in zip(rule, raws, strict=True):
            s = self.norm(raw)
            # model_s: the group's forward on the reward model (logged reward_model_s).
            metrics = {**r.metrics, "rule": r.score, "model": s, "model_raw": raw,
                       "model_s": seconds}  # fmt: skip
            out.append(ScoreResult(w_rule * r.score + w_model * s, metrics, r.failed))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _both(a: Future[A], b: Future[B], fn: Callable[[A, B], C]) -> Future[C]:
    """A future of ``fn(a.result(), b.result())``, or of the first exception."""
    out: Future[C] = Future()
    lock = threading.Lock()

    def done(_: object) -> None:
        with lock:
            if out.done() or not (a.done() and b.done()):
                return
            try:
                out.set_result(fn(a.result(), b.result()))
            except BaseException as e:
                out.set_exception(e)

    a.add_done_callback(done)
    b.add_done_callback(done)
    return out
