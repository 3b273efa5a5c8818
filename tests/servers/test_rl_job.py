"""The RL job as a user runs it (`python -m rl.train ...`): every rank, real SGLang, DDMA.

Short runs in sync mode: a few warm-up steps, then a few RL steps in which the trainer
scores every sampled token exactly as SGLang did (same weights after DDMA, same
temperature), so the importance ratio is 1: the embedded default with LoRA, and the tiny
MoE at EP=2. (The async stream, with the metrics docs/operations.md promises, the staleness
bound and partial rollouts resumed inside the loop: tests/servers/test_main_job.py.) A
launch of the wrong size or with a cut resume state fails before any rank starts (each
kind of bad value: tests/unit/test_job_config.py, through the same pre-launch check; the
CLI's one line: tests/multiproc/test_prelaunch_cli.py).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from rl.config.ckpt_check import read_common
from tests.helpers.procs import no_run_process_left, run_listening

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["sft.steps=5", "sft.eval_every=5", "task.eval_size=32", "rl.prompts_per_step=8"]


def _run(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl.train", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _run_listening(*args: str) -> tuple[subprocess.CompletedProcess, set[tuple[str, int, str]]]:
    """:func:`_run`, and every TCP listener of the job's processes while it ran."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return run_listening([sys.executable, "-m", "rl.train", *args], ROOT, env, timeout=900)


def _records(out: Path, phase: str) -> list[dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["phase"] == phase]


