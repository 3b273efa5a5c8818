"""One multi-turn episode as a state machine over token ids, so whoever drives generation
(the rollout stream, an evaluation, a test) can stop it between turns, save it and resume
it: ``request()`` gives the ids to generate from, ``record()`` takes what was generated.

The trajectory keeps, after the prompt, every token in order:

- the model's tokens exactly as sampled, each with its log-prob and the weight version it
  was sampled under (a turn may span versions; so may an episode), trained on;
- the observation tokens as the chat template renders them (rl/envs/chat.py), with
  log-prob 0 and version -1, masked out of the loss.

Generated text is decoded only to be read by the environment; it is never re-tokenized.

Pure logic: the environment and the renderer are handed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rl.envs.chat import ChatRenderer
from rl.envs.environment import Environment, Message

OBSERVATION_VERSION = -1


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    max_tokens: int = 1024  # prompt and everything after it: the context the server has
    max_response_tokens: int = 256  # per turn


@dataclass
class Turn:
    response_tokens: int
    observation_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    messages: list[Message]
    ids: list[int] = field(default_factory=list)  # after the prompt
    trained: list[bool] = field(default_factory=list)  # per id: sampled (True) or observed
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    stop: str = ""  # why it ended: "answer", "length", "max_turns", "max_tokens"; "": running
    reward: float | None = None  # the environment's, when it gives one

    @property
    def done(self) -> bool:
        return bool(self.stop)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Trajectory:
        turns = [Turn(**t) for t in data.get("turns", [])]
        return cls(**{**data, "turns": turns})


@dataclass(frozen=True)
class Generated:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]


class Episode:
    """Drive one episode: ``request() -> (ids, max_new_tokens) | None``, then ``record()``."""

    def __init__(
        self,
        env: Environment,
        chat: ChatRenderer,
        decode: Callable[[Sequence[int]], str],
        limits: EpisodeLimits,
        trajectory: Trajectory,
    ):
        self.env, self.chat, self.decode, self.limits = env, chat, decode, limits
        self.traj = trajectory

    @classmethod
    def start(
        cls,
        env: Environment,
        chat: ChatRenderer,
        decode: Callable[[Sequence[int]], str],
        limits: EpisodeLimits,
        row: Mapping[str, Any],
    ) -> Episode:
        messages = env.reset(row)
        traj = Trajectory(prompt_ids=chat.prompt_ids(messages), messages=messages)
        return cls(env, chat, decode, limits, traj)

    def length(self) -> int:
        return len(self.traj.prompt_ids) + len(self.traj.ids)

    def request(self) -> tuple[list[int], int] | None:
        if self.traj.done:
            return None
        room = min(self.limits.max_response_tokens, self.limits.max_tokens - self.length())
        if room <= 0:
            self.traj.stop = "max_tokens"
            return None
        return [*self.traj.prompt_ids, *self.traj.ids], room

    def record(self, out: Generated) -> None:
        """Append one turn's sampled tokens, then the environment's answer to it."""
        t = self.traj
        if not (len(out.ids) == len(out.logprobs) == len(out.versions)):
            raise ValueError("a turn's ids, log-probs and versions differ in length")
        t.ids += out.ids
        t.trained += [True] * len(out.ids)
        t.logprobs += out.logprobs
        t.versions += out.versions
        t.turns.append(Turn(response_tokens=len(out.ids)))
        ended = bool(out.ids) and out.ids[-1] == self.chat.end_id
        body = out.ids[:-1] if ended else out.ids
        t.messages.append({"role": "assistant", "content": self.decode(body)})
        if not ended:  # cut by the server at max_new_tokens: the context, or the turn's limit
            t.stop = "max_tokens" if self.length() >= self.limits.max_tokens else "length"
            return
        step = self.env.step(t.messages)
        t.turns[-1].metrics = dict(step.metrics)
        if step.done:
            t.stop, t.reward = "answer", step.reward
            return
        if len(t.turns) >= self.limits.max_turns:
            t.stop = "max_turns"
            return
        obs = self.chat.observation_ids(t.messages, step.observations)
        if self.length() + len(obs) >= self.limits.max_tokens:
            t.stop = "max_tokens"
            return
        t.messages += step.observations
        t.ids += obs
        t.trained += [False] * len(obs)
        t.logprobs += [0.0] * len(obs)
        t.versions += [OBSERVATION_VERSION] * len(obs)
        t.turns[-1].observation_tokens = len(obs)


def run_episode(episode: Episode, generate: Callable[[list[int], int], Generated]) -> Trajectory:
    """Drive an episode to its end with a synchronous ``generate(ids, max_new_tokens)``."""
    while (req := episode.request()) is not None:
        episode.record(generate(*req))
    return episode.traj
