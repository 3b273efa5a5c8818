"""On-policy distillation on the tiny task: a smaller student learns from the RL-trained
default policy's log-probs, with no task reward.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/distill.py
        [--teacher-steps 400] [--steps 400] [--student-layers 2] [hydra overrides for the student]

1. the teacher: the README's `make run` job (its warm-up, then ``--teacher-steps`` RL
   steps), its final checkpoint exported to HF;
2. the student: the same job with ``model.num_layers=--student-layers`` (its own warm-up,
   then ``--steps`` RL steps) and ``teacher=cpu algorithm.distill_coef=1
   algorithm.distill_only=true``: every sampled token's advantage is the teacher's log-prob
   minus the student's, and the task's reward is never trained on; the held-out accuracy is
   the exact-match rule's.

Writes tools/bench/results/distill_cpu.json (``start_accuracy``, ``final_accuracy``: the
student's, held out, 0-1, and ``job_wall_s``: the student's job) and
docs/distill_cpu_curves.png.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from async_vs_sync import export_hf, job, plot_run, rl_records, summarize
from bench_util import write_result

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher-steps", type=int, default=400)
    ap.add_argument("--steps", type=int, default=400, help="the student's RL steps")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--student-layers", type=int, default=2)
    ap.add_argument("--coef", type=float, default=1.0, help="algorithm.distill_coef")
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/distill_cpu.json"))
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the student")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="distill-"))
    print(f"[bench] the teacher: the default job, {a.teacher_steps} RL steps (in {work})",
          flush=True)  # fmt: skip
    t_wall, _ = job([f"rl.steps={a.teacher_steps}", f"rl.eval_every={a.eval_every}"],
                    work / "teacher")  # fmt: skip
    teacher = summarize(work / "teacher")
    hf = export_hf(work / "teacher" / "checkpoint", work / "teacher_hf")
    args = [f"model.num_layers={a.student_layers}", "teacher=cpu",
            f"teacher.hf_checkpoint={hf}", f"algorithm.distill_coef={a.coef}",
            "algorithm.distill_only=true", f"rl.steps={a.steps}",
            f"rl.eval_every={a.eval_every}", *a.overrides]  # fmt: skip
    print(f"[bench] the student: {' '.join(args)}", flush=True)
    wall, peak = job(args, work / "student")
    s = summarize(work / "student")
    recs = rl_records(work / "student")
    result = {
        "steps": a.steps,
        "overrides": args,
        "teacher": {
            "rl_steps": a.teacher_steps,
            "start_accuracy": teacher["start_accuracy"],
            "final_accuracy": teacher["final_accuracy"],
            "job_wall_s": t_wall,
        },
        "student_layers": a.student_layers,
        "start_accuracy": s["start_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "gain_points": 100 * (s["final_accuracy"] - s["start_accuracy"]),
        "eval_curve": s["eval_curve"],
        "distill_kl_first20": sum(r["adv_distill_kl"] for r in recs[:20]) / 20,
        "distill_kl_last20": sum(r["adv_distill_kl"] for r in recs[-20:]) / 20,
        "step_s": s["step_s"],
        "teacher_logprobs_s": sum(r["teacher_logprobs_s"] for r in recs) / len(recs),
        "job_wall_s": wall,
        "peak_rss_mb": peak,
    }
    write_result(result, a.out)
    plot_run(result["eval_curve"], recs, {"adv_distill_kl": "reverse KL to the teacher"},
             ("On-policy distillation, no task reward", "nats per sampled token"),
             ROOT / "docs" / f"{Path(a.out).stem}_curves.png",
             hline=(teacher["final_accuracy"], "the teacher"))  # fmt: skip
    print(f"[bench] student held-out {result['start_accuracy']:.1%} -> "
          f"{result['final_accuracy']:.1%} ({result['gain_points']:+.1f} points) in {wall:.0f} s; "
          f"teacher {teacher['final_accuracy']:.1%}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
