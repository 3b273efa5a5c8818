"""Multi-turn, tool-using episodes against a real SGLang server on CPU.

A tiny chat model trained here to call the calculator (tests/helpers/tool_model.py) is
served; the task, its environment and its chat renderer are built from the config the job
would run (``task=dataset env.tools=[calculator]``), through the pre-launch checks. In file
order, on one server:

1. greedy episodes: each calls the tool, reads the observation and answers. Token by
   token, the trajectory is the template's rendering of the final conversation, the
   observation's tokens are out of the loss, and every token carries the version and a
   log-prob from the server (0 for the observation's);
2. the server is SIGKILLed while every sample of a group waits for the environment's
   answer to its first turn: once restarted, each trajectory resumes at its second turn,
   its first turn's tokens untouched, and the group is delivered to the trainer once;
3. the whole job, ``python -m rl.train`` with the environment configured and an LLM judge
   as the reward (``reward.fn=judge``, served on the reward rank): the episodes' metrics
   and the judge's latency are logged, and the evaluation's samples hold their
   conversations.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import psutil
import pytest

from rl.checks import check, check_task, compose_resolved
from rl.config.sampling import SamplingParams
from rl.controller.episodes import EpisodeDriver, run_episodes
from rl.controller.rollouts import Group, RolloutStream
from rl.controller.staleness import StalenessGate
from rl.generator.client import GeneratorClient
from rl.serving.launcher import ServerConfig, ServerLauncher
from rl.tasks import judging
from rl.tasks.scoring import ScoreResult
from tests.helpers.tool_model import (
    CALC,
    QUESTIONS,
    calculate,
    conversation,
    make_tool_model,
    train_chat_model,
)

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 96  # the call (~30 tokens), the observation (~12) and the answer (~4), with room


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tool_model(tmp_path_factory.mktemp("tool_model"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tool_data") / "questions.jsonl"
    rows = [{"q": q, "gold": calculate(e)} for q, e in QUESTIONS.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _overrides(model_dir: Path, data: Path) -> list[str]:
    return [
        "experiment=hf_model", f"model.hf_checkpoint={model_dir}",
        f"task.train_files=[{data}]", f"task.eval_files=[{data}]", "task.prompt_key=q",
        "task.label_key=gold", "env.tools=[calculator]",
        f"rollout.sampling.max_new_tokens={MAX_NEW}", "rollout.context_length=1024",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def task(model_dir, data):
    cfg = compose_resolved(_overrides(model_dir, data))
    check(cfg)
    return check_task(cfg)  # renders every prompt with the tools


@pytest.fixture(scope="module")
def launcher(model_dir, tmp_path_factory):
    server = ServerConfig(model_path=str(model_dir), dtype="float32", threads=1,
                          max_total_tokens=4096, context_length=1024)  # fmt: skip
    with ServerLauncher(server, n=1, log_dir=tmp_path_factory.mktemp("logs")) as launcher:
        yield launcher
        launcher.stop(grace=0)


@pytest.fixture(scope="module")
def client(launcher):
    with GeneratorClient.for_launcher(launcher) as client:
        yield client


def _sampling(task, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=task.codec.eos_ids, **kw)


def test_greedy_episodes_call_the_tool_and_are_the_templates_tokens(task, client, model_dir):
    from transformers import AutoTokenizer

    examples = task.eval_sets["eval"]
    driver = EpisodeDriver.from_setup(task.episodes)
    try:
        outs = run_episodes(client, driver, examples, _sampling(task, temperature=0.0))
    finally:
        driver.close()
    tok = AutoTokenizer.from_pretrained(model_dir)
    version = client.version
    for e, r in zip(examples, outs, strict=True):
        question = e.messages[-1]["content"]
        want = conversation(question)
        ep = r.episode
        assert ep["stop"] == "answer" and ep["turns"] == 2 and ep["metrics"]["tool_calls"] == 1
        assert ep["messages"] == want  # the call, the calculator's result, the answer
        # The prompt and every token after it: the template's rendering of the final
        # conversation, less the newline it writes after the last turn's end token.
        full = tok.apply_chat_template(want, tools=[CALC.schema()], tokenize=False)
        ids = tok(full.removesuffix("\n"), add_special_tokens=False)["input_ids"]
        assert list(e.prompt_ids) + r.output_ids == ids
        # The observation's tokens are the tool response's rendering, out of the loss.
        ((start, count),) = r.observed
        obs = tok.decode(r.output_ids[start : start + count])
        assert obs == (
            f"\n<|im_start|>user\n<tool_response>\n{want[2]['content']}\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        mask = r.sampled()
        assert mask == [not (start <= i < start + count) for i in range(len(r.output_ids))]
        assert r.versions == [version] * len(r.output_ids)
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, mask, strict=True) if not m)
        assert all(lp <= 0.0 for lp in r.logprobs) and any(lp < 0.0 for lp in r.logprobs)
        assert r.finish_reason == "stop" and r.output_ids[-1] in task.codec.eos_ids


class _Held:
    """The task's environment, holding its answers to first turns until released."""

    def __init__(self, env):
        self.env, self.tools = env, env.tools
        self.release, self.waiting = threading.Event(), 0
        self.reset = env.reset

    def step(self, messages):
        if sum(m["role"] == "assistant" for m in messages) == 1:
            self.waiting += 1
            assert self.release.wait(120), "never released"
        return self.env.step(messages)


