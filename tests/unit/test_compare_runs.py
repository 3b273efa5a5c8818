"""tools/compare_runs.py on run dirs made here: identical runs agree, and a different
sample, logged number or checkpoint byte is reported where it first appears; timings and
resumed-attempt counters never count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from compare_runs import compare, main  # noqa: E402


def _run(root: Path, digest: str = "d2", loss: float = 0.5, step_s: float = 1.0,
         weights: bytes = b"w") -> Path:  # fmt: skip
    (root / "checkpoint").mkdir(parents=True)
    (root / "checkpoint" / "__0_0.distcp").write_bytes(weights)
    trained = [{"phase": "rl", "step": s, "groups": [{"uid": "p0", "digest": "d1"},
                                                      {"uid": "p1", "digest": d}]}
               for s, d in ((1, "d0"), (2, digest))]  # fmt: skip
    (root / "trained_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trained))
    recs = [{"phase": "rl", "step": 1, "loss": 0.1, "step_s": step_s, "gen_idle_frac": step_s,
             "time": step_s, "resume_groups": step_s, "critic_step_seconds": step_s},
            {"phase": "rl", "step": 2, "loss": loss}]  # fmt: skip
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return root


def test_identical_runs_agree_whatever_their_timings(tmp_path, capsys):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", step_s=7.0)
    assert compare(a, b) == {"samples": None, "metrics": None, "checkpoint": None}
    assert main([str(a), str(b)]) == 0
    assert capsys.readouterr().out.count("identical") == 3


def test_each_difference_is_reported_where_it_first_appears(tmp_path):
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b", digest="other", loss=0.25, weights=b"x")
    found = compare(a, b)
    assert found["samples"] == "RL step 2, group 1: p1 d2 vs p1 other"
    assert found["metrics"] == "rl step 2: loss 0.5 vs 0.25"
    assert found["checkpoint"] == "1 of 1 tensor files differ, checkpoint/__0_0.distcp first"
    assert main([str(a), str(b)]) == 1


def test_a_critics_checkpoint_beside_the_policys_is_compared_too(tmp_path):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    for run, weights in ((a, b"v"), (b, b"u")):
        (run / "checkpoint_critic").mkdir()
        (run / "checkpoint_critic" / "__0_0.distcp").write_bytes(weights)
    found = compare(a, b)
    assert found["checkpoint"] == "1 of 2 tensor files differ, checkpoint_critic/__0_0.distcp first"
    (b / "checkpoint_critic" / "__0_0.distcp").write_bytes(b"v")
    assert compare(a, b)["checkpoint"] is None
    (b / "checkpoint_critic" / "__0_0.distcp").unlink()
    assert compare(a, b)["checkpoint"].startswith("tensor files ")


def test_a_step_logged_by_a_lost_attempt_counts_as_its_last_attempts(tmp_path):
    """A run dir where an attempt killed before its first checkpoint logged steps 1-2 and
    the next attempt started over: each step is compared as the last attempt logged it."""
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")
    lost_trained = [{"phase": "rl", "step": s, "groups": [{"uid": "p9", "digest": "x"}]}
                    for s in (1, 2)]  # fmt: skip
    lost_metrics = [{"phase": "rl", "step": s, "loss": 9.0} for s in (1, 2)]
    for name, lost in (("trained_prompts.jsonl", lost_trained), ("metrics.jsonl", lost_metrics)):
        path = b / name
        path.write_text("".join(json.dumps(r) + "\n" for r in lost) + path.read_text())
    assert compare(a, b) == {"samples": None, "metrics": None, "checkpoint": None}
