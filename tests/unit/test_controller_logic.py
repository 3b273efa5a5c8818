"""Controller logic without processes: batch assembly, the staleness bound, the role map."""

from __future__ import annotations

import itertools

import pytest
import torch

from rl.algorithms.advantages.grpo import GrpoConfig
from rl.algorithms.registry import with_advantages
from rl.batch import TrainBatch
from rl.config.roles import RoleError, RoleMap
from rl.config.sampling import RequestError, SamplingParams
from rl.config.schema import AlgorithmConfig
from rl.controller.batch import build_batch
from rl.controller.staleness import StalenessGate
from rl.generator.types import Rollout
from tests.helpers.configs import composed
from tests.helpers.fake_generator import InstantClient


def centred(b: TrainBatch) -> TrainBatch:
    """``b`` (one group) with its advantages as the trainer computes them for
    ``algorithm/advantage=grpo advantage.normalize_std=false``: reward minus group mean."""
    a = AlgorithmConfig(advantage=GrpoConfig(normalize_std=False), group_size=b.rows)
    return with_advantages(a, b)[0]


def _r(prompt, out, logprobs=None, versions=None, finish="stop"):
    return Rollout(
        prompt_ids=prompt,
        sampling=SamplingParams(max_new_tokens=64),
        output_ids=out,
        logprobs=logprobs or [-0.5] * len(out),
        versions=versions or [3] * len(out),
        rid="t",
        finish_reason=finish,
    )


def test_batch_alignment_and_padding():
    g = [[_r([1, 5, 6], [7, 2], [-0.1, -0.2], [4, 5]), _r([1, 5, 6], [8], [-0.3], [5])]]
    b = build_batch(g, [[1.0, 0.0]], pad_id=0)
    assert b.tokens.tolist() == [[1, 5, 6, 7, 2], [1, 5, 6, 8, 0]]
    # index t scores token t+1: the response starts predicting at the prompt's last index
    assert b.loss_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0]]
    torch.testing.assert_close(
        b.behaviour_logprobs, torch.tensor([[0, 0, -0.1, -0.2, 0], [0, 0, -0.3, 0, 0]])
    )
    assert b.versions.tolist() == [[-1, -1, 4, 5, -1], [-1, -1, 5, -1, -1]]
    torch.testing.assert_close(
        centred(b).advantages, torch.tensor([[0, 0, 0.5, 0.5, 0], [0, 0, -0.5, 0, 0]])
    )
    assert b.rewards.tolist() == [1.0, 0.0]


def test_an_environments_tokens_are_in_the_sequence_and_out_of_the_loss():
    """A multi-turn trajectory: turn, observation, turn. Observation tokens carry log-prob
    0 and the version of the turn they answer; only sampled tokens are trained on."""
    r = Rollout([1, 5], SamplingParams(max_new_tokens=8), 0, 0)
    r.append([7, 2], [-0.1, -0.2], [3, 3], "stop")  # turn 1 ends with its stop token
    r.observe([40, 41])
    assert (r.finished, r.observed, r.versions) == (False, [[2, 2]], [3, 3, 3, 3])
    with pytest.raises(RequestError, match="only a turn that ended can be answered"):
        r.observe([1])  # the next turn has not been generated yet
    r.append([9, 2], [-0.3, -0.4], [4, 4], "stop")
    other = Rollout([1, 5], SamplingParams(max_new_tokens=8), 1, 0)
    other.append([8, 2], [-0.5, -0.6], [4, 4], "stop")
    b = build_batch([[r, other]], [[1.0, 0.0]])
    assert b.tokens[0].tolist() == [1, 5, 7, 2, 40, 41, 9, 2]
    # index t scores token t+1: tokens 40 and 41 (indices 3 and 4) are not trained on
    assert b.loss_mask[0].tolist() == [0, 1, 1, 0, 0, 1, 1, 0]
    assert b.behaviour_logprobs[0, 3:5].tolist() == [0.0, 0.0]
    assert (centred(b).advantages[0] * (1 - b.loss_mask[0])).abs().sum() == 0
    cut = Rollout([1], SamplingParams(max_new_tokens=4), 0, 0)
    cut.append([7, 2], [-0.1, -0.2], [0, 0], "stop")
    with pytest.raises(RequestError, match="leave no room in max_new_tokens=4"):
        cut.observe([40, 41])


