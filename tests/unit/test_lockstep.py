"""The deterministic run's rollout stream (rl/controller/lockstep.py) against a fake
generator whose segments and scores come back after random delays: the batches, every
token's version, the prompt order and the rollout ids repeat whatever the timing, and so
does the run's ledger; a resumed stream goes on exactly as the uninterrupted one; and the
free-running stream, driven the same way, does not repeat (so the comparison can fail).
The real job: test_a_deterministic_job_repeats_and_resumes_bit_for_bit in
tests/servers/test_rl_resume.py."""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from rl.config.sampling import SamplingParams
from rl.controller import rollout_state
from rl.controller.lockstep import LockstepStream
from rl.controller.rollouts import RolloutStream
from rl.controller.staleness import StalenessGate
from rl.generator.types import Rollout
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreResult
from tests.helpers.fake_generator import FakeClient
from tests.helpers.ledger import as_if_uninterrupted, where_each_group_went

SAMPLING = SamplingParams(n=3, max_new_tokens=6)
EOS = 0


def _token(r: Rollout, pos: int, version: int) -> int:
    key = f"{r.group}:{r.sample_index}:{r.prompt_ids}:{pos}:{version}".encode()
    return hashlib.blake2b(key, digest_size=2).digest()[0] % 7  # 0 (EOS) one time in 7


class _JitterClient(FakeClient):
    """Samples a token from (group, sample, prompt, position, version): a function of what
    a deterministic server's sample is a function of. Each segment returns after a random
    delay; ``version`` is what the servers hold (the test pushes)."""

    def __init__(self, seed: int, version: int = 1) -> None:
        self.rng, self.version = random.Random(seed), version

    def started(self, f: Future, r: Rollout, segment_tokens: int | None) -> None:
        threading.Timer(self.rng.random() * 0.004, self._segment,
                        (f, r, segment_tokens, self.version)).start()  # fmt: skip

    def _segment(self, f: Future, r: Rollout, segment_tokens, version: int) -> None:
        _, budget, _ = r.next_request(segment_tokens)
        ids: list[int] = []
        while len(ids) < budget:
            ids.append(_token(r, len(r.output_ids) + len(ids), version))
            if ids[-1] == EOS:
                break
        reason = "stop" if ids[-1] == EOS else "length"
        r.append(ids, [-0.5] * len(ids), [version] * len(ids), reason)
        f.set_result(r)


class _Prompts:
    def __init__(self, start: int = 0) -> None:
        self.drawn = start

    def __call__(self) -> Example:
        i, self.drawn = self.drawn, self.drawn + 1
        return Example(f"p{i}", (i + 1, 9), "")

    def position(self) -> dict:
        return {"drawn": self.drawn}


def _score(rng: random.Random):
    def score(group):  # a group of a prompt divisible by 4 is uniform (all 1)
        uniform = group.item.prompt_ids[0] % 4 == 0
        rewards = [1.0 if uniform else float(len(r.output_ids) % 2) for r in group.rollouts]
        if not uniform and len(set(rewards)) == 1:
            rewards[0] = 1 - rewards[0]
        f: Future = Future()
        threading.Timer(rng.random() * 0.004, f.set_result,
                        ([ScoreResult(x) for x in rewards],)).start()  # fmt: skip
        return f

    return score


def _stream(cls, client, seed, prompts, version, lag, seg, last):
    gate = StalenessGate(lag, per_step=2)
    uniform = lambda g: len(set(g.rewards)) == 1  # noqa: E731
    score = _score(random.Random(seed))
    kw = dict(gate=gate, version=version, segment_tokens=seg, drop_uniform=uniform,
              position=prompts.position)  # fmt: skip
    if cls is LockstepStream:
        return LockstepStream(client, score, prompts, SAMPLING, last=last, **kw)
    return RolloutStream(client, score, prompts, SAMPLING, **kw)


