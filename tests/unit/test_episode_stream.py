"""Multi-turn samples in the rollout stream: each ended turn goes to the environment in a
worker thread, its answer goes back to a server, and a snapshot taken while a turn waits
for its answer resumes by asking again, regenerating nothing."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

from rl.config.sampling import SamplingParams
from rl.controller import rollout_state
from rl.controller.episodes import EpisodeDriver, conversation, run_episodes
from rl.controller.evaluate import score_items
from rl.controller.rollouts import Group, RolloutStream
from rl.controller.staleness import StalenessGate
from rl.envs.environment import Step
from rl.generator.types import Rollout
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreResult
from tests.helpers.fake_generator import FakeClient, ScriptedClient

END, CALL, ANSWER, OBS = 2, 7, 9, [40, 41]
SAMPLING = SamplingParams(n=2, max_new_tokens=12, seed=1)


class Env:
    """Answers a turn "CALL" with a tool message, ends the episode on any other turn; the
    test holds every answer until it releases ``gate``."""

    tools = ()

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.steps = 0

    def reset(self, row):
        return [{"role": "user", "content": "q"}]

    def step(self, messages) -> Step:
        self.gate.wait()
        self.steps += 1
        if messages[-1]["content"] == "CALL":
            return Step(({"role": "tool", "content": "84"},), metrics={"tool_calls": 1.0})
        return Step(done=True, reward=None)


class Chat:
    def observation_ids(self, before, added):
        return list(OBS)

    def decode(self, ids) -> str:  # any run of CALL tokens reads as a tool call
        return "CALL" if ids and set(ids) == {CALL} else "ANSWER" if ids == [ANSWER] else "?"


def _driver(env: Env) -> EpisodeDriver:
    return EpisodeDriver(env, Chat(), max_turns=4)


def _example(i: int) -> Example:
    text = f"prompt {i}"
    return Example(f"p{i}", (5, 6), text, messages=({"role": "user", "content": text},))


def _until(pred, what: str) -> None:
    deadline = time.monotonic() + 5
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _stream(client, env, scored: list[Group]) -> RolloutStream:
    def score(g: Group) -> Future:
        scored.append(g)
        f: Future = Future()
        f.set_result([ScoreResult(1.0 if i else 0.0) for i in range(len(g.rollouts))])
        return f

    gate = StalenessGate(max_lag=1, mode="throttle", per_step=1)
    prompt = iter(_example(i) for i in range(100))
    return RolloutStream(client, score, lambda: next(prompt), SAMPLING, gate=gate, version=3,
                         episodes=_driver(env))  # fmt: skip


@contextlib.contextmanager
def _first_group(
    env: Env,
) -> Iterator[tuple[ScriptedClient, RolloutStream, list, Rollout, Rollout]]:
    """A running stream and the two samples of its first group, on a server; closed after."""
    client, scored = ScriptedClient(), []
    stream = _stream(client, env, scored).start()
    try:
        _until(lambda: len(client.sent) >= 2, "a group sent")
        yield client, stream, scored, client.sent[0], client.sent[1]
    finally:
        env.gate.set()  # a worker held by the test lets go, so the pool can shut down
        stream.close()


def test_a_sample_calls_a_tool_gets_the_answer_and_is_scored_once_on_its_final_turn():
    with _first_group(Env()) as (client, _, scored, a, b):
        client.segment(a, [CALL, END], 3, "stop")  # a calls the tool
        client.segment(b, [ANSWER, END], 3, "stop")  # b answers at once
        _until(lambda: client.sent.count(a) == 2, "a's next turn sent")
        assert a.output_ids == [CALL, END, *OBS] and a.observed == [[2, 2]]
        assert not scored  # b alone is finished: the group waits for a
        client.segment(a, [ANSWER, END], 4, "stop")  # a's next turn, under version 4
        _until(lambda: scored, "the group scored")
        g = scored[0]
        assert [r.rid for r in g.rollouts] == [a.rid, b.rid] and len(scored) == 1
        assert a.output_ids == [CALL, END, *OBS, ANSWER, END]
        assert a.sampled() == [True, True, False, False, True, True]
        assert a.versions == [3, 3, 3, 3, 4, 4]
        assert a.episode["stop"] == "answer" and a.episode["turns"] == 2
        assert a.episode["metrics"] == {"tool_calls": 1.0}
        roles = [m["role"] for m in a.episode["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"]
        # The reward scores the final answer and sees the whole conversation.
        items = score_items(_Task(), [g.item] * 2, g.rollouts)
        assert items[0].response == "ANSWER" and items[0].metadata["turns"] == 2
        assert items[0].metadata["messages"] == a.episode["messages"]
        assert conversation(b)[1]["turns"] == 1


class _Task:
    class codec:  # the task's attribute, as the loop reads it
        @staticmethod
        def response_text(ids):
            raise AssertionError("a multi-turn sample is never decoded whole")


def test_a_turn_waiting_for_its_answer_is_asked_again_after_a_resume_not_regenerated():
    env = Env()
    with _first_group(env) as (client, stream, _, a, b):
        env.gate.clear()  # the environment is busy with both turns when the job dies
        client.segment(a, [CALL, END], 3, "stop")
        client.segment(b, [ANSWER, END], 3, "stop")
        _until(lambda: len(stream._env) == 2, "both turns at the environment")
        state = stream.snapshot()
    back = rollout_state.from_json(json.loads(json.dumps(rollout_state.to_json(state))))
    client2, env2, scored2 = ScriptedClient(), Env(), []
    resumed = _stream(client2, env2, scored2)
    resumed.restore(back)
    resumed.start()
    try:
        _until(lambda: any(r.rid == a.rid for r in client2.sent), "a's next turn sent")
        a2 = next(r for r in client2.sent if r.rid == a.rid)
        assert a2.output_ids == [CALL, END, *OBS] and a2.observed == [[2, 2]]
        # The environment answered both saved turns (a's with a tool, b's by ending it),
        # and no turn was generated again: only a's next one was sent.
        _until(lambda: env2.steps == 2, "both saved turns answered")
        assert [r.rid for r in client2.sent].count(b.rid) == 0
        client2.segment(a2, [ANSWER, END], 4, "stop")
        _until(lambda: scored2, "the restored group scored")
        assert [r.output_ids for r in scored2[0].rollouts if r.output_ids] == [
            [CALL, END, *OBS, ANSWER, END],
            [ANSWER, END],
        ]
    finally:
        resumed.close()


def test_an_observation_that_fills_the_context_ends_the_sample_as_overlong():
    with _first_group(Env()) as (client, _, scored, a, b):
        client.segment(a, [CALL] * 9 + [END], 3, "stop")  # 10 of 12 tokens: no room for 2
        client.segment(b, [ANSWER, END], 3, "stop")
        _until(lambda: scored, "the group scored")
        assert a.finish_reason == "length" and a.episode["stop"] == "max_tokens"


class Turns(FakeClient):
    """Plays every sample at once: a first turn that calls the tool, then an answer; the
    first segment of sample 1 comes back cut (a pause), to be resumed."""

    def started(self, f: Future, r, segment_tokens) -> None:
        if r.sample_index == 1 and r.segments == 0:
            r.append([CALL], [-0.1], [3], None)  # cut: no end token yet
        elif not r.output_ids or r.output_ids == [CALL]:
            r.append([CALL, END][len(r.output_ids):], [-0.1] * (2 - len(r.output_ids)),
                     [3] * (2 - len(r.output_ids)), "stop")  # fmt: skip
        else:
            r.append([ANSWER, END], [-0.2, -0.3], [3, 3], "stop")
        f.set_result(r)


def test_an_evaluation_plays_every_sample_to_the_end_of_its_episode():
    env = Env()
    items = [_example(i) for i in range(3)]
    out = run_episodes(Turns(), _driver(env), items, SAMPLING)
    assert len(out) == 6 and env.steps == 12  # two turns each, both answered
    for r in out:
        assert r.output_ids == [CALL, END, *OBS, ANSWER, END] and r.episode["stop"] == "answer"
    assert [conversation(r)[0] for r in out] == ["ANSWER"] * 6
