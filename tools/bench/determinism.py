"""What ``rl.deterministic=true`` delivers and what it costs, on the tiny job on this CPU.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/determinism.py

The tiny default job (real SGLang servers, two of them, DDMA, reward ranks), async with
2-token partial rollouts, 8 prompts x 8 samples per step, run one after another:

* ``free``: the free-running async stream, the baseline for step time;
* ``lag1`` and ``lag2`` (``algorithm.max_policy_lag``), each twice with
  ``rl.deterministic=true``: the two runs compared (tools/compare_runs.py: samples, logged
  numbers, final checkpoint bytes), and the step time against ``free``;
* ``resumed``: ``lag1`` with a checkpoint every step, SIGKILLed (the whole process group)
  right after the checkpoints of steps 2, 4 and 6 and started again each time, compared
  with the uninterrupted ``lag1`` run.

Step time: the mean ``step_s`` of steps 2 to the last (step 1 waits for the first batch).
Writes tools/bench/results/determinism.json.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/determinism.py --repeats 5 --steps 20

The repeat test instead (``--repeats N``): one deterministic job with held-out settings
(:data:`REPEAT`: lag 2, 3-token segments, two servers, dynamic sampling, a checkpoint every
3 steps) run N times fresh, then twice more with kills: SIGKILLed right after its first RL
step (before any checkpoint, so it starts over) and SIGKILLed right after the checkpoint of
step 6 (so it resumes, with saved groups and parked partial rollouts). Every run is
compared with the first (tools/compare_runs.py); the JSON records ``repeats``,
``identical_runs`` (of the fresh ones, how many equal the first, the first included) and,
for any that parted, where; and the step time against the same job free-running. Writes
tools/bench/results/determinism_repeats.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_util import write_result

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from compare_runs import compare  # noqa: E402

STEPS = 8
# After 5 warm-up steps no answer is right yet; a response cut at max_new_tokens (about
# 40%) is penalised, so groups carry a signal and every step moves the weights, and
# groups without one are replaced (the lockstep stream's settling).
BASE = ["sft.steps=5", "sft.eval_every=5", "task.eval_size=32", "rl.prompts_per_step=8",
        f"rl.steps={STEPS}", "rl.eval_every=4", "rollout.segment_tokens=2",
        "rollout.servers=2", "algorithm.overlong=penalise",
        "algorithm.drop_uniform_groups=true"]  # fmt: skip
DET = ["rl.deterministic=true"]
# The repeat test's job: the settings a 20-step run parted with in 1 of 5 runs once (a
# prefix from SGLang's radix cache), the seeds held out from every other test.
REPEAT = ["rl.deterministic=true", "trainer.seed=977", "task.seed=31", "sft.steps=40",
          "task.eval_size=32", "rl.prompts_per_step=8", "rl.eval_every=10",
          "rl.save_interval=3", "rollout.segment_tokens=3", "rollout.servers=2",
          "algorithm.max_policy_lag=2", "algorithm.drop_uniform_groups=true"]  # fmt: skip


def _start(out: Path, args: list[str]) -> subprocess.Popen:
    log = (out.parent / f"{out.name}.log").open("a")
    return subprocess.Popen([sys.executable, "-m", "rl.train", *args, f"run.output_dir={out}"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _wait_gone(out: Path, timeout: float = 60) -> None:
    """Until no process names the run dir (its servers and their guards) any more."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in psutil.process_iter(["cmdline"])
                if str(out) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
        if not left:
            return
        time.sleep(0.5)
    for p in left:
        p.kill()


def run(out: Path, args: list[str]) -> dict:
    t0 = time.perf_counter()
    job = _start(out, args)
    if job.wait(timeout=1800) != 0:
        raise RuntimeError(f"{out.name} failed: see {out.parent / (out.name + '.log')}")
    _wait_gone(out)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r.get("phase") == "rl"]
    step_s = [r["step_s"] for r in steps if r["step"] > 1]
    return {"wall_s": time.perf_counter() - t0, "step_s_mean": sum(step_s) / len(step_s),
            "grad_norms": [r["grad_norm"] for r in steps],
            "uniform_skipped": steps[-1]["uniform_skipped_total"]}  # fmt: skip


