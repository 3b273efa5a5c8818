"""Evaluation through the generator and the reward function the training uses.

Every eval prompt is answered greedily (pass@1) and, with ``k`` > 1, sampled ``k`` times
at the rollout temperature (pass@k: any sample passes; mean@k: the mean score). Responses
are scored by the reward ranks with the same function as training rollouts: there is one
scoring path. A response passes when its score reaches ``reward.pass_threshold``.

The greedy responses of each evaluation are written to ``<out>/eval/step_<N>.jsonl``
(prompt and response, ids and text, label and score), to read what the policy says.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rl.config.sampling import SamplingParams
from rl.controller.episodes import EpisodeDriver, conversation, episode_metrics, run_episodes
from rl.generator.types import Rollout
from rl.tasks.common import Example, Task
from rl.tasks.scoring import ScoreItem, ScoreResult

if TYPE_CHECKING:
    from rl.generator.client import GeneratorClient
    from rl.reward.service import RewardHandle


def score_items(task: Task, examples: Sequence[Example], rollouts: Sequence[Rollout]):
    """What the reward function sees of each (prompt, response): for a multi-turn sample
    the response is its final answer, and the metadata carries the whole conversation."""
    items = []
    for e, r in zip(examples, rollouts, strict=True):
        turns = conversation(r)
        if turns is None:
            items.append(ScoreItem(e.prompt_text, task.codec.response_text(r.output_ids),
                                   e.label, dict(e.metadata)))  # fmt: skip
        else:
            items.append(ScoreItem(e.prompt_text, turns[0], e.label, {**e.metadata, **turns[1]}))
    return items


class Evaluator:
    def __init__(
        self,
        client: GeneratorClient,
        task: Task,
        reward: RewardHandle,
        sampling: SamplingParams,
        *,
        k: int = 1,
        threshold: float = 1.0,
        samples_dir: Path | None = None,
        episodes: EpisodeDriver | None = None,
    ):
        """``sampling``: the rollouts' (temperature, max_new_tokens, stop ids); greedy
        decoding replaces its temperature for pass@1. ``episodes``: multi-turn, each
        sample played to the end of its episode."""
        self.client, self.task, self.reward = client, task, reward
        self.episodes = episodes
        self.k, self.threshold, self.samples_dir = k, threshold, samples_dir
        self.greedy = replace(sampling, temperature=0.0, n=1, seed=None)
        self.sampled = replace(sampling, n=k)
        self._outs: list[Rollout] = []  # the samples of one eval set

    def _scores(
        self, examples: list[Example], sampling: SamplingParams, samples: Path | None = None
    ) -> list[list[ScoreResult]]:
        if self.episodes is not None:
            outs = run_episodes(self.client, self.episodes, examples, sampling)
        else:
            outs = self.client.generate([list(e.prompt_ids) for e in examples], sampling,
                                        images=[e.images for e in examples])  # fmt: skip
        per = sampling.n
        items = score_items(self.task, [e for e in examples for _ in range(per)], outs)
        results = self.reward.score(items).result()
        self._outs += outs
        if samples is not None:
            samples.parent.mkdir(parents=True, exist_ok=True)
            with samples.open("w") as f:
                for e, r, it, res in zip(examples, outs, items, results, strict=True):
                    rec = {"uid": e.uid, "prompt": e.prompt_text, "response": it.response,
                           "label": e.label, "score": res.score, "prompt_ids": list(e.prompt_ids),
                           "output_ids": r.output_ids, "server": r.server}  # fmt: skip
                    if r.episode:  # the conversation, and where the observations sit
                        rec.update(episode=r.episode, observed=r.observed)
                    f.write(json.dumps(rec, default=str) + "\n")
        return [results[i * per : (i + 1) * per] for i in range(len(examples))]

    def run(self, step: int = 0) -> dict[str, float]:
        out: dict[str, float] = {}
        if not self.task.eval_sets:  # nothing held out: nothing to measure
            return {"eval_accuracy": float("nan")}
        for n, (name, examples) in enumerate(self.task.eval_sets.items()):
            pre = "eval_" if n == 0 else f"eval_{name}_"
            self._outs = []
            where = self.samples_dir
            file = where / f"{name}_step_{step:06d}.jsonl" if where else None
            greedy = self._scores(examples, self.greedy, file)
            out[f"{pre}accuracy"] = _mean(float(g[0].score >= self.threshold) for g in greedy)
            out[f"{pre}score"] = _mean(g[0].score for g in greedy)
            for k in dict.fromkeys(k for g in greedy for k in g[0].metrics):  # the function's
                out[f"{pre}reward_{k}"] = _mean(g[0].metrics[k] for g in greedy
                                                if k in g[0].metrics)  # fmt: skip
            if self.k > 1:
                sampled = self._scores(examples, self.sampled)
                passed = [any(s.score >= self.threshold for s in g) for g in sampled]
                out[f"{pre}pass@{self.k}"] = _mean(map(float, passed))
                out[f"{pre}mean@{self.k}"] = _mean(s.score for g in sampled for s in g)
            lengths = [float(len(r.output_ids)) for r in self._outs]
            out[f"{pre}response_len_mean"] = _mean(lengths)
            out[f"{pre}response_len_max"] = max(lengths)
            out[f"{pre}overlong_frac"] = _mean(float(r.finish_reason == "length")
                                               for r in self._outs)  # fmt: skip
            out.update({f"{pre}{k}": v for k, v in episode_metrics(self._outs).items()})
        return out


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else float("nan")
