"""The rollout stream's state across a restart (rl/controller/rollout_state.py): what a
checkpoint saves of the stream, its file, and what a resumed stream does with it. Driven
by a scripted generator client, so no server and no process."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import pytest

from rl.checkpoints import resume
from rl.config.sampling import SamplingParams
from rl.controller import rollout_state
from rl.controller.rollout_state import RolloutStateError
from rl.controller.rollouts import Group, RolloutStream, StreamState
from rl.controller.staleness import StalenessGate
from rl.generator.types import Rollout
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreResult
from tests.helpers.fake_generator import ScriptedClient

SAMPLING = SamplingParams(n=2, max_new_tokens=6, seed=1)


class _Prompts:
    def __init__(self, drawn: int = 0) -> None:
        self.drawn = drawn

    def __call__(self) -> Example:
        self.drawn += 1
        i = self.drawn - 1
        return Example(f"p{i}", (5 + i, 7), f"prompt {i}", label={"answer": [i]},
                       metadata={"k": "v"}, target_ids=(9, 4, 2), target_mask=(True, False, True),
                       messages=({"role": "user", "content": f"prompt {i}"},))  # fmt: skip

    def position(self) -> dict:
        return {"task": "fake", "drawn": self.drawn}


class _Scores:
    def __init__(self, instant: bool = False) -> None:
        self.instant, self.pending = instant, {}  # gid -> future

    def __call__(self, g: Group) -> Future:
        f: Future = Future()
        if self.instant:
            f.set_result([ScoreResult(float(k % 2), {"m": 1.0}) for k in range(len(g.rollouts))])
        self.pending[g.gid] = f
        return f


def _until(pred, what: str) -> None:
    deadline = time.monotonic() + 5
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _stream(client, scores, prompts, version, max_lag=1) -> RolloutStream:
    gate = StalenessGate(max_lag=max_lag, mode="throttle", per_step=2)
    return RolloutStream(
        client,
        scores,
        prompts,
        SAMPLING,
        gate=gate,
        version=version,
        segment_tokens=2,
        eager_resume=False,
        position=prompts.position,
    )


def _mid_run_snapshot() -> tuple[StreamState, ScriptedClient]:
    """Four groups at version 3 (per_step 2, lag 1): g0 scored and queued, g1 and g2
    with samples parked then resumed under version 4 and on a server (g1's mid-append),
    g2's other sample parked again, g3 finished under version 4 and being scored; version
    4 let g4 and g5 start, on a server with no token yet."""
    client, scores, prompts = ScriptedClient(), _Scores(), _Prompts()
    stream = _stream(client, scores, prompts, 3).start()
    try:
        _until(lambda: len(client.sent) == 8, "4 groups")
        r = {(x.group, x.sample_index): x for x in client.sent}
        client.segment(r[0, 0], [11], 3, "stop")
        client.segment(r[0, 1], [12, 2], 3, "stop")
        _until(lambda: 0 in scores.pending, "g0 scoring")
        scores.pending[0].set_result([ScoreResult(1.0), ScoreResult(0.0, {"m": 2.0})])
        client.segment(r[1, 0], [21, 22], 3, "length")  # cut: parked
        client.segment(r[1, 1], [23], 3, "stop")
        client.segment(r[2, 1], [31, 32], 3, "length")  # cut: parked
        _until(lambda: stream.parked == 2, "two parked")
        stream.commit(4)  # both resume under version 4
        _until(lambda: len(client.sent) == 14, "two resumed, two groups more")
        client.segment(r[2, 0], [33, 34], 4, "length")  # parked, waits for version 5
        client.segment(r[3, 0], [41], 4, "stop")
        client.segment(r[3, 1], [42], 4, "stop")
        _until(lambda: 3 in scores.pending and stream.parked == 1, "g3 scoring, g2 parked")
        r[1, 0].append([24, 25], [-0.1, -0.2], [4, 4], None)  # the client mid-segment
        state = stream.snapshot()
    finally:
        stream.close()
    return state, client


def test_snapshot_round_trips_through_json_with_parked_scored_and_in_flight_groups():
    state, _ = _mid_run_snapshot()
    assert (state.version, state.drawn, state.position) == (4, 6, {"task": "fake", "drawn": 6})
    g = {x.gid: x for x in state.groups}
    assert state.groups[0].gid == 0  # the queue first
    assert g[0].rewards == [1.0, 0.0] and g[3].results is None
    # On a server: cut back to the tokens it had when its segment was sent.
    s10, s20, s21 = g[1].rollouts[0], g[2].rollouts[0], g[2].rollouts[1]
    assert (s10.output_ids, s10.versions, s10.finish_reason) == ([21, 22], [3, 3], None)
    assert (s20.output_ids, s20.versions) == ([33, 34], [4, 4])  # parked
    assert (s21.output_ids, s21.versions) == ([31, 32], [3, 3])  # on a server
    assert g[1].rollouts[1].finish_reason == "stop" and g[3].rollouts[1].output_ids == [42]
    assert [r.output_ids for r in g[4].rollouts + g[5].rollouts] == [[]] * 4
    assert sorted(x.index for x in state.groups) == list(range(6))
    text = json.dumps(rollout_state.to_json(state))
    back = rollout_state.from_json(json.loads(text))
    assert rollout_state.to_json(back) == rollout_state.to_json(state)
    assert back.groups[0].item == state.groups[0].item  # the whole Example, tuples and all
    assert back.groups[0].results == state.groups[0].results
    b10 = {x.gid: x for x in back.groups}[1].rollouts[0]
    assert (b10.rid, b10.sampling, b10.logprobs) == (s10.rid, SAMPLING, s10.logprobs)
    with pytest.raises(RolloutStateError, match=r"not a rl\.rollout_state file"):
        rollout_state.from_json({"groups": []}, "f.json")
    bad = json.loads(text)
    bad["groups"][1]["rollouts"][0]["logprobs"].append(-1.0)
    with pytest.raises(RolloutStateError, match=r"f\.json: malformed .*differ in length"):
        rollout_state.from_json(bad, "f.json")


def test_a_restored_stream_trains_the_queue_first_and_resumes_samples_from_their_tokens():
    state, _ = _mid_run_snapshot()
    state = rollout_state.from_json(json.loads(json.dumps(rollout_state.to_json(state))))
    state.step = 7
    by_key = {(x.gid, r.sample_index): r for x in state.groups for r in x.rollouts}
    saved = {k: list(r.output_ids) for k, r in by_key.items()}
    saved_lp = {k: list(r.logprobs) for k, r in by_key.items()}
    client, scores, prompts = ScriptedClient(), _Scores(instant=True), _Prompts()
    stream = _stream(client, scores, prompts, 4)  # the resumed job's first version
    counts = stream.restore(state)
    assert counts == {"resume_groups": 6, "resume_rollouts": 7, "resume_dropped_groups": 0}
    assert prompts.drawn == 0  # nothing new: the budget is full
    resumed = {(r.group, r.sample_index): r for r in client.sent}
    assert sorted(resumed) == [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (5, 0), (5, 1)]
    for (gid, i), r in resumed.items():  # from their saved tokens; ids marked as this attempt's
        assert r.output_ids == saved[gid, i] and r.rid == f"g{gid}.{i}@7"
    assert 3 in scores.pending  # finished, scored again
    stream.start()
    try:
        first, stats = stream.next_batch(4)
        assert [g.gid for g in first] == [0, 3]  # the saved queue first
        assert stats["resume_groups"] == 6 and stats["resume_dropped_groups"] == 0
        stream.commit(5)
        for (gid, _), r in sorted(resumed.items()):
            client.segment(r, [90 + gid], 5, "stop")
        second, stats = stream.next_batch(5)
        assert "resume_groups" not in stats  # reported once
        stream.commit(6)  # room for two more groups: the prompt stream goes on
        _until(lambda: prompts.drawn >= 2, "new prompts")
    finally:
        stream.close()
    # g1 and g2 hold version-3 tokens: too old for version 5 (the gate drops them).
    assert sorted(g.gid for g in second) == [4, 5]
    assert all(g.restored_at == 7 for g in first + second)
    for (gid, i), r in resumed.items():  # the saved prefix and its versions, then the new
        n = len(saved[gid, i])
        assert r.output_ids == [*saved[gid, i], 90 + gid] and r.versions[n:] == [5]
        assert r.logprobs[:n] == saved_lp[gid, i]
    assert {(1, 0): [3, 3], (2, 0): [4, 4], (2, 1): [3, 3]}.items() <= {
        k: r.versions[:2] for k, r in resumed.items()
    }.items()
    new = [x for x in client.sent if x.rid not in {r.rid for r in resumed.values()}]
    assert stream.drawn == 6 + prompts.drawn  # the stream's count goes on from the saved one
    gids = sorted({x.group for x in new})
    assert gids == list(range(6, 6 + prompts.drawn))  # new group ids, past the restored
    # Their samples' ids: their places in the prompt stream, marked as this attempt's.
    assert {x.rid for x in new} == {f"s7.g{k}.{i}" for k in gids for i in range(SAMPLING.n)}


def test_groups_too_old_for_the_resumed_version_are_dropped_and_counted():
    """At version 5 with lag 1, a group holding a version-3 token can never be trained
    on: g0, g1, g2 go (counted); g3 (version 4 only) and g4, g5 (no token yet) stay."""
    state, _ = _mid_run_snapshot()
    client, scores, prompts = ScriptedClient(), _Scores(instant=True), _Prompts()
    stream = _stream(client, scores, prompts, 5)
    counts = stream.restore(state)
    assert counts == {"resume_groups": 3, "resume_rollouts": 4, "resume_dropped_groups": 3}
    stream.start()
    try:
        for r in client.sent:
            if r.group == 4:
                client.segment(r, [1], 5, "stop")
        batch, stats = stream.next_batch(5)
    finally:
        stream.close()
    assert [g.gid for g in batch] == [3, 4] and stats["resume_dropped_groups"] == 3
    assert all(v == 5 for r in batch[1].rollouts for v in r.versions)


def test_atomic_write_leaves_no_temporary_and_never_half_a_file(tmp_path, monkeypatch):
    import os

    path = tmp_path / "s.json"
    big = [{"ids": list(range(i, i + 2000))} for i in range(20)]  # ~200 KB per write
    seen: list[int] = []
    torn: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while True:
            last = stop.is_set()
            try:
                seen.append(json.loads(path.read_text())["n"])
            except FileNotFoundError:
                pass
            except json.JSONDecodeError as e:  # part of a file
                torn.append(str(e))
            if last:
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for n in range(10):
            rollout_state.write_atomic(path, json.dumps({"n": n, "big": big}))
    finally:
        stop.set()
        t.join()
    assert not torn and seen and seen == sorted(seen) and seen[-1] == 9
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]

    def killed(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError, match="disk full"):
        rollout_state.write_atomic(path, "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
    assert json.loads(path.read_text())["n"] == 9


def test_the_resume_point_names_the_state_saved_with_its_checkpoint(tmp_path):
    state, _ = _mid_run_snapshot()
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")  # a finished torch_dist save
    old = rollout_state.save(tmp_path, 2, state)
    rel = rollout_state.save(tmp_path, 4, state)
    (tmp_path / rollout_state.DIR / ".step-x.json.123.tmp").write_text("{")  # a killed write
    resume.write(tmp_path, resume.ResumePoint(4, str(ckpt), 0.1, None, rollouts=rel))
    rollout_state.prune(tmp_path, keep=rel)
    assert [p.name for p in (tmp_path / rollout_state.DIR).iterdir()] == ["step-0000004.json"]
    point = resume.read(tmp_path)
    assert point is not None and point.rollouts == rel != old
    back = rollout_state.load(tmp_path, point)
    assert back is not None and back.step == 4
    assert rollout_state.to_json(back) == rollout_state.to_json(state)
    assert rollout_state.load(tmp_path, resume.ResumePoint(4, str(ckpt), 0.1, None)) is None
    with pytest.raises(RolloutStateError, match="holds step 4, the resume point 5"):
        rollout_state.load(tmp_path, resume.ResumePoint(5, str(ckpt), 0.1, None, rollouts=rel))
    (tmp_path / rel).unlink()
    with pytest.raises(resume.ResumeError, match=r"rollout state .* is missing"):
        resume.read(tmp_path)


def test_resume_never_refuses_a_run_dir_with_a_resume_point(tmp_path):
    assert resume.read(tmp_path, "never") is None
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "metadata.json").write_text("{}")
    resume.write(tmp_path, resume.ResumePoint(3, str(tmp_path / "ckpt"), 0.1, None))
    with pytest.raises(resume.ResumeError, match=r"rl\.resume=never but .* holds a resume point"):
        resume.read(tmp_path, "never")
    with pytest.raises(resume.ResumeError, match=r"rl\.resume='maybe' must be one of auto, never"):
        resume.read(tmp_path, "maybe")


def test_a_multi_turn_sample_keeps_its_observation_tokens_through_the_file():
    r = Rollout([1, 5], SAMPLING, 0, 7)
    r.append([7, 2], [-0.1, -0.2], [3, 3], "stop")
    r.observe([40, 41])  # the environment's answer; the next turn is still to generate
    g = Group(7, Example("u", (1, 5), "p"), 3, [r])
    back = rollout_state.from_json(json.loads(json.dumps(rollout_state.to_json(
        StreamState(2, 3, 1, {}, groups=[g])))))  # fmt: skip
    b = back.groups[0].rollouts[0]
    assert (b.output_ids, b.observed, b.finish_reason) == ([7, 2, 40, 41], [[2, 2]], None)
    assert b.sampled() == [True, True, False, False]