def _record(groups) -> list:
    return [(g.step, g.item.uid, [(r.rid, r.output_ids, r.versions) for r in g.rollouts])
            for g in groups]  # fmt: skip


def _steps(stream, client, first: int, last: int, log: list, save_at: int | None = None,
           settle_s: float = 0.0, out: Path | None = None, look_s: float = 0.0,
           saves: tuple[int, ...] = ()):  # fmt: skip
    """The controller's order: take step s, (train), finish the round, push s+1; at
    ``save_at``, a snapshot ``settle_s`` after the push, and stop there. With ``out``,
    RLRun's ledger record of each step in it, ``look_s`` after the push: the groups set
    aside, and at ``saves`` and the last step those the stream holds (the snapshot)."""
    for s in range(first, last + 1):
        time.sleep(random.random() * 0.003)  # training takes a while
        groups, _ = stream.next_batch(s)
        log.append(_record(groups))
        stream.finish_round()
        client.version = s + 1
        stream.commit(s + 1)
        time.sleep(look_s + (settle_s if s == save_at else 0.0))
        held = stream.snapshot() if s in (save_at, last, *saves) else None
        if out is not None:
            left = None if held is None else held.groups
            rollout_state.log_trained(out, s, groups, (), stream.take_set_aside(), left)
        if s == save_at:
            return held
    return None


def _run(cls, seed: int, lag: int, seg: int | None, last: int = 6) -> list:
    client, prompts, log = _JitterClient(seed), _Prompts(), []
    stream = _stream(cls, client, seed, prompts, 1, lag, seg, last).start()
    try:
        _steps(stream, client, 1, last, log)
    finally:
        stream.close()
    return log


@pytest.mark.parametrize(("lag", "seg"), [(0, None), (1, None), (2, None), (1, 2), (2, 2)])
def test_batches_and_versions_repeat_whatever_the_timing(lag, seg):
    first = _run(LockstepStream, 0, lag, seg)
    assert _run(LockstepStream, 1, lag, seg) == first
    for s, groups in enumerate(first, start=1):
        assert len(groups) == 2 and all(step == s for step, _, _ in groups)
        versions = [v for _, _, samples in groups for _, _, vs in samples for v in vs]
        start = max(1, s - lag)
        assert min(versions) >= start and max(versions) <= s
        if seg is None:  # a group runs to its end in the round it starts in
            assert set(versions) == {start}
    if seg is not None and lag:  # samples longer than a segment span versions
        assert any(len(set(vs)) > 1 for g in first for _, _, ss in g for _, _, vs in ss)
    uids = [int(uid[1:]) for g in first for _, uid, _ in g]
    assert all(u % 4 != 3 for u in uids)  # uniform groups (prompt id % 4 == 0) replaced


def test_the_free_running_stream_does_not_repeat():
    """The same driver and timing noise: arrival order decides the free-running batches
    (what makes the lockstep comparison above able to fail)."""
    runs = [_run(RolloutStream, seed, 2, 2) for seed in range(4)]
    assert any(r != runs[0] for r in runs[1:])


@pytest.mark.parametrize(
    ("lag", "seg", "save_at", "settle_s"),
    [(1, 2, 2, 0.0), (2, 2, 3, 0.0), (2, 2, 3, 0.1), (2, None, 2, 0.0), (2, None, 2, 0.1),
     (2, 2, 4, 0.0)],
)  # fmt: skip
def test_a_resumed_stream_goes_on_as_the_uninterrupted_one(lag, seg, save_at, settle_s):
    """Saved after a save step's push (as RLRun.save does), through the JSON file, into a
    new stream on a new client: the rest of the run is the uninterrupted run's. Saved at
    once, the round's segments are on the servers (cut back, run again); saved 0.1 s
    later, they are back and parked until the next round. Saved at 4 (lag 2), the last
    group drawn is a replacement of step 4's: the resumed stream's groups still take their
    ids, and their samples' seeds, from their places in the prompt stream."""
    whole = _run(LockstepStream, 5, lag, seg)
    client, prompts, log = _JitterClient(6), _Prompts(), []
    stream = _stream(LockstepStream, client, 6, prompts, 1, lag, seg, 6).start()
    try:
        state = _steps(stream, client, 1, 6, log, save_at, settle_s)
    finally:
        stream.close()
    assert state is not None
    state = rollout_state.from_json(rollout_state.to_json(state))
    client2, prompts2 = _JitterClient(7, version=save_at + 1), _Prompts(state.drawn)
    resumed = _stream(LockstepStream, client2, 7, prompts2, save_at + 1, lag, seg, 6)
    resumed.restore(state)
    resumed.start()
    try:
        _steps(resumed, client2, save_at + 1, 6, log)
    finally:
        resumed.close()
    assert log == whole