def test_overlong_responses_are_kept_masked_or_penalised():
    """A response cut by max_new_tokens: keep trains on it, mask removes its tokens from
    the loss (its reward still sets the group's baseline), penalise replaces its reward."""
    g = [[_r([1, 5], [7, 2]), _r([1, 5], [8, 9], finish="length"), _r([1, 5], [6, 2])]]
    keep = build_batch(g, [[1.0, 1.0, 0.0]])
    assert keep.overlong.tolist() == [0.0, 1.0, 0.0]
    assert keep.loss_mask[1].tolist() == [0, 1, 1, 0]
    assert keep.rewards.tolist() == [1.0, 1.0, 0.0]
    masked = build_batch(g, [[1.0, 1.0, 0.0]], overlong="mask")
    assert masked.loss_mask[1].tolist() == [0, 0, 0, 0]
    assert masked.loss_mask[0].tolist() == [0, 1, 1, 0]
    torch.testing.assert_close(
        centred(masked).advantages, centred(keep).advantages * masked.loss_mask
    )
    pen = build_batch(g, [[1.0, 1.0, 0.0]], overlong="penalise",
                      overlong_penalty=-1.0)  # fmt: skip
    assert pen.rewards.tolist() == [1.0, -1.0, 0.0]
    # group mean 0: advantages are the rewards themselves
    assert centred(pen).advantages[:, 1].tolist() == [1.0, -1.0, 0.0]
    with pytest.raises(ValueError, match=r"algorithm\.overlong='drop'"):
        build_batch(g, [[1.0, 1.0, 0.0]], overlong="drop")


def test_batch_fixed_length_and_errors():
    g = [[_r([1, 2], [3]), _r([1, 2], [4])]]
    assert build_batch(g, [[1, 0]], seq_len=6).tokens.shape == (2, 6)
    with pytest.raises(ValueError, match="seq_len=2 is shorter"):
        build_batch(g, [[1, 0]], seq_len=2)
    with pytest.raises(ValueError, match="same number of samples"):
        build_batch([[_r([1], [2])], [_r([1], [2]), _r([1], [3])]], [[1], [1, 0]])
    bad = _r([1], [2, 3], [-0.1], [1, 1])
    with pytest.raises(ValueError, match="2 tokens, 1 log-probs"):
        build_batch([[bad, _r([1], [2])]], [[1, 0]])


def test_admit_drops_groups_older_than_the_bound():
    gate = StalenessGate(max_lag=1, mode="drop")
    assert gate.admit([5, 5], trainer_version=5)  # lag 0
    assert gate.admit([4, 5], trainer_version=5)  # partial rollout: oldest token counts
    assert not gate.admit([3, 5], trainer_version=5)  # lag 2 > 1
    assert gate.dropped == 1 and gate.histogram == {0: 1, 1: 1}
    with pytest.raises(ValueError, match="newer than the trainer"):
        gate.admit([6], trainer_version=5)


def _simulate(gate: StalenessGate, steps: int, gen_per_tick: int) -> list[int]:
    """A generator that can finish ``gen_per_tick`` groups while the trainer takes a step,
    under the gate; returns the lag of every group the trainer used (groups finish in the
    order they started)."""
    first = version = 10
    started: list[int] = []  # start version of each group not yet consumed
    n_started = consumed = 0
    lags = []
    for _ in range(steps):
        taken = 0
        while taken < gate.per_step:  # the step's batch (the generator fills any gap)
            if not started:
                assert gate.may_start(n_started, consumed, version, first), "deadlock"
                started.append(version)
                n_started += 1
            v = started.pop(0)
            consumed += 1
            if gate.admit([v], version):
                lags.append(version - v)
                taken += 1
        for _ in range(gen_per_tick):  # generation while the trainer trains
            if gate.may_start(n_started, consumed, version, first):
                started.append(version)
                n_started += 1
        version += 1  # the new weights are committed
    return lags