def test_sync_lora_job_trains_on_the_sampled_distribution_and_serves_the_merged_weights(
    tmp_path,
):
    """rl.mode=sync at temperature 0.7, with trainer.lora on the default TP=2 trainer:
    every token is trained on by the policy version that sampled it, and the trainer's
    log-prob of it (Megatron TP=2, base and adapters apart, after DDMA gave the servers
    W + s B A) equals SGLang's behaviour log-prob on the merged weights, so the
    train/rollout mismatch is numerical noise.

    - The warm-up trains the adapters alone (the loss falls with the base frozen) and the
      RL trainer resumes them from the warm-up's checkpoint.
    - With a KL penalty the reference is the policy RL started from (base and warmed-up
      adapters): KL 0 at the first step only. A response cut at max_new_tokens is
      penalised (algorithm.overlong), so groups carry a signal and the steps move the
      policy.
    - The weights go point to point with the bytes through shared memory (transport
      p2p_shm; the other jobs here use ipc), through a DDMA group whose store trainer rank
      0 binds to loopback: no listener of the job beyond it (torch's tcp:// rendezvous
      listened on every interface).
    - The final HF export (merged) in transformers picks the tokens the DDMA'd server
      picked greedily at the last evaluation."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    res, listening = _run_listening(
        *SHORT, "sft.steps=20", "sft.eval_every=20", "trainer.lora.rank=8",
        "rollout.weight_sync.transport=p2p_shm",
        "algorithm.overlong=penalise",  # the cut responses' rewards: batches have a gradient
        "rl.steps=3", "rl.mode=sync", "rl.eval_every=0", "rl.save_hf=true",
        "rollout.sampling.temperature=0.7", "algorithm.kl_coef=0.05",
        # Steps big enough for a KL that float32 resolves (the default ramps the LR up).
        "trainer.optim.lr=1e-3", "trainer.optim.warmup_steps=0",
        f"run.output_dir={out}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    assert {ip for ip, _, _ in listening} == {"127.0.0.1"}, listening
    assert ("starting controller 1 + trainer 2 + generator 1 + reward 1 = 5 ranks: trainer "
            "tp=2 pp=1 dp=1") in res.stdout  # fmt: skip
    warm = [r["loss"] for r in _records(out, "warmup")]
    assert warm[-1] < warm[0] - 0.5, warm
    # The warm-up's checkpoint (RL's start and its KL reference) holds the weights only
    # (its Adam state was 3x their size and never read); RL's checkpoints hold theirs.
    assert read_common(out / "warmup")["has_optimizer"] is False
    assert read_common(out / "checkpoint")["has_optimizer"] is True
    steps = _records(out, "rl")
    assert len(steps) == 3
    for r in steps:
        assert r["lag_max"] == 0 and r["dropped_total"] == 0
        assert r["mismatch_abs_logp"] < 1e-5, r
        assert abs(r["is_ratio"] - 1) < 1e-4 and r["truncated_frac"] == 0
    assert steps[0]["kl_ref"] < 1e-9
    # The policy leaves the reference once a step had a gradient (all-wrong batches have
    # zero advantages, so none).
    moved = [r["kl_ref"] for prev, r in itertools.pairwise(steps) if prev["grad_norm"] > 0]
    assert moved and min(moved) > 1e-9, steps
    no_run_process_left(out)
    model = AutoModelForCausalLM.from_pretrained(out / "hf" / "step_000003", dtype=torch.float32)
    samples = [json.loads(x) for x in (out / "eval" / "eval_step_000003.jsonl").open()]
    gaps = []
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s["prompt_ids"] + s["output_ids"]])).logits[0]
        n = len(s["prompt_ids"])
        picked = logits[n - 1 : n - 1 + len(s["output_ids"])]
        # The server's token is the export's argmax (a near-tie may go either way).
        chosen = picked.gather(1, torch.tensor(s["output_ids"])[:, None])[:, 0]
        gaps.append((picked.max(dim=1).values - chosen).max().item())
    assert len(gaps) == 32 and max(gaps) < 1e-4, max(gaps)


def test_moe_job_with_expert_parallelism_samples_what_it_trains(tmp_path):
    """A Qwen3-MoE-style model (conf/model/tiny_moe.yaml) trained with Megatron EP=2: the
    servers start from random HF weights, the warmed-up experts reach them by DDMA from
    their EP owners, and in sync mode the trainer scores every sampled token as SGLang did
    (routing included: a token routed differently would change its log-prob). The router's
    load-balancing loss and the busiest expert's load are logged every step. With routing
    replay on and every rollout cut and resumed, the trainer replays the servers' routing
    and logs how often its own router agrees."""
    out = tmp_path / "run"
    res = _run(
        "model=tiny_moe", "trainer.tp=1", "trainer.dp=2", "trainer.ep=2",
        "trainer.micro_batch_size=16", "sft.steps=20", "sft.eval_every=20",
        "task.eval_size=32", "rl.prompts_per_step=8", "rl.steps=2", "rl.mode=sync",
        "rl.eval_every=0", "algorithm.routing_replay=true", "rollout.segment_tokens=3",
        f"run.output_dir={out}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    steps = _records(out, "rl")
    assert len(steps) == 2
    for r in steps:
        assert r["mismatch_abs_logp"] < 1e-5, r
        assert abs(r["is_ratio"] - 1) < 1e-4
        # Replayed (every rollout cut and resumed): the fp32 trainer's own router picks
        # the servers' experts almost everywhere; a near-tie may go either way.
        assert r["routing_agreement"] > 0.99 and r["routing_dropped"] == 0, r
        assert 0.9 < r["moe_aux_loss"] < 4.0 and 1.0 <= r["moe_max_expert_load"] <= 4.0, r
    assert all("moe_aux_loss" in r for r in _records(out, "warmup"))
    no_run_process_left(out)


def test_launcher_world_must_match_the_role_map():
    """torchrun/srun started 3 ranks for a job whose role map needs 5: refused at once."""
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    res = _run(env=env, timeout=120)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: the launcher started 3 ranks but the role map needs")
    assert "controller 1 + trainer 2 + generator 1 + reward 1 = 5 ranks" in last


def test_corrupt_resume_state_fails_before_any_rank_starts(tmp_path):
    """A requeued job whose resume state was cut short says which file and what to do."""
    (tmp_path / "rl_state.json").write_text('{"step": 4, "checkp')
    res = _run(f"run.output_dir={tmp_path}", timeout=120)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"resume error: {tmp_path}/rl_state.json: unreadable resume state")
    assert "delete it to start over" in last
    assert "starting" not in res.stdout
