"""A killed RL job resumed in its run dir keeps its rollouts and its prompt stream.

The tiny default job (real SGLang, DDMA, reward ranks) with 1-token segments, so samples
are often parked or on a server, and an RL checkpoint every step. It is SIGKILLed (the
whole process group, as a node failure would) as soon as a checkpoint holds partial
samples; within a grace period no process of it may be left, found by the job's mark
(MSRL_SPAWN_MARK) whatever its command line, such as a multiprocessing helper of a rank.
It is then started again with the same arguments. The second attempt must resume the
checkpoint's parked and in-flight samples from their saved tokens (same tokens, behaviour
log-probs and versions; newer versions after), train on every prompt of the one prompt
stream exactly once across both attempts, and log each step once.

With ``rl.deterministic=true`` more holds: a killed-and-resumed run ends bit-equal to an
uninterrupted one (samples, logged numbers, checkpoint bytes; tools/compare_runs.py), and
writes its rollout ledger but for what the resume adds to the groups it carried over.
That job runs every model role beside the policy, each on a rank of its own (a critic, a
reward model, a teacher: their figures checked against transformers and GAE written
out), and its killed attempt is its critic rank's SIGKILL, which ends the job in one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest
import torch

from rl.generator import routing
from rl.runtime.supervise import MARK_ENV
from tests.helpers.ledger import as_if_uninterrupted, where_each_group_went
from tests.helpers.model_roles import (
    gae_by_hand,
    hf_logprobs,
    hf_sequence_scores,
    make_reward_model,
    make_teacher,
)
from tests.helpers.procs import live_tagged

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
STEPS = 12
ARGS = ["sft.steps=5", "sft.eval_every=5", "task.eval_size=32", "rl.prompts_per_step=8",
        f"rl.steps={STEPS}", "rl.eval_every=0", "rl.save_interval=1",
        "rollout.segment_tokens=1"]  # fmt: skip
# The killed job's: a checkpoint holds a parked sample only when the next batch is still
# generating at the save, so its batches are longer (16 prompts) and so are its answers
# (up to 16 tokens, which a 5-step warm-up often runs to). Measured over the 12 saves of
# one job: 6 held parked samples; with the ARGS above, 1 of 12 did, or none.
KILLED = [*(a for a in ARGS if not a.startswith("rl.prompts_per_step")),
          "rl.prompts_per_step=16", "rollout.sampling.max_new_tokens=16"]  # fmt: skip
# And it is the tiny MoE with routing replay (async, a lag of 1, partial rollouts): the
# routing the servers gave the parked samples is saved and trained on after the resume.
KILLED += ["model=tiny_moe", "algorithm.routing_replay=true", "trainer.tp=1", "trainer.dp=2",
           "trainer.ep=2", "trainer.micro_batch_size=16", "rl.save_batches=true"]  # fmt: skip


def _parked_in_checkpoint(out: Path) -> bool:
    """Does the newest RL checkpoint's rollout state hold a sample cut mid-response? The
    generator may have finished every sample by the time a checkpoint is taken (it runs
    at most one version ahead and then waits), so the test waits for one that did not."""
    try:
        point = json.loads((out / "rl_state.json").read_text())
        state = json.loads((out / point["rollouts"]).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return any(r["finish_reason"] is None and r["output_ids"]
               for g in state["groups"] for r in g["rollouts"])  # fmt: skip


def _start(out: Path, log: Path, args: list[str] = ARGS) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "rl.train", *args, f"run.output_dir={out}"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=f,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def _kill_leftovers(out: Path) -> list[int]:
    """The run's processes still alive after its group was killed (servers are in
    sessions of their own): killed by their run dir, which is on their command line."""
    deadline, left = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        left = [p for p in psutil.process_iter(["cmdline"])
                if str(out) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
        if not left:
            return []
        time.sleep(0.5)
    for p in left:
        p.kill()
    return [p.pid for p in left]


def _job_mark(out: Path) -> str:
    """The job's MSRL_SPAWN_MARK, read from its processes that name the run dir (an SGLang
    server and its guard): the launcher makes it up, and every process a rank starts
    inherits it, whatever its command line (a multiprocessing helper's names no run dir)."""
    marks = set()
    for p in psutil.process_iter(["cmdline"]):
        if str(out) in " ".join(p.info["cmdline"] or []):
            try:
                marks.add(p.environ().get(MARK_ENV))
            except psutil.Error:
                continue
    marks.discard(None)  # the launcher (the mark is made up inside it) and the ranks
    assert len(marks) == 1, f"no single job mark on the run's processes: {marks}"
    return marks.pop()


def _kill_marked(mark: str, grace_s: float = 30.0) -> list[str]:
    """Processes of the job (carrying its mark) still alive ``grace_s`` after its
    launcher was SIGKILLed; each is killed, so that later tests do not inherit it."""
    deadline = time.monotonic() + grace_s
    while (left := live_tagged(MARK_ENV, mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for line in left:
        with contextlib.suppress(psutil.Error):
            psutil.Process(int(line.split()[0])).kill()
    return left


def _kill_at(
    job: subprocess.Popen, out: Path, log: Path, step: int = 0, rank: str | None = None
) -> float:
    """SIGKILL ``job`` right after a checkpoint (of ``step`` or later) that holds partial
    samples, and check that none of its processes outlives it. The whole process group,
    as a node failure would; or with ``rank`` (a process title) only that rank, and the
    job must end by itself. Returns the seconds from the kill to the job's end."""
    mark = None
    try:
        deadline = time.monotonic() + 900
        while not (_parked_in_checkpoint(out) and _saved_step(out) >= step):
            assert job.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint with partial samples"
            time.sleep(0.05)
        mark = _job_mark(out)
        t0 = time.monotonic()
        if rank is not None:
            _rank(job.pid, rank).kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        took = time.monotonic() - t0 if mark else float("inf")
        marked = _kill_marked(mark, 5.0 if rank else 30.0) if mark else []
    assert _kill_leftovers(out) == [], "a SIGKILLed job left processes behind"
    assert marked == [], f"a SIGKILLed job left processes behind: {marked}"
    return took


def _rank(pid: int, title: str) -> psutil.Process:
    """The job's rank whose process title starts with ``title``."""
    for p in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if " ".join(p.cmdline()).startswith(title):
                return p
    raise AssertionError(f"no rank of the job is titled {title!r}")


def _saved_step(out: Path) -> int:
    try:
        return int(json.loads((out / "rl_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


@pytest.mark.long(
    reason="two launches of the MoE job at EP=2 (its ranks and server started twice), the "
    "first run until a checkpoint holds cut samples: 107-171 s measured"
)
def test_a_killed_job_resumes_its_parked_rollouts_and_its_prompt_stream(tmp_path):
    from rl.tasks.kinds.arithmetic import ArithmeticTask

    out = tmp_path / "run"
    _kill_at(_start(out, tmp_path / "attempt1.log", KILLED), out, tmp_path / "attempt1.log")
    point = json.loads((out / "rl_state.json").read_text())
    resumed_from = point["step"]
    saved = json.loads((out / point["rollouts"]).read_text())
    shutil.copy(out / point["rollouts"], tmp_path / "saved_state.json")
    parked = {r["rid"]: r for g in saved["groups"] for r in g["rollouts"]
              if r["finish_reason"] is None and r["output_ids"]}  # fmt: skip
    assert parked, "the checkpoint holds no partial rollout to resume"
    prompts = {
        r["rid"]: len(g["item"]["prompt_ids"]) for g in saved["groups"] for r in g["rollouts"]
    }

    log2 = tmp_path / "attempt2.log"
    second = _start(out, log2, KILLED)
    try:
        assert second.wait(timeout=900) == 0, log2.read_text()[-4000:]
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
        _kill_leftovers(out)
    text = log2.read_text()
    assert f"resuming from RL step {resumed_from}" in text

    # Every step once; the first resumed step reports what the state carried over.
    steps = [r for r in _jsonl(out / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    carried = steps[resumed_from]
    assert carried["resume_rollouts"] >= 1 and carried["resume_dropped_groups"] == 0
    assert carried["resume_groups"] == len(saved["groups"])
    for r in steps:  # the trainer's router agrees with the servers' on most (token, layer)s
        assert 0.5 < r["routing_agreement"] <= 1 and r["routing_dropped"] == 0, r

    # The resumed samples kept their saved tokens, log-probs and versions; later tokens
    # come from the resumed job's versions (its first is resumed_from + 1).
    trained = _jsonl(out / "trained_prompts.jsonl")
    assert [r["step"] for r in trained] == list(range(1, STEPS + 1))
    rids = [rid for rec in trained for g in rec["groups"] for rid in g["rids"]]
    assert len(set(rids)) == len(rids), "a rollout id was used again by the resumed attempt"
    finished = {
        r["rid"].rsplit("@", 1)[0]: r
        for rec in trained
        for g in rec["groups"]
        if g.get("restored_at") == resumed_from
        for r in g["rollouts"]
    }
    checked = 0
    rows = _batch_rows(out, trained)
    for rid, s in parked.items():
        if rid not in finished:
            continue  # its group is not trained yet (still in the final state)
        f, n = finished[rid], len(s["output_ids"])
        assert f["output_ids"][:n] == s["output_ids"]
        assert f["logprobs"][:n] == s["logprobs"]
        assert f["versions"][:n] == [v for v, k in s["versions"] for _ in range(k)]
        assert len(f["output_ids"]) > n and min(f["versions"][n:]) > resumed_from
        # Trained with the routing saved for its prefix, not routed again after the resume.
        held = routing.from_json(s["routing"])
        assert held is not None and held.shape[0] == prompts[rid] + n - 1
        step, row = rows[f["rid"]]
        batch = torch.load(out / "batches" / f"step_{step:06d}.pt")
        assert torch.equal(batch["routing"][row, : held.shape[0]], held)
        checked += 1
    assert checked >= 1
    print(f"resumed from step {resumed_from}: {len(saved['groups'])} groups, "
          f"{int(carried['resume_rollouts'])} samples resumed ({len(parked)} with tokens), "
          f"{checked} of those trained with their prefixes")  # fmt: skip

    # One prompt stream: every prompt drawn is trained on once, or waits in the final
    # state; the order is the task's own, as if never interrupted.
    final = json.loads(
        (out / json.loads((out / "rl_state.json").read_text())["rollouts"]).read_text()
    )
    places = where_each_group_went(trained)  # none twice, none recorded nowhere
    assert len(places) == final["drawn"]
    waiting = sorted(g["index"] for g in final["groups"])
    assert sorted(i for i, p in places.items() if p == "leftover") == waiting
    stream = ArithmeticTask(2, seed=0, eval_size=32).train_stream()
    uids = [next(stream).uid for _ in range(final["drawn"])]
    assert all(uids[g["index"]] == g["uid"] for rec in trained for g in rec["groups"])


def _batch_rows(out: Path, trained: list[dict]) -> dict[str, tuple[int, int]]:
    """Each trained rollout's step and row in that step's saved batch (its groups' order)."""
    where = {}
    for rec in trained:
        rids = [rid for g in rec["groups"] for rid in g["rids"]]
        where.update({rid: (rec["step"], i) for i, rid in enumerate(rids)})
    return where


def test_resume_never_refuses_a_run_dir_that_holds_a_resume_point(tmp_path):
    """rl.resume=never starts fresh; over a run that has a resume point it would destroy
    that run's checkpoints and logs, so it refuses in one line before any rank starts."""
    from rl.checkpoints import resume

    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "metadata.json").write_text("{}")
    resume.write(tmp_path, resume.ResumePoint(2, str(tmp_path / "checkpoint"), 0.1, None))
    res = subprocess.run(
        [sys.executable, "-m", "rl.train", "rl.resume=never", f"run.output_dir={tmp_path}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"resume error: rl.resume=never but {tmp_path}/rl_state.json holds")
    assert "starting" not in res.stdout


# A deterministic run (rl.deterministic): async with lag 1, two servers, 2-token segments,
# with every model role on a rank of its own beside the policy: a critic (PPO's GAE from
# its values), a reward model weighed with the rule's reward (reward.combine) and a
# teacher (algorithm.distill_coef). The reward model's scores give every group a signal,
# so every step moves the weights. Whitening off, so the logged advantages are GAE's own.
DETERMINISTIC = ["sft.steps=5", "sft.eval_every=5", "task.eval_size=32",
                 "rl.prompts_per_step=8", "rl.steps=4", "rl.eval_every=2", "rl.save_interval=2",
                 "rollout.segment_tokens=2", "rollout.servers=2", "rl.deterministic=true",
                 "algorithm.drop_uniform_groups=true", "rl.save_batches=true",
                 "critic=tiny", "algorithm/advantage=gae", "algorithm.advantage.whiten=false",
                 "critic.epochs=2", "critic.minibatches=2", "critic.trainer.micro_batch_size=32",
                 "reward_model=cpu", "reward_model.normalize=none", "reward.combine.rule=1",
                 "reward.combine.model=0.5", "teacher=cpu",
                 "algorithm.distill_coef=0.1"]  # fmt: skip
W_MODEL, DISTILL = 0.5, 0.1
STOP_S = 10.0  # a killed rank ends the job "within seconds", on a machine busy with others


class Deterministic(NamedTuple):
    a: Path  # the uninterrupted run
    b: Path  # the run killed after step 2's checkpoint (its critic rank) and resumed
    killed_log: str  # the killed attempt's output
    killed_took: float  # seconds from the critic rank's SIGKILL to the job's end
    reward_model: Path
    teacher: Path


@pytest.fixture(scope="module")
def deterministic(tmp_path_factory) -> Deterministic:
    """Two runs of the same job, the second's critic rank SIGKILLed right after step 2's
    checkpoint (while samples are cut mid-response), then resumed; each started as a
    user starts it. Three starts of the ranks and two SGLang servers, one after the other
    (side by side on two cores they took longer)."""
    root = tmp_path_factory.mktemp("deterministic")
    rm, teacher = make_reward_model(root / "rm"), make_teacher(root)
    args = [*DETERMINISTIC, f"reward_model.hf_checkpoint={rm}", f"teacher.hf_checkpoint={teacher}"]
    a, b = root / "a", root / "b"
    jobs = [_start(a, root / "a.log", args)]
    try:
        assert jobs[0].wait(timeout=900) == 0, (root / "a.log").read_text()[-4000:]
        jobs.append(_start(b, root / "b1.log", args))
        took = _kill_at(jobs[1], b, root / "b1.log", step=2, rank="msrl:critic:0")
        assert _saved_step(b) == 2
        jobs.append(_start(b, root / "b2.log", args))
        assert jobs[2].wait(timeout=900) == 0, (root / "b2.log").read_text()[-4000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
        _kill_leftovers(a), _kill_leftovers(b)
    assert "resuming from RL step 2" in (root / "b2.log").read_text()
    return Deterministic(a, b, (root / "b1.log").read_text(), took, rm, teacher)


def test_a_deterministic_job_repeats_and_resumes_bit_for_bit(deterministic):
    """Every step trains the same prompts on the same samples (tokens, log-probs,
    versions), logs the same numbers (timings aside), and the final weights, the
    policy's and the critic's, are bit-equal. The ledgers too: the lines the second run's
    first attempt wrote are the first run's byte for byte, and the resumed attempt's are
    once what a resume adds to the groups it carried over is out."""
    from compare_runs import compare, metrics  # tools/compare_runs.py
    from compare_runs import tensors as compare_files

    a, b = deterministic.a, deterministic.b
    steps = [r for r in metrics(a) if r["phase"] == "rl"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 and r["critic_grad_norm"] > 0 for r in steps)  # both move
    assert {k.split("/")[0] for k in compare_files(a)} == {"checkpoint", "checkpoint_critic"}
    assert compare(a, b) == {"samples": None, "metrics": None, "checkpoint": None}
    # The resumed attempt's carried-over groups: samples cut mid-response by the kill.
    resumed = [r for rec in _jsonl(b / "trained_prompts.jsonl") for g in rec["groups"]
               for r in g.get("rollouts", ())]  # fmt: skip
    assert any(len(set(r["versions"])) > 1 for r in resumed), "no sample spans two versions"
    ledger_a, ledger_b = (x / "trained_prompts.jsonl" for x in (a, b))
    lines_a, lines_b = ledger_a.read_text().splitlines(), ledger_b.read_text().splitlines()
    assert len(lines_a) == 4 and lines_b[:2] == lines_a[:2]  # uninterrupted up to its kill
    uninterrupted = "".join(as_if_uninterrupted(x) + "\n" for x in lines_b)
    assert uninterrupted.encode() == ledger_a.read_bytes()


def test_a_killed_critic_rank_ends_the_job_naming_it(deterministic):
    """Within seconds, one error line naming the rank, no traceback, and no process of
    the job left (checked by its mark as it was killed: ``_kill_at``)."""
    log = deterministic.killed_log
    first = next(x for x in log.splitlines() if x.startswith("error: "))
    assert first == "error: critic rank 0 was killed by SIGKILL (exited with code -9)", log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert deterministic.killed_took < STOP_S, deterministic.killed_took


def test_the_model_roles_score_as_transformers_and_gae_uses_the_critics_values(deterministic):
    """In the uninterrupted run, every step logs the critic's and the reward model's
    figures; every sample's reward is its rule score plus 0.5 times transformers' score of
    its sequence (``AutoModelForSequenceClassification``'s own pooling); the teacher's
    log-prob of every sampled token is transformers' (``AutoModelForCausalLM``); the
    advantages the trainer logged are GAE's formula (``gae_by_hand``) applied to the values
    and rewards of the batch the job saved, plus the distillation term
    ``coef * (log pi_teacher - log mu)``; the critic's checkpoint sits beside the policy's
    and the resume point names it. (Its LR ramp resumed, not restarted: the resumed run's
    metrics and critic checkpoint equal these, above.)"""
    run = deterministic.a
    recs = [r for r in _jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        for k in ("critic_loss", "critic_value_mean", "critic_grad_norm", "critic_values_s",
                  "reward_model_mean", "reward_model_std", "reward_rule", "teacher_logprobs_s",
                  "reward_model_s", "critic_step_seconds",
                  "adv_distill_kl"):  # fmt: skip
            assert k in r, k
        assert r["reward_model_all_pad"] == 0  # every sample has a BOS to score
    assert all(r["critic_updates"] == 4 for r in recs)  # 2 epochs of 2 minibatches
    assert all(r["critic_lag"] == 1 for r in recs)  # values from the critic one step behind
    lrs = [r["critic_lr"] for r in recs]
    assert lrs == sorted(lrs) and lrs[0] < lrs[-1]  # its own warm-up ramp
    for r in recs:
        b = torch.load(run / "batches" / f"step_{r['step']:06d}.pt")
        mask, values = b["loss_mask"], b["values"]
        assert values.abs().sum() > 0 and (values * (1 - mask)).abs().sum() == 0
        model = hf_sequence_scores(deterministic.reward_model, b["tokens"], mask)
        rule = b["rewards"] - W_MODEL * model
        assert ((rule - rule.round()).abs() < 1e-4).all(), rule  # 0 or 1, plus the model's
        assert set(rule.round().tolist()) <= {0.0, 1.0}
        assert r["reward_model_mean"] == pytest.approx(model.double().mean().item(), abs=1e-4)
        assert r["reward_rule"] == pytest.approx(rule.round().mean().item(), abs=1e-6)
        teacher = hf_logprobs(deterministic.teacher, b["tokens"]) * mask
        assert (b["teacher_logprobs"] - teacher).abs().max() < 1e-4
        dense = DISTILL * (b["teacher_logprobs"] - b["behaviour_logprobs"])
        adv = torch.tensor(gae_by_hand(b["rewards"].tolist(), values.tolist(), mask.tolist(),
                                       dense.tolist()))  # fmt: skip
        assert r["adv_mean"] == pytest.approx(adv.double().mean().item(), abs=1e-5)
        assert r["adv_std"] == pytest.approx(adv.double().std().item(), abs=1e-5)
    state = json.loads((run / "rl_state.json").read_text())
    assert state["companions"] == [str(run / "checkpoint_critic")]
    assert (run / "checkpoint_critic" / "metadata.json").is_file()