@pytest.mark.parametrize("k", [0, 1, 2])
def test_throttle_never_lets_a_group_get_too_old(k):
    gate = StalenessGate(max_lag=k, mode="throttle", per_step=4)
    lags = _simulate(gate, steps=20, gen_per_tick=100)  # a generator far faster than training
    assert len(lags) == 80 and max(lags) == k and gate.dropped == 0
    # The generator ran exactly k steps ahead: after the start, every batch has lag k.
    assert lags[4 * k :] == [k] * (80 - 4 * k)


def test_throttle_k0_is_synchronous():
    gate = StalenessGate(max_lag=0, mode="throttle", per_step=2)
    assert gate.may_start(1, 0, committed=3, first=3)
    assert not gate.may_start(2, 0, committed=3, first=3)  # step 2 waits for version 4
    assert gate.may_start(2, 2, committed=4, first=3)


def test_drop_mode_runs_ahead_and_drops_what_got_too_old():
    gate = StalenessGate(max_lag=1, mode="drop", per_step=4)
    lags = _simulate(gate, steps=20, gen_per_tick=100)
    assert len(lags) == 80 and max(lags) <= 1
    assert gate.dropped > 0  # the price of never making the generator wait


def test_drop_mode_window_counts_unconsumed_groups():
    gate = StalenessGate(max_lag=1, mode="drop", per_step=3)
    assert gate.may_start(5, 0, committed=0, first=0)
    assert not gate.may_start(6, 0, committed=0, first=0)
    assert gate.may_start(6, 1, committed=0, first=0)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"max_lag": -1}, "max_policy_lag=-1"),
        ({"max_lag": 1, "mode": "wait"}, "stale"),
        ({"max_lag": 1, "per_step": 0}, "per_step=0"),
    ],
)
def test_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        StalenessGate(**kw)


def _cfg(**roles):
    cfg = composed(["rl.steps=5", *[f"cluster.roles.{k}={v}" for k, v in roles.items()]])
    return cfg


def test_role_map_order_and_lookup():
    roles = RoleMap.from_config(
        composed(["rl.steps=5", "rollout.servers=2", "cluster.roles.generator=2"])
    )
    assert roles.ranks("controller") == [0]
    assert roles.ranks("trainer") == [1, 2]
    assert roles.ranks("generator") == [3, 4]
    assert roles.ranks("reward") == [5]
    assert roles.world_size == 6
    assert roles.role_of(2) == ("trainer", 1)
    assert roles.role_of(5) == ("reward", 0)
    with pytest.raises(RoleError, match="rank 6 is outside"):
        roles.role_of(6)


def test_role_map_must_cover_the_launched_world():
    roles = RoleMap.from_config(_cfg())
    roles.check_world(5)
    with pytest.raises(RoleError) as info:
        roles.check_world(4)
    assert "started 4 ranks" in str(info.value)
    assert "controller 1 + trainer 2 + generator 1 + reward 1 = 5 ranks" in str(info.value)


def test_role_map_rejects_missing_executors():
    with pytest.raises(RoleError, match=r"cluster.roles.reward=0: rl.steps=5 needs"):
        RoleMap.from_config(_cfg(reward=0))
    with pytest.raises(RoleError, match=r"rollout.servers=1 is not a multiple"):
        RoleMap.from_config(_cfg(generator=2))
    # Warm-up only: no generator, no reward.
    cfg = composed(["rl.steps=0", "cluster.roles.generator=0", "cluster.roles.reward=0"])
    assert RoleMap.from_config(cfg).world_size == 3
    # The same without setting the roles: a warm-up-only run starts neither.
    assert RoleMap.from_config(composed(["rl.steps=0"])).world_size == 3


