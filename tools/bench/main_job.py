"""The main job's phases, timed, against other commits on the same machine.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/main_job.py \\
        --tree HEAD --tree old=5731df8 --repeats 2 --args "sft.steps=60 rl.steps=25"

Each ``--tree`` is ``[LABEL=]REF``: a commit (checked out once into a detached git
worktree under a temporary folder, removed at the end) or ``.`` for this working tree as
it is. Runs alternate between the trees (A B A B ...) so that a machine that slows down
or speeds up mid-benchmark moves every tree alike. Every run is ``python -m rl.train``
with ``--args`` (plus ``sft.stop_at_accuracy=null`` unless the args set it, so each tree
does the same number of warm-up steps) and an output folder of its own.

Per run, from the job's ``metrics.jsonl`` (medians over steps after the first few):

- warm-up: supervised ``tokens_per_s`` and step seconds; the greedy evaluations' share
  of the phase's wall time;
- RL: the trainer's ``train_tokens_per_s`` and ``train_s``, the generator's
  ``gen_tokens_per_s``, the weight sync's ``sync_s``, the step's ``step_s``;
- the held-out accuracy at the start and end of RL, and the whole run's wall time;
- each phase's wall time and CPU seconds by process kind (trainer ranks, server,
  controller, ...), read from ``/proc`` every 0.5 s over the job's process tree: where
  the cores went. Phases end where the job prints: ``setup`` at the warm-up's first line,
  ``warmup`` at its last step's, ``rl_start`` at RL's first evaluation, ``rl`` at
  ``done:``, ``end`` when the launcher exits;
- the peak of the tree's summed RSS.

The machine's own speed is measured before each run: a fixed fp32 matmul on one thread
(GFLOP/s), so that figures from two machines can be put side by side. Writes
tools/bench/results/main_job.json (``--out``) with every run and the per-tree medians,
and prints each tree's medians as ratios to the first tree's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_util import write_result  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
SKIP = 3  # first steps of each phase left out of the medians (allocation, first calls)


def matmul_gflops(n: int = 384, seconds: float = 1.5) -> float:
    """One thread's fp32 matmul rate, in a child process (this one may run threads)."""
    code = (
        "import time, torch\n"
        "torch.set_num_threads(1)\n"
        f"a = torch.randn({n}, {n}); b = torch.randn({n}, {n})\n"
        "for _ in range(5): a @ b\n"
        "k, t0 = 0, time.perf_counter()\n"
        f"while time.perf_counter() - t0 < {seconds}:\n"
        "    a @ b; k += 1\n"
        f"print(2 * {n}**3 * k / (time.perf_counter() - t0) / 1e9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return round(float(out.stdout.strip()), 2)


def kind(cmdline: str) -> str:
    """A process's kind, from its title or command line."""
    if m := re.match(r"msrl:([a-z_]+):", cmdline):
        return m.group(1)
    if m := re.match(r"sglang::(\w+)", cmdline):
        return f"server_{m.group(1)}"
    if "sglang.launch_server" in cmdline or "rl/serving/server" in cmdline:
        return "server_main"
    if "-m rl.train" in cmdline:
        return "launcher"
    if "forkserver" in cmdline or "resource_tracker" in cmdline:
        return "fork_server"
    return "other"


class TreeSampler:
    """CPU seconds and RSS of a process tree, sampled from /proc."""

    def __init__(self, root: int, period_s: float = 0.5):
        self.root, self.period = root, period_s
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (kind, CPU seconds at its last sample)
        self.peak_rss_mb = 0.0
        self.marks: list[tuple[str, dict[str, float]]] = []
        self.ends: list[tuple[str, float]] = []  # each phase's end, seconds from the start
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _children(self) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = defaultdict(list)
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids[ppid].append(int(d))
        return kids

    def sample(self) -> None:
        kids, todo, rss = self._children(), [self.root], 0.0
        while todo:
            pid = todo.pop()
            todo += kids.get(pid, [])
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                rss += int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            except (OSError, IndexError, ValueError):
                continue
            seconds = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
            # A rank is forked (the fork server's command line) before it names itself.
            now, old = kind(cmd), self.cpu.get(pid)
            if old and now in ("other", "fork_server"):
                now = old[0]
            self.cpu[pid] = (now, seconds)
        self.peak_rss_mb = max(self.peak_rss_mb, rss)

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for k, s in self.cpu.values():
            out[k] += s
        return dict(out)

    def mark(self, name: str, again: bool = False) -> None:
        """Note the CPU seconds and wall time used until now, ending phase ``name``; ``again``
        moves the end of the phase ended last if it is ``name``."""
        self.sample()
        if again and self.marks and self.marks[-1][0] == name:
            self.marks.pop()
            self.ends.pop()
        self.marks.append((name, self.by_kind()))
        self.ends.append((name, time.perf_counter() - self.t0))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def phase_cpu(marks: list[tuple[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """CPU seconds by kind between consecutive marks, named by the later mark."""
    out = {}
    for (_, a), (name, b) in itertools.pairwise(marks):
        spent = {k: round(b[k] - a.get(k, 0.0), 1) for k in sorted(b)}
        out[name] = {k: v for k, v in spent.items() if v > 0}
    return out


def med(values: list[float]) -> float | None:
    vals = values[SKIP:] if len(values) > SKIP + 2 else values
    return round(statistics.median(vals), 4) if vals else None


def summarize(metrics: list[dict]) -> dict:
    """The phases' figures from a run's metrics.jsonl records."""
    warm = [m for m in metrics if m.get("phase") == "warmup"]
    rl = [m for m in metrics if m.get("phase") == "rl"]
    evals = [m["eval_accuracy"] for m in metrics if m.get("phase") == "rl_eval"]
    out: dict[str, float | int | None] = {
        "warmup_steps": len(warm),
        "warmup_tokens_per_s": med([m["tokens_per_s"] for m in warm]),
        "warmup_step_s": med([m["step_seconds"] for m in warm]),
        # the second half alone: past the servers' start, which overlaps the warm-up's start
        "warmup_tokens_per_s_late": med([m["tokens_per_s"] for m in warm[len(warm) // 2 :]]),
        "rl_steps": len(rl),
        "rl_train_tokens_per_s": med(
            [m["train_tokens_per_s"] for m in rl if "train_tokens_per_s" in m]
        ),
        "rl_train_s": med([m["train_s"] for m in rl if "train_s" in m]),
        "gen_tokens_per_s": med([m["gen_tokens_per_s"] for m in rl if "gen_tokens_per_s" in m]),
        "sync_s": med([m["sync_s"] for m in rl if "sync_s" in m]),
        "step_s": med([m["step_s"] for m in rl if "step_s" in m]),
        "eval_accuracy_first": evals[0] if evals else None,
        "eval_accuracy_last": evals[-1] if evals else None,
    }
    if warm:  # wall time of the warm-up beside the time its train steps took
        span = warm[-1]["time"] - warm[0]["time"] + warm[0]["step_seconds"]
        train = sum(m["step_seconds"] for m in warm)
        out["warmup_wall_s"] = round(span, 2)
        out["warmup_not_training_frac"] = round(1 - train / span, 3) if span > 0 else None
    return out


def run_once(tree: Path, python: str, args: list[str], out_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    cmd = [python, "-m", "rl.train", *args, f"run.output_dir={out_dir}"]
    gflops = matmul_gflops()
    t0 = time.perf_counter()
    out = subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    sampler = TreeSampler(proc.pid)
    sampler.mark("start")
    firsts = {"[warmup": "setup", "[rl_eval] step 0": "rl_start", "done:": "rl"}
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = [*tail, line.rstrip()][-20:]
        # Phase boundaries as the job prints them: ranks up (the warm-up's first line), the
        # warm-up's last step printed, RL's first evaluation, the end.
        for prefix, name in list(firsts.items()):
            if line.startswith(prefix):
                del firsts[prefix]
                sampler.mark(name)
        if line.startswith("[warmup] step"):
            sampler.mark("warmup", again=True)
    rc = proc.wait()
    wall = time.perf_counter() - t0
    sampler.mark("end")
    sampler.stop()
    if rc != 0:
        raise SystemExit(f"{tree}: rl.train exited {rc}:\n" + "\n".join(tail))
    metrics = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    phases = {f"{b[0]}_phase_s": round(b[1] - a[1], 1) for a, b in itertools.pairwise(sampler.ends)}
    return {
        "wall_s": round(wall, 1),
        "matmul_gflops_1thread": gflops,
        **summarize(metrics),
        **phases,
        "cpu_s_by_phase": phase_cpu(sampler.marks),
        "peak_rss_mb": round(sampler.peak_rss_mb),
    }


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def checkout(ref: str, where: Path) -> tuple[Path, str]:
    """``ref`` as a folder (``.``: this working tree; else a detached worktree at ``where``)
    and its commit."""
    if ref == ".":
        dirty = "+changes" if git("status", "--porcelain") else ""
        return ROOT, git("rev-parse", "--short", "HEAD") + dirty
    sha = git("rev-parse", "--short", ref)
    git("worktree", "add", "--detach", str(where), sha)
    return where, sha


def medians_of(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Each tree's median of every numeric figure its runs have."""
    out = {}
    for label, rs in runs.items():
        keys = {k for r in rs for k, v in r.items() if isinstance(v, (int, float))}
        out[label] = {k: round(statistics.median(r[k] for r in rs if r.get(k) is not None), 4)
                      for k in sorted(keys)}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="[LABEL=]REF; '.' = this tree")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL=OVERRIDES",
                    help="more rl.train overrides for that tree's runs")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--args", default="sft.steps=60 rl.steps=25", help="rl.train overrides")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/main_job.json"))
    a = ap.parse_args()
    args = shlex.split(a.args)
    if not any(x.startswith("sft.stop_at_accuracy") for x in args):
        args.append("sft.stop_at_accuracy=null")
    specs = [t.split("=", 1) if "=" in t else [t, t] for t in (a.tree or ["."])]
    extra = {k: shlex.split(v) for k, v in (e.split("=", 1) for e in a.extra)}
    runs: dict[str, list[dict]] = defaultdict(list)
    commits: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="main_job_") as tmp:
        trees: dict[str, Path] = {}
        try:
            for label, ref in specs:
                trees[label], commits[label] = checkout(ref, Path(tmp) / f"tree_{label}")
            for r in range(a.repeats):
                for label, _ in specs:
                    out_dir = Path(tmp) / f"out_{label}_{r}"
                    res = run_once(trees[label], a.python, args + extra.get(label, []), out_dir)
                    runs[label].append(res)
                    brief = {k: v for k, v in res.items() if k != "cpu_s_by_phase"}
                    print(f"[{label} #{r}] {json.dumps(brief)}", flush=True)
        finally:
            for path in trees.values():
                if path != ROOT:
                    git("worktree", "remove", "--force", str(path))
    medians, base = medians_of(runs), specs[0][0]
    ratios = {
        label: {k: round(v / medians[base][k], 3) for k, v in m.items() if medians[base].get(k)}
        for label, m in medians.items()
    }
    for label, m in medians.items():
        shown = ", ".join(f"{k} {v} ({ratios[label].get(k)}x)" for k, v in m.items())
        print(f"{label} ({commits[label]}) vs {base}: {shown}")
    result = {"args": args, "extra": extra, "commits": commits, "runs": runs, "medians": medians}
    write_result({**result, f"ratios_to_{base}": ratios}, a.out)


if __name__ == "__main__":
    main()
