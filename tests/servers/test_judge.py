"""The LLM judge (``reward.fn=judge``) against a live SGLang judge on CPU.

A tiny judge model is trained here to answer three grading prompts (the shipped
``correctness`` template filled in): "yes" to a right response, "no" to a wrong one, and
"maybe", which the ``yes_no`` parser cannot read. Served by the reward side's scorer:

- the right response scores 1, the wrong one 0, the unreadable verdict a failed 0 that is
  counted, with the judge's latency as a metric;
- a judge server killed mid-run: what is sent before it is back fails and is counted, the
  watchdog restarts it, and it then scores as before.
"""

from __future__ import annotations

import time

import psutil
import pytest

from rl.config.schema import JudgeConfig
from rl.reward.judge import JudgeScorer
from rl.tasks import judging
from rl.tasks.scoring import ScoreItem
from tests.helpers.tool_model import train_chat_model

CASES = [  # (prompt, response, label, the judge's answer)
    ("What is 12 * 7?", "84", "84", "yes"),
    ("What is 12 * 7?", "96", "84", "no"),
    ("What is 2 + 2?", "5", "4", "maybe"),
]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    template = judging.prompt_template("correctness")
    convs = [[{"role": "user", "content": judging.render(template, p, r, lab, {})},
              {"role": "assistant", "content": a}] for p, r, lab, a in CASES]  # fmt: skip
    return train_chat_model(tmp_path_factory.mktemp("judge"), convs, steps=300)


def test_the_judge_scores_counts_what_it_cannot_read_and_survives_its_server(judge_dir, tmp_path):
    items = [ScoreItem(p, r, lab, {}) for p, r, lab, _ in CASES]
    cfg = JudgeConfig(model_path=str(judge_dir), concurrency=4, timeout_s=30.0)
    with JudgeScorer(cfg, None, tmp_path / "logs") as judge:
        results = judge.score(items)
        assert [(r.score, r.failed) for r in results] == [(1.0, False), (0.0, False), (0.0, True)]
        assert judge.stats.failures == 1 and "not yes or no: 'maybe'" in judge.stats.last_error
        assert results[0].metrics["judge_s"] > 0 and results[2].metrics == {}

        server = judge.launcher.servers[0]
        (sglang_main,) = psutil.Process(server.proc.pid).children()
        sglang_main.kill()
        server.proc.wait(timeout=30)
        (lost,) = judge.score(items[:1])  # sent to a server that is gone
        assert lost.failed and judge.stats.failures == 2
        deadline = time.monotonic() + 180
        while not (server.alive() and server.healthy()):  # the watchdog restarts it
            assert time.monotonic() < deadline, "the judge server was not restarted"
            time.sleep(0.5)
        again = judge.score(items[:2])
        assert [(r.score, r.failed) for r in again] == [(1.0, False), (0.0, False)]