def test_uniform_groups_are_skipped_counted_and_replaced():
    """Dynamic sampling: a group whose rewards are all equal has no advantage; the stream
    skips it, counts it, and the batch is refilled with groups that carry signal."""
    from concurrent.futures import Future

    from rl.config.sampling import SamplingParams
    from rl.controller.rollouts import RolloutStream
    from rl.tasks.common import Example
    from rl.tasks.scoring import ScoreResult

    def score(group):  # prompts with an even first id: every sample scores 1 (uniform)
        uniform = group.item.prompt_ids[0] % 2 == 0
        f: Future = Future()
        f.set_result([ScoreResult(1.0 if uniform else float(k % 2)) for k in range(4)])
        return f

    prompts = (Example(f"p{i}", (i, 7), "") for i in range(1000))
    gate = StalenessGate(max_lag=1, mode="throttle", per_step=3)
    stream = RolloutStream(InstantClient(), score, lambda: next(prompts),
                           SamplingParams(n=4), gate=gate, version=1,
                           drop_uniform=lambda g: len(set(g.rewards)) == 1)  # fmt: skip
    stream.start()
    try:
        groups, stats = stream.next_batch(1)
    finally:
        stream.close()
    assert [g.item.prompt_ids[0] % 2 for g in groups] == [1, 1, 1]
    assert all(len(set(g.rewards)) == 2 for g in groups)
    assert stats["uniform_skipped_total"] >= 3 and gate.skipped == stats["uniform_skipped_total"]


def test_a_stream_of_nothing_but_uniform_groups_warns_then_stops(capsys):
    """Every response cut by length: every group is uniform, so no batch can fill. The
    stream says so once, with what to change, then fails instead of resampling forever."""
    from concurrent.futures import Future

    from rl.config.sampling import SamplingParams
    from rl.controller.rollouts import RolloutStream, UniformStall
    from rl.tasks.common import Example
    from rl.tasks.scoring import ScoreResult

    class _CutClient(InstantClient):
        def started(self, f, r, segment_tokens):
            super().started(f, r, segment_tokens)
            r.finish_reason = "length"

    def score(group):
        f: Future = Future()
        f.set_result([ScoreResult(0.0) for _ in range(2)])
        return f

    prompts = (Example(f"p{i}", (i + 1, 7), "") for i in range(10_000))
    gate = StalenessGate(max_lag=1, mode="throttle", per_step=2)
    stream = RolloutStream(_CutClient(), score, lambda: next(prompts),
                           SamplingParams(n=2, max_new_tokens=8), gate=gate, version=1,
                           drop_uniform=lambda g: len(set(g.rewards)) == 1)  # fmt: skip
    stream.uniform_warn, stream.uniform_fail = 5, 40
    stream.start()
    try:
        with pytest.raises(UniformStall) as e:
            stream.next_batch(1)
    finally:
        stream.close()
    said = capsys.readouterr().out
    assert said.count("groups in a row carried no signal") == 1, said
    assert "5 groups in a row" in said
    assert str(e.value).startswith("40 groups in a row carried no signal: every response was "
                                   "cut at rollout.sampling.max_new_tokens=8; raise")  # fmt: skip
    from rl.runtime.launch import failure_text  # how the controller rank reports it

    assert failure_text(UniformStall, e.value, e.value.__traceback__) == f"UniformStall: {e.value}"


def test_a_resumed_stream_never_reuses_an_earlier_attempts_rollout_ids():
    """Each attempt's process counts ids from 0: a stream resumed at step 3 prefixes its
    new rollouts' ids with the step, so the run's ledger never holds one id twice."""
    from concurrent.futures import Future

    from rl.config.sampling import SamplingParams
    from rl.controller.rollouts import RolloutStream, StreamState
    from rl.tasks.common import Example
    from rl.tasks.scoring import ScoreResult

    def score(group):
        f: Future = Future()
        f.set_result([ScoreResult(float(k % 2)) for k in range(2)])
        return f

    def batch(restore: StreamState | None) -> list[str]:
        prompts = (Example(f"p{i}", (i + 1, 7), "") for i in range(100))
        gate = StalenessGate(max_lag=1, mode="throttle", per_step=2)
        stream = RolloutStream(InstantClient(), score, lambda: next(prompts),
                               SamplingParams(n=2), gate=gate, version=3)  # fmt: skip
        if restore is not None:
            stream.restore(restore)
        stream.start()
        try:
            groups, _ = stream.next_batch(1)
        finally:
            stream.close()
        return [r.rid for g in groups for r in g.rollouts]

    import rl.generator.types as types

    types._ids = itertools.count()  # what a fresh attempt's process starts from
    first = batch(None)
    types._ids = itertools.count()
    resumed = batch(StreamState(step=3, version=3, drawn=2, position={}, groups=[]))
    assert len(first) == len(resumed) == 4
    assert all(rid.startswith("s3.") for rid in resumed), resumed
    assert not set(first) & set(resumed), (first, resumed)


