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


def killed_and_resumed(out: Path, args: list[str], kill_after: list[int]) -> dict:
    """The job SIGKILLed right after each checkpoint in ``kill_after`` and started again."""
    t0, kills = time.perf_counter(), []
    for step in kill_after:
        job = _start(out, args)
        while _saved_step(out) < step:
            if job.poll() is not None:
                raise RuntimeError(f"{out.name} ended before its checkpoint of step {step}")
            time.sleep(0.05)
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        _wait_gone(out)
        point = json.loads((out / "rl_state.json").read_text())
        state = json.loads((out / point["rollouts"]).read_text())
        partial = sum(r["finish_reason"] is None and bool(r["output_ids"])
                      for g in state["groups"] for r in g["rollouts"])  # fmt: skip
        kills.append({"checkpoint_step": point["step"], "samples_cut_mid_response": partial})
    result = run(out, args)
    result["wall_s"] = time.perf_counter() - t0
    result["kills"] = kills
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/determinism.json"))
    args = ap.parse_args(argv)
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
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