def test_a_server_killed_mid_episode_resumes_each_trajectory_at_its_next_turn(
    task, client, launcher
):
    held = _Held(task.episodes.env)
    driver = EpisodeDriver(held, task.episodes.chat, max_turns=4)
    examples = iter(task.eval_sets["eval"])
    scored: list[Group] = []

    def score(g: Group) -> Future:
        scored.append(g)
        f: Future = Future()
        f.set_result([ScoreResult(float(i)) for i in range(len(g.rollouts))])
        return f

    gate = StalenessGate(max_lag=0, mode="throttle", per_step=1)  # one group at a time
    sampling = _sampling(task, temperature=0.5, n=2, seed=3)
    stream = RolloutStream(client, score, lambda: next(examples), sampling, gate=gate,
                           version=client.version, episodes=driver).start()  # fmt: skip
    client.wait_for_server = 120.0  # a turn sent while the server is down waits for it
    try:
        deadline = time.monotonic() + 120
        while held.waiting < 2:  # both samples of the group ended their first turn
            assert time.monotonic() < deadline, f"{held.waiting} samples waiting"
            time.sleep(0.05)
        snap = stream.snapshot()
        (group,) = snap.groups
        first_turns = {r.rid: list(r.output_ids) for r in group.rollouts}
        before_kill = client.stats()
        server = launcher.servers[0]
        (sglang_main,) = psutil.Process(server.proc.pid).children()
        sglang_main.kill()  # a crash, mid-episode
        assert server.proc.wait(timeout=30) == -signal.SIGKILL
        held.release.set()  # the next turns go to a server that is gone...
        time.sleep(1.0)
        assert client.restart_server(0) == client.version  # ...and wait for its restart
        groups, _ = stream.next_batch(trainer_version=client.version)
        after = client.stats()
    finally:
        client.wait_for_server = 0.0
        held.release.set()
        stream.close()
        driver.close()
    # The second turns found the server gone (the first sent was re-queued, which marked
    # it dead) and waited for its restart.
    assert after["requeued_rollouts"] - before_kill["requeued_rollouts"] >= 1
    assert after["no_server_s"] - before_kill["no_server_s"] > 0.5
    assert [g.gid for g in groups] == [group.gid] and len(scored) == 1  # trained once
    for r in groups[0].rollouts:
        before = first_turns[r.rid]
        assert r.output_ids[: len(before)] == before  # nothing regenerated
        assert r.observed and r.observed[0][0] == len(before)  # the answer, then turn 2
        assert r.episode["turns"] >= 2 and r.finished


@pytest.fixture(scope="module")
def judge_dir(task, tmp_path_factory) -> Path:
    """A judge that says "yes" to every question's right final answer (the shipped
    ``correctness`` prompt filled in as the reward ranks fill it)."""
    template = judging.prompt_template("correctness")
    convs = []
    for e in task.eval_sets["eval"]:
        text = judging.render(template, e.prompt_text, e.label, e.label, {})
        convs.append([{"role": "user", "content": text}, {"role": "assistant", "content": "yes"}])
    return train_chat_model(tmp_path_factory.mktemp("judge"), convs, steps=300)


def test_the_job_runs_episodes_scored_by_a_judge_and_logs_them(
    model_dir, data, judge_dir, tmp_path
):
    out = tmp_path / "run"
    args = [
        *_overrides(model_dir, data), "reward.fn=judge", f"reward.judge.model_path={judge_dir}",
        "trainer.micro_batch_size=4",
        "trainer.global_batch_size=4", "algorithm.group_size=2", "rl.prompts_per_step=2",
        "rl.steps=2", "rl.eval_every=2", "rl.save_hf=false", f"run.output_dir={out}",
    ]  # fmt: skip
    res = subprocess.run([sys.executable, "-m", "rl.train", *args], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in recs if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        assert r["episode_turns_mean"] >= 1 and r["episode_tool_calls_mean"] > 0
        assert r["episode_observation_tokens_mean"] > 0
        assert r["reward_judge_s"] > 0  # the judge on the reward rank scored the samples
    evals = [r for r in recs if r["phase"] == "rl_eval"]
    assert evals[0]["eval_accuracy"] == 1.0  # every greedy episode answers right: judged yes
    assert evals[0]["eval_episode_tool_success"] == 1.0
    assert list((out / "reward" / "rank0" / "logs").iterdir())  # its judge server's log
    samples = [json.loads(x) for x in (out / "eval" / "eval_step_000000.jsonl").open()]
    for s in samples:
        assert s["episode"]["messages"][-1]["content"] == s["label"] == s["response"]