def _saved_step(out: Path) -> int:  # the newest checkpoint's step (0: none yet)
    try:
        return int(json.loads((out / "rl_state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _rl_steps_logged(out: Path) -> int:
    try:
        text = (out / "metrics.jsonl").read_text()
    except OSError:
        return 0
    return sum('"phase": "rl"' in line for line in text.splitlines())


def _kill_when(out: Path, args: list[str], ready: Callable[[], bool], what: str) -> None:
    """Start the job, SIGKILL its whole process group once ``ready()``, wait it gone."""
    job = _start(out, args)
    while not ready():
        if job.poll() is not None:
            raise RuntimeError(f"{out.name} ended before {what}")
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    _wait_gone(out)


def killed_before_checkpoint(out: Path, args: list[str]) -> dict:
    """The job SIGKILLed as soon as it logged its first RL step (no checkpoint yet), then
    started again: it starts over, and the files keep each step once."""
    t0 = time.perf_counter()
    _kill_when(out, args, lambda: _rl_steps_logged(out) >= 1, "its first RL step")
    logged, saved = _rl_steps_logged(out), _saved_step(out)
    result = run(out, args)
    result["wall_s"] = time.perf_counter() - t0
    result["kills"] = [{"rl_steps_logged": logged, "checkpoint_step": saved}]
    return result


def killed_and_resumed(out: Path, args: list[str], kill_after: list[int]) -> dict:
    """The job SIGKILLed right after each checkpoint in ``kill_after`` and started again."""
    t0, kills = time.perf_counter(), []
    for step in kill_after:
        _kill_when(
            out, args, lambda s=step: _saved_step(out) >= s, f"its checkpoint of step {step}"
        )
        point = json.loads((out / "rl_state.json").read_text())
        state = json.loads((out / point["rollouts"]).read_text())
        partial = sum(r["finish_reason"] is None and bool(r["output_ids"])
                      for g in state["groups"] for r in g["rollouts"])  # fmt: skip
        kills.append({"checkpoint_step": point["step"], "samples_cut_mid_response": partial})
    result = run(out, args)
    result["wall_s"] = time.perf_counter() - t0
    result["kills"] = kills
    return result


def repeats(n: int, steps: int, d: Path) -> dict:
    """The repeat test (see the module docstring)."""
    args = [*REPEAT, f"rl.steps={steps}"]
    result: dict = {"job": "tiny default, " + " ".join(args), "steps": steps, "repeats": n}
    runs, parted = [], {}
    for i in range(n):
        runs.append(run(d / f"run{i}", args))
        found = compare(d / "run0", d / f"run{i}") if i else {}
        if any(v is not None for v in found.values()):
            parted[f"run{i}"] = found
        print(f"[bench] run {i}: {runs[-1]['wall_s']:.0f} s, {found or 'the first'}", flush=True)
    result.update(runs=runs, identical_runs=n - len(parted), parted=parted)
    # What determinism costs here: the same job free-running, its mean step time beside.
    free = run(d / "free", [a for a in args if a != "rl.deterministic=true"])
    result["free"] = {**free, "deterministic_step_time_ratio": runs[0]["step_s_mean"]
                      / free["step_s_mean"]}  # fmt: skip
    kills: dict[str, Callable[[Path], dict]] = {
        "killed_before_checkpoint": lambda out: killed_before_checkpoint(out, args),
        "killed_after_checkpoint": lambda out: killed_and_resumed(out, args, [6]),
    }
    for name, how in kills.items():
        r = how(d / name)
        found = compare(d / "run0", d / name)
        result[name] = {**r, "differences": found,
                        "identical": all(v is None for v in found.values())}  # fmt: skip
        print(f"[bench] {name}: {result[name]}", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="run the repeat test (REPEAT) this many times fresh, then killed",
    )
    ap.add_argument("--steps", type=int, default=None, help="RL steps of the repeat test")
    args = ap.parse_args(argv)
    if args.repeats:
        with tempfile.TemporaryDirectory() as tmp:
            result = repeats(args.repeats, args.steps or 20, Path(tmp))
        default = ROOT / "tools/bench/results/determinism_repeats.json"
        write_result(result, args.out or default)
        return result
    result: dict = {"job": "tiny default, " + " ".join(BASE), "steps": STEPS}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        result["free"] = run(d / "free", BASE)
        base = result["free"]["step_s_mean"]
        for name, lag in (("lag1", 1), ("lag2", 2)):
            a = [*BASE, *DET, f"algorithm.max_policy_lag={lag}"]
            first, second = run(d / f"{name}_a", a), run(d / f"{name}_b", a)
            found = compare(d / f"{name}_a", d / f"{name}_b")
            result[name] = {"runs": [first, second], "differences": found,
                            "identical": all(v is None for v in found.values()),
                            "step_time_ratio_vs_free": first["step_s_mean"] / base}  # fmt: skip
            print(f"[bench] {name}: {result[name]}", flush=True)
        save = [*BASE, *DET, "algorithm.max_policy_lag=1", "rl.save_interval=1"]
        resumed = killed_and_resumed(d / "resumed", save, [2, 4, 6])
        found = compare(d / "lag1_a", d / "resumed")
        result["resumed"] = {**resumed, "differences": found,
                             "identical": all(v is None for v in found.values())}  # fmt: skip
        print(f"[bench] resumed: {result['resumed']}", flush=True)
    write_result(result, args.out or ROOT / "tools/bench/results/determinism.json")
    return result


if __name__ == "__main__":
    main()