def test_a_group_is_uniform_after_the_overlong_rule():
    """Raw rewards that differ carry no signal when ``penalise`` gives every sample the same
    penalty (all cut by length), or when ``mask`` takes every sample out of the loss."""
    from rl.config.sampling import SamplingParams
    from rl.controller.batch import build_batch, no_signal
    from rl.generator.types import Rollout

    def group(reasons):
        out = []
        for i, why in enumerate(reasons):
            r = Rollout([1, 2], SamplingParams(n=len(reasons), max_new_tokens=2), i, 0)
            r.append([5, 6], [-0.1, -0.2], [0, 0], why)
            out.append(r)
        return out

    cut, mixed = group(["length"] * 3), group(["length", "stop", "stop"])
    raw = [0.1, 0.2, 0.3]
    assert no_signal(cut, raw, "penalise", 0.0)
    b = build_batch([cut], [raw], overlong="penalise", overlong_penalty=0.0)
    assert centred(b).advantages.abs().max() == 0  # what no_signal predicts
    assert not no_signal(cut, raw, "keep", 0.0)
    assert no_signal(cut, raw, "mask", 0.0)
    assert not no_signal(mixed, raw, "penalise", 0.0) and not no_signal(mixed, raw, "mask", 0.0)
    assert no_signal(mixed, [0.5, 0.5, 0.5], "keep", 0.0)


def test_the_ledger_places_every_drawn_group_once_wherever_the_run_ends(tmp_path):
    """Groups trained on, skipped (no signal), dropped (too old) and, when the run ends,
    those still generating or queued: each drawn group is in exactly one place of the
    records (rollout_state.log_trained), whatever was in flight at the end."""
    import time
    from concurrent.futures import Future

    from rl.config.sampling import SamplingParams
    from rl.controller import rollout_state
    from rl.controller.rollouts import RolloutStream
    from rl.tasks.common import Example
    from rl.tasks.scoring import ScoreResult
    from tests.helpers.ledger import ledger, where_each_group_went

    class _Client(InstantClient):  # prompts 5, 10, ...: still on a server when the run ends
        version = 1

        def started(self, f, r, segment_tokens):
            if r.prompt_ids[0] % 5:
                r.append([r.prompt_ids[0]], [-0.1], [self.version], "stop")
                f.set_result(r)

    def score(group):  # even prompts: every sample right, no signal
        f: Future = Future()
        uniform = group.item.prompt_ids[0] % 2 == 0
        f.set_result([ScoreResult(1.0 if uniform else float(k)) for k in range(2)])
        return f

    client = _Client()
    prompts = (Example(f"p{i}", (i, 7), "") for i in range(1, 1000))
    gate = StalenessGate(max_lag=1, mode="throttle", per_step=2)
    stream = RolloutStream(
        client,
        score,
        lambda: next(prompts),
        SamplingParams(n=2),
        gate=gate,
        version=1,
        drop_uniform=lambda g: len(set(g.rewards)) == 1,
    )
    stream.start()
    try:
        groups, _ = stream.next_batch(1)  # p1, p3; p5 never ends, p7 waits under version 1
        rollout_state.log_trained(tmp_path, 1, groups, (), stream.take_set_aside())
        deadline = time.monotonic() + 10
        while stream.started - gate.skipped < 4:  # the throttle's budget at version 1
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client.version = 3
        stream.commit(3)  # two pushes later: p7 is too old, newer groups are not
        groups, _ = stream.next_batch(3)
        rollout_state.log_trained(tmp_path, 2, groups, (), stream.take_set_aside())
    finally:
        stream.close()
    held = stream.snapshot().groups
    rollout_state.log_trained(tmp_path, 3, [], (), stream.take_set_aside(), held)
    places = where_each_group_went(ledger(tmp_path))
    assert len(places) == stream.drawn
    assert set(places.values()) == {"groups", "skipped", "dropped", "leftover"}
    assert gate.dropped == sum(p == "dropped" for p in places.values()) >= 1