@pytest.mark.parametrize(("lag", "seg"), [(1, None), (2, 2)])
def test_two_runs_and_a_resumed_one_write_the_same_ledger(tmp_path, lag, seg):
    """RLRun's ledger (rl/controller/rollout_state.py) of two runs that save at step 3,
    whose controller looks at the stream at once after each push, and 30 ms later (by then
    the next round's uniform groups are skipped and replaced): byte-equal. A third run
    stopped at step 3's save and resumed in a new stream writes it too, once what a resume
    adds to the groups it carried over (the step, their samples) is taken out."""
    ledgers = []
    for seed, look_s in ((0, 0.0), (1, 0.03)):
        out = tmp_path / f"run{seed}"
        out.mkdir()
        client, prompts = _JitterClient(seed), _Prompts()
        stream = _stream(LockstepStream, client, seed, prompts, 1, lag, seg, 6).start()
        try:
            _steps(stream, client, 1, 6, [], out=out, look_s=look_s, saves=(3,))
        finally:
            stream.close()
        ledgers.append((out / rollout_state.TRAINED).read_bytes())
    assert ledgers[1] == ledgers[0]
    lines = ledgers[0].decode().splitlines()
    assert any(rec["skipped"] for rec in map(json.loads, lines))  # replacements were drawn
    assert '"g0.0"' in lines[0]  # the first prompt's first sample

    out = tmp_path / "resumed"
    out.mkdir()
    client, prompts = _JitterClient(2), _Prompts()
    stream = _stream(LockstepStream, client, 2, prompts, 1, lag, seg, 6).start()
    try:
        state = _steps(stream, client, 1, 6, [], save_at=3, out=out, look_s=0.03)
    finally:
        stream.close()
    assert state is not None
    state = rollout_state.from_json(rollout_state.to_json(state))
    client2, prompts2 = _JitterClient(3, version=4), _Prompts(state.drawn)
    resumed = _stream(LockstepStream, client2, 3, prompts2, 4, lag, seg, 6)
    resumed.restore(state)
    resumed.start()
    try:
        _steps(resumed, client2, 4, 6, [], out=out, saves=(3,))
    finally:
        resumed.close()
    text = (out / rollout_state.TRAINED).read_text()
    assert text.splitlines()[:3] == lines[:3]
    assert "".join(as_if_uninterrupted(x) + "\n" for x in text.splitlines()) == ledgers[0].decode()
    recs = [json.loads(x) for x in text.splitlines()]
    assert any("restored_at" in g for rec in recs for g in rec["groups"])
    where_each_group_went(recs)  # every group drawn in one place


def test_a_round_goes_one_version_at_a_time():
    client, prompts = _JitterClient(0), _Prompts()
    stream = _stream(LockstepStream, client, 0, prompts, 1, 1, None, 4).start()
    try:
        stream.commit(1)  # a restarted server's re-push of the same version: nothing new
        with pytest.raises(RuntimeError, match="one version at a time: 1 -> 3"):
            stream.commit(3)
    finally:
        stream.close()
