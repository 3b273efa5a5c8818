"""Where two RL runs part: for bisecting a regression, or checking that a deterministic run
(``rl.deterministic=true``) repeated, or resumed, bit for bit.

    python tools/compare_runs.py RUN_DIR_A RUN_DIR_B

Three comparisons, each with the first place the runs differ:

* the samples trained on: per RL step, each group's prompt and the digest of its samples'
  tokens, behaviour log-probs and versions (``trained_prompts.jsonl``);
* the logged numbers: every ``rl`` and ``rl_eval`` record of ``metrics.jsonl``, timings
  and the counters a resumed attempt restarts left out (:data:`TIMED`);
* the final weights: the tensor files of each run's ``checkpoint/`` (Megatron torch_dist)
  and of the checkpoints saved beside it (a critic's ``checkpoint_critic/``), byte for
  byte.

A step logged by more than one attempt (a run dir written before jobs dropped the records
of an attempt killed before its first checkpoint) counts as its last attempt's.

Prints one line per comparison and exits 0 when all three agree, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo

from rl.metrics import last_attempts, read_jsonl

# Step metrics that time things, or count what a resumed attempt counts afresh or what the
# stream had skipped when the trainer's prefetch took its batch. (What a save holds,
# ``leftover_*``, is the stream at the round's cut in a deterministic run: compared.)
TIMED = ("gen_idle_frac", "trainer_idle_frac", "resumed_segments", "uniform_skipped_total")


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return last_attempts(read_jsonl(path))


def untimed(rec: dict) -> dict:
    """A metrics record without its timings (``*_s``, ``*_seconds``, ``*_per_s``, ``time``),
    the counters in :data:`TIMED` and what a resumed attempt carried over (``resume_*``)."""
    return {k: v for k, v in rec.items()
            if not (k.endswith(("_s", "_seconds", "_per_s")) or k == "time" or k in TIMED
                    or k.startswith("resume_"))}  # fmt: skip


def samples(run: Path) -> list[list[tuple[str, str]]]:
    """Per RL step, (prompt uid, samples' digest) of each trained group."""
    return [[(g["uid"], g["digest"]) for g in rec["groups"]]
            for rec in _jsonl(run / "trained_prompts.jsonl")]  # fmt: skip


def metrics(run: Path) -> list[dict]:
    recs = _jsonl(run / "metrics.jsonl")
    return [untimed(r) for r in recs if r.get("phase") in ("rl", "rl_eval")]


def tensors(run: Path) -> dict[str, bytes]:
    """The final checkpoint's tensor files and its companions' (``checkpoint_critic/``), by
    directory and name."""
    files = [*(run / "checkpoint").glob("*.distcp"), *run.glob("checkpoint_*/*.distcp")]
    return {f"{p.parent.name}/{p.name}": p.read_bytes() for p in sorted(files)}


def first_difference(a: list, b: list, show: Callable[[int, Any, Any], str]) -> str | None:
    """``show(i, a[i], b[i])`` at the first record that differs; None if none does."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return show(i, x, y)
    return None if len(a) == len(b) else f"{len(a)} records against {len(b)}"


def _group(i: int, x: list, y: list) -> str:
    j = next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
    show = lambda gs: " ".join(gs[j]) if j < len(gs) else "no group"  # noqa: E731
    return f"RL step {i + 1}, group {j}: {show(x)} vs {show(y)}"


def _record(i: int, x: dict, y: dict) -> str:
    keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
    return f"{x.get('phase')} step {x.get('step')}: " + ", ".join(
        f"{k} {x.get(k)} vs {y.get(k)}" for k in keys[:3]
    )


def compare(a: Path, b: Path) -> dict[str, str | None]:
    """Per comparison, None when the runs agree, else where they first differ."""
    sa = samples(a)
    ta, tb = tensors(a), tensors(b)
    if not ta or ta.keys() != tb.keys():
        ckpt: str | None = f"tensor files {sorted(ta)} vs {sorted(tb)}"
    else:
        diff = [k for k in ta if ta[k] != tb[k]]
        ckpt = f"{len(diff)} of {len(ta)} tensor files differ, {diff[0]} first" if diff else None
    return {
        "samples": first_difference(sa, samples(b), _group) if sa else "no trained samples",
        "metrics": first_difference(metrics(a), metrics(b), _record),
        "checkpoint": ckpt,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    found = compare(args.a, args.b)
    for what, where in found.items():
        print(f"{what}: {'identical' if where is None else where}")
    return 0 if all(v is None for v in found.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
