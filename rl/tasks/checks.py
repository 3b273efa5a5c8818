"""The task's checks before launch: its fields, the reward function and the episodes'
environment (cheap, no data read), then the task built from its data and checked against
the model and the rollouts.

The task owns them; rl/checks.py runs them with every other layer's. Each raises
:class:`ConfigError` with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

from rl.config.errors import ConfigError, require
from rl.envs import setup as episode_setup
from rl.tasks import TaskError, build_task, judging, scoring
from rl.tasks import check_config as task_fields
from rl.tasks.tokenizer import check_tokenizer_dir

if TYPE_CHECKING:
    from rl.config.schema import RootConfig
    from rl.tasks import Task
    from rl.tasks.kinds.dataset import DatasetTaskConfig


def check(cfg: RootConfig) -> None:
    """The task's fields (reading no data) and the reward function: it must import and
    take (prompt, response, label, metadata)."""
    try:
        task_fields(cfg)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    try:
        scoring.check(scoring.rule_fn(cfg.reward))
    except scoring.RewardFnError as e:
        field = "eval_" if cfg.reward.fn.strip() == scoring.MODEL else ""
        raise ConfigError(f"reward.{field}{e}") from None
    if episode_setup.enabled(cfg.env):
        check_env(cfg)
    judged = scoring.rule_fn(cfg.reward).strip() == scoring.JUDGE
    if judged or cfg.reward.judge.model_path:
        check_judge(cfg)


def check_judge(cfg: RootConfig) -> None:
    """``reward.fn=judge`` and ``reward.judge``: the model directory and its tokenizer, the
    prompt template, the parser and the numbers (no server is started)."""
    j = cfg.reward.judge
    require(
        scoring.rule_fn(cfg.reward).strip() == scoring.JUDGE,
        f"reward.judge.model_path is set but reward.fn={cfg.reward.fn!r}: set reward.fn=judge "
        "to score with the judge",
    )
    require(j.model_path is not None, "reward.fn=judge needs reward.judge.model_path (an HF "
            "directory of the judge model)")  # fmt: skip
    path = Path(str(j.model_path)).expanduser()
    require(path.is_dir(), f"reward.judge.model_path={j.model_path!r} is not a directory")
    require((path / "config.json").is_file(),
            f"reward.judge.model_path={j.model_path!r} has no config.json")  # fmt: skip
    rules = (("servers", j.servers >= 1, ">= 1"), ("concurrency", j.concurrency >= 1, ">= 1"),
             ("max_new_tokens", j.max_new_tokens >= 1, ">= 1"),
             ("timeout_s", j.timeout_s > 0, "> 0"))  # fmt: skip
    for name, ok, rule in rules:
        require(ok, f"reward.judge.{name}={getattr(j, name)} must be {rule}")
    try:
        check_tokenizer_dir(str(path), "reward.judge.model_path")
        judging.prompt_template(j.prompt)
        judging.load_parser(j.parser)
    except (TaskError, judging.JudgeError) as e:
        raise ConfigError(str(e)) from None
    require(
        cfg.sft.steps == 0 or not (cfg.sft.eval_every or cfg.sft.stop_at_accuracy is not None),
        "reward.fn=judge with a warm-up evaluation: the judge scores on the reward ranks "
        "only; set sft.eval_every=0 and sft.stop_at_accuracy=null",
    )


def check_env(cfg: RootConfig) -> None:
    """Multi-turn episodes: the env fields, its tools and environment class (imported and
    checked; the chat template is checked when the task renders its prompts)."""
    try:
        episode_setup.environment(cfg.env)
    except episode_setup.EnvError as e:
        raise ConfigError(str(e)) from None
    require(
        not cfg.rl.deterministic,
        "rl.deterministic=true with env.tools/env.cls: the lockstep rollouts do not answer "
        "tool calls; run multi-turn episodes without it",
    )
    require(
        cfg.sft.steps == 0 or not (cfg.sft.eval_every or cfg.sft.stop_at_accuracy is not None),
        f"sft.eval_every={cfg.sft.eval_every} / sft.stop_at_accuracy="
        f"{cfg.sft.stop_at_accuracy} with env.tools/env.cls: the warm-up's greedy decoder plays "
        "no episodes; set sft.eval_every=0 and sft.stop_at_accuracy=null (the RL stage's first "
        "evaluation measures the warm-up)",
    )


def check_task(cfg: RootConfig) -> Task:
    """Build the task (reads and renders its data) and check it against the model and
    the rollouts; returns it. Run once before launch, after :func:`validate`."""
    try:
        task = build_task(cfg)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    if cfg.rl.steps > 0:
        check_context(cfg, task.max_prompt_len)
    if cfg.sft.steps > 0:
        missing = next((e.uid for e in task.validation_set if not e.target_ids), None)
        if missing is not None:  # only a task of text files can lack one (task=dataset)
            t = cast("DatasetTaskConfig", cfg.task)
            key = (
                f"task.demo_key={t.demo_key!r}" if t.demo_key else f"task.label_key={t.label_key!r}"
            )
            raise ConfigError(
                f"sft.steps={cfg.sft.steps} needs a target on every prompt: {missing} has none "
                f"(task.{key})"
            )
    return task


def check_context(cfg: RootConfig, longest: int) -> None:
    """Every rollout must fit the servers: the longest prompt (``longest`` tokens, measured
    on the rendered data) plus ``max_new_tokens`` within the context and the KV cache, and
    the context within the model's positions (checked here, after resolve_model has read
    them from model.hf_checkpoint, not in validate)."""
    r, new = cfg.rollout, cfg.rollout.sampling.max_new_tokens
    positions = cfg.model.max_position_embeddings
    require(  # SGLang refuses it at server start, after the warm-up
        r.context_length is None or r.context_length <= positions,
        f"rollout.context_length={r.context_length} exceeds model.max_position_embeddings="
        f"{positions} (the servers refuse a longer context; null: the model's)",
    )
    context = r.context_length or positions
    require(
        longest + new <= context,
        f"rollout.sampling.max_new_tokens={new} + the longest prompt ({longest} tokens) "
        f"exceeds the context of {context} tokens (rollout.context_length or "
        "model.max_position_embeddings; task.max_prompt_tokens drops long prompts)",
    )
    kv = r.max_total_tokens
    require(
        kv is None or longest + new <= kv,
        f"rollout.max_total_tokens={kv} (a server's KV cache) cannot hold one rollout: the "
        f"longest prompt ({longest} tokens) + rollout.sampling.max_new_tokens={new}",
    )
