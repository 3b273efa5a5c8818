"""The stall line: once per quiet period, naming where the loop waits and what the
handles wait for; nothing while the loop moves."""

from __future__ import annotations

import time

from rl.controller.stall import StallWatch


def test_a_quiet_loop_says_once_per_period_what_it_waits_for():
    said: list[str] = []
    watch = StallWatch(0.2, [lambda: "3 score requests on reward ranks [0] (overdue)", str],
                       say=said.append)  # fmt: skip
    watch.at("the batch of RL step 34")
    watch.start()
    time.sleep(0.5)
    watch.close()
    assert 1 <= len(said) <= 3, said
    assert said[0].startswith("no progress for 0s: waiting for the batch of RL step 34; 3 score")
    assert all("\n" not in line and line.endswith("(overdue)") for line in said)


def test_a_loop_that_moves_says_nothing_and_zero_is_off():
    said: list[str] = []
    watch = StallWatch(0.3, say=said.append).start()
    for step in range(6):
        watch.at(f"step {step}")
        time.sleep(0.1)
    watch.close()
    off = StallWatch(0, say=said.append).start()
    time.sleep(0.1)
    off.close()
    assert said == [] and off._thread is None
