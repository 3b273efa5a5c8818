"""Multi-turn samples in the rollout stream: after each turn, the environment's answer.

A sample of a multi-turn task is one :class:`~rl.generator.types.Rollout` whose output
holds every turn and every observation in order (``Rollout.observe``). When a turn ends
with the end token, the stream hands the sample here instead of to the reward: the
environment reads the conversation in a worker thread (tools may take seconds; the
stream's thread never waits on one) and either answers, and the sample goes back to a
server for its next turn, or ends the episode, and the sample is finished.

The conversation lives in ``Rollout.episode`` (JSON: messages, whether the episode is
over, why, and the tools' counts), so the rollout-state file saves it with the tokens and
a resumed job asks the environment again for a turn it had not answered, regenerating
nothing. The answer is applied by the stream under its lock; the worker never touches the
rollout.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rl.envs.environment import Environment, Message
from rl.envs.tools import close_workers
from rl.generator.types import Rollout
from rl.tasks.common import Example
from rl.threads import thread_pool

if TYPE_CHECKING:
    from rl.config.sampling import SamplingParams
    from rl.envs.setup import EpisodeSetup
    from rl.generator.client import GeneratorClient

JSON = Any  # a JSON value


class Renderer(Protocol):
    """What the driver needs of rl/envs/chat.py's ChatRenderer."""

    def observation_ids(self, before: Sequence[Message], added: Sequence[Message]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Answer:
    episode: dict[str, JSON]  # the sample's new ``Rollout.episode``
    observation: list[int] | None  # the tokens to append; None: the episode is over


def turn_start(r: Rollout) -> int:
    """Where the sample's last turn begins in its output: after its last observation."""
    return sum(r.observed[-1]) if r.observed else 0


class EpisodeDriver:
    def __init__(self, env: Environment, chat: Renderer, max_turns: int, workers: int = 4):
        """``chat``: renders observations and decodes turns (special tokens kept)."""
        self.env, self.chat, self.max_turns = env, chat, max_turns
        self._pool = thread_pool("env", workers)

    @classmethod
    def from_setup(cls, setup: EpisodeSetup) -> EpisodeDriver:
        return cls(setup.env, setup.chat, setup.max_turns, setup.workers)

    @staticmethod
    def awaiting(r: Rollout) -> bool:
        """A turn ended and the environment has not answered it yet."""
        return r.finish_reason == "stop" and not (r.episode or {}).get("over", False)

    def answer(self, item: Example, r: Rollout) -> cf.Future[Answer]:
        """The environment's answer to ``r``'s last turn, computed in a worker thread from
        copies (the stream may snapshot ``r`` meanwhile)."""
        turn = list(r.output_ids[turn_start(r) : -1])  # without the end token
        start = dict(r.episode) if r.episode else {"messages": [dict(m) for m in item.messages]}
        return self._pool.submit(self._answer, start, turn, len(r.observed) + 1, r.remaining)

    def _answer(self, ep: dict[str, JSON], turn: list[int], turns: int, room: int) -> Answer:
        messages = [*ep["messages"], {"role": "assistant", "content": self.chat.decode(turn)}]
        step = self.env.step(messages)
        counts = dict(ep.get("metrics", {}))
        for k, v in step.metrics.items():
            counts[k] = counts.get(k, 0.0) + float(v)
        done = {"messages": messages, "over": True, "turns": turns, "metrics": counts}
        if step.done:
            return Answer({**done, "stop": "answer", "reward": step.reward}, None)
        if turns >= self.max_turns:
            return Answer({**done, "stop": "max_turns"}, None)
        obs = self.chat.observation_ids(messages, step.observations)
        if len(obs) >= room:
            return Answer({**done, "stop": "max_tokens"}, None)
        messages += step.observations
        return Answer({**done, "over": False, "stop": ""}, obs)

    @staticmethod
    def apply(r: Rollout, answer: Answer) -> bool:
        """Apply an answer to its sample (under the caller's lock); True when the sample's
        next turn is due, False when it is finished (cut by length when the context is
        full: the overlong rule applies)."""
        r.episode = answer.episode
        if answer.observation is None:
            if answer.episode.get("stop") == "max_tokens":
                r.finish("length")
            return False
        r.observe(answer.observation)
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        close_workers()  # a user tool's worker processes (rank exits skip atexit)


def run_episodes(
    client: GeneratorClient, driver: EpisodeDriver, items: Sequence[Example],
    sampling: SamplingParams,
) -> list[Rollout]:  # fmt: skip
    """Every sample of every prompt played to the end of its episode, in submission order
    (an evaluation's): the environment answers each ended turn while the other samples
    keep generating, and a sample cut by a pause is resumed at once."""
    futures = [f for e in items for f in client.submit(list(e.prompt_ids), sampling)]
    out = [f.rollout for f in futures]
    item = {id(r): e for r, e in zip(out, [e for e in items for _ in range(sampling.n)],
                                      strict=True)}  # fmt: skip
    # A generation (None) or the environment's answer to the sample it names.
    pending: dict[cf.Future[Any], Rollout | None] = dict.fromkeys(futures)
    while pending:
        done, _ = cf.wait(list(pending), return_when=cf.FIRST_COMPLETED)
        for f in done:
            answered = pending.pop(f)
            if answered is not None:
                if driver.apply(answered, f.result()):
                    pending[client.resume(answered)] = None
                continue
            r: Rollout = f.result()
            if not r.finished:
                pending[client.resume(r)] = None
            elif driver.awaiting(r):
                pending[driver.answer(item[id(r)], r)] = r
    return out


def conversation(r: Rollout) -> tuple[str, dict[str, JSON]] | None:
    """A finished multi-turn sample's final answer (the last assistant turn, what the
    reward function scores as the response) and what it adds to the reward's metadata:
    the whole conversation, the environment's reward (None: the function decides) and the
    tools' counts. None for a one-turn sample."""
    ep: Mapping[str, JSON] | None = r.episode
    if not ep:
        return None
    answers = [m for m in ep["messages"] if m["role"] == "assistant"]
    extra = {"messages": ep["messages"], "env_reward": ep.get("reward"),
             "env_stop": ep.get("stop", ""), "turns": ep.get("turns", len(answers))}  # fmt: skip
    return (str(answers[-1]["content"]) if answers else ""), extra


def episode_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Per trajectory, over the multi-turn samples among ``rollouts`` (none: no metrics):
    turns, tool calls, errors and timeouts, observation tokens, sampled tokens per turn,
    the share of calls that worked, and how episodes ended."""
    eps = [(r, r.episode) for r in rollouts if r.episode]
    if not eps:
        return {}
    n = len(eps)
    counts = [ep.get("metrics", {}) for _, ep in eps]

    def total(key: str) -> float:
        return float(sum(c.get(key, 0.0) for c in counts))

    turns = [int(ep.get("turns", 1)) for _, ep in eps]
    observed = [sum(count for _, count in r.observed) for r, _ in eps]
    sampled = [len(r.output_ids) - o for (r, _), o in zip(eps, observed, strict=True)]
    calls, failed = total("tool_calls"), total("tool_errors") + total("tool_timeouts")
    out = {
        "episode_turns_mean": sum(turns) / n,
        "episode_tool_calls_mean": calls / n,
        "episode_tool_errors_mean": total("tool_errors") / n,
        "episode_tool_timeouts_mean": total("tool_timeouts") / n,
        "episode_observation_tokens_mean": sum(observed) / n,
        "episode_turn_len_mean": sum(sampled) / sum(turns),
        "episode_tool_success": (calls - failed) / calls if calls else float("nan"),
    }
    for stop in ("answer", "max_turns", "max_tokens"):
        out[f"episode_stop_{stop}_frac"] = sum(ep.get("stop") == stop for _, ep in eps) / n
    return out
