"""The long-context job (conf/experiment/tiny_long_context.yaml) as a user runs it: 2,045-token
prompts, a trainer of packed micro-batches over two context-parallel ranks, real SGLang,
DDMA after every step, and a resume.

It warms up, trains RL steps in sync mode and stops; started again in the same run dir
with more steps it resumes from its last checkpoint and trains only the new one. On every
step the trainer, each row split over two ranks, scores every sampled token as SGLang did
after DDMA (the importance ratio is 1), which it could not with a row's chunks out of
place or attending across rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import no_run_process_left
from tests.servers.test_rl_job import _records, _run

ARGS = ["experiment=tiny_long_context", "rl.save_interval=1", "sft.steps=2", "task.eval_size=4"]


@pytest.mark.long(reason="two launches of a job (servers started twice) on 2k-token rows")
def test_long_rows_over_two_cp_ranks_score_as_the_server_and_resume(tmp_path: Path):
    out = tmp_path / "run"
    first = _run(*ARGS, "rl.steps=1", f"run.output_dir={out}")
    assert first.returncode == 0, first.stderr[-4000:]
    assert "tp=1 pp=1 dp=1 cp=2" in first.stdout, first.stdout[-2000:]
    warm = _records(out, "warmup")
    assert len(warm) == 2 and all(r["loss"] > 0 for r in warm)
    again = _run(*ARGS, "rl.steps=2", f"run.output_dir={out}")
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resum" in again.stdout, again.stdout[-2000:]
    steps = _records(out, "rl")
    assert [r["step"] for r in steps] == [1, 2]  # the resumed run trained step 2 alone
    assert len(_records(out, "warmup")) == 2  # and did not warm up again
    for r in steps:
        assert r["mismatch_abs_logp"] < 1e-5, r
        assert abs(r["is_ratio"] - 1) < 1e-4, r
        assert r["num_tokens"] > 0 and r["train_tokens_per_s"] > 0, r
    no_run_process_left(out)
