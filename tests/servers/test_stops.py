"""How the RL job (`python -m rl.train`, real SGLang) ends when it does not end by itself.

Two runs of one job in one run directory, in order (the second resumes from the
checkpoint the first saved, so only the first warms up):

1. a trainer rank is SIGKILLed after a checkpoint save: the job fails within seconds with
   one error naming "trainer rank 1" and its last lines;
2. SIGINT (Ctrl-C) to the top process: every rank and server ends within seconds, one
   line says what was stopped and which RL step is saved, and the exit code is 130.
   SIGTERM takes the same path in the launcher (``rl.runtime.launch._stop_signals``);
   its exit code, 143, and its one line are tests/multiproc/test_spawn_failures.py's.

After each, no process started by the job is left (found by an environment tag every
descendant inherits, whatever session or group it moved to), nor anything its servers
made in /dev/shm (their guards, which unlink it, are killed too: the launcher does).
Between runs, the resumed run's metrics hold each RL step once.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.procs import TaggedJob, assert_tagged_gone
from tests.helpers.procs import state_step as _state_step

ROOT = Path(__file__).resolve().parents[2]
TAG = "MSRL_TEST_STOPS"
ARGS = [
    "sft.steps=5", "sft.eval_every=5", "task.eval_size=16", "rl.prompts_per_step=8",
    "rl.steps=200", "rl.eval_every=0", "rl.save_interval=1",
]  # fmt: skip
STOP_S = 10.0  # "within seconds", with room for a machine busy with other tests


def Job(out: Path) -> TaggedJob:
    return TaggedJob(out, ARGS, TAG)


def _shm_loads() -> set[str]:
    """SGLang's load snapshots in /dev/shm (a server makes one as it starts)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("sglang_loads_")}


def _rl_steps(out: Path) -> list[int]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    return [r["step"] for r in recs if r["phase"] == "rl"]


def _tb_counts(out: Path) -> Counter:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    seen: Counter = Counter()
    for f in (out / "tensorboard").glob("events.out.tfevents.*"):
        for ev in EventFileLoader(str(f)).Load():
            for v in ev.summary.value:
                seen[(v.tag, ev.step)] += 1
    return seen


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stops") / "run"


def test_1_a_killed_trainer_rank_fails_the_job_naming_it(run_dir):
    before = _shm_loads()
    job = Job(run_dir)
    job.wait_for(lambda: _state_step(run_dir) >= 1, "a first RL checkpoint")
    assert _shm_loads() - before, "the server made no load snapshot to leave behind"
    victim = job.rank("msrl:trainer:1")
    t0 = time.monotonic()
    victim.kill()
    job.ended(STOP_S)
    took = time.monotonic() - t0
    assert job.proc.returncode == 1, "\n".join(job.err[-40:])
    first = next(i for i, x in enumerate(job.err) if x.startswith("error: "))
    assert job.err[first] == "error: trainer rank 1 was killed by SIGKILL (exited with code -9)"
    assert job.err[first + 1] == "last lines of trainer rank 1:"
    assert not any("Traceback" in x for x in job.err), "\n".join(job.err)
    saved = f"(every rank stopped; saved: RL step {_state_step(run_dir)} in "
    assert job.err[-1].startswith(saved), job.err[-1]
    assert took < STOP_S
    assert_tagged_gone(TAG, job.tag)  # its Manager and resource tracker included
    assert _shm_loads() <= before


def test_2_ctrl_c_stops_every_rank_and_server_with_one_line(run_dir):
    start = _state_step(run_dir)
    assert start >= 1, "the first test leaves a checkpoint to resume from"
    before = _shm_loads()
    job = Job(run_dir)
    job.wait_for(lambda: f"resuming from RL step {start} " in " ".join(job.out), "the resume")
    job.wait_for(lambda: _state_step(run_dir) > start, "a checkpoint after the resume")
    job.wait_for(lambda: any(x.startswith("[rl] step") for x in job.out), "a logged step")
    quiet = len(job.err)
    job.proc.send_signal(signal.SIGINT)
    took = job.ended(STOP_S)
    assert job.proc.returncode == 130, "\n".join(job.err[-40:])
    after = job.err[quiet:]
    assert len(after) == 1, "\n".join(after)
    saved = _state_step(run_dir)
    assert after[0].startswith("stopped by SIGINT in "), after
    assert "5 ranks, 1 SGLang server, " in after[0], after
    assert after[0].endswith(f"saved: RL step {saved} in {run_dir / 'checkpoint'} "
                             "(a restart resumes there)"), after  # fmt: skip
    assert took < STOP_S, took
    assert_tagged_gone(TAG, job.tag)
    assert _shm_loads() <= before
    # Each RL step once, although this run logged again what the last one had after its
    # checkpoint (the run stopped here may have logged past its own last checkpoint).
    steps = _rl_steps(run_dir)
    assert steps == sorted(set(steps)) and steps[0] == 1, steps
    assert max(_tb_counts(run_dir).values()) == 1
    assert not list(run_dir.glob("checkpoint.*")), list(run_dir.iterdir())
