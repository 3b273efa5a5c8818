"""Tasks: what the RL loop trains and evaluates on (the protocol is in ``common.py``).

``build_task(cfg)`` is the one place that knows the concrete tasks; the loop, the trainer
and the generator see only the protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.tasks.common import Codec, Example, PromptStream, Task, TaskError, sft_batch

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

TASKS = ("arithmetic", "dataset")

__all__ = [
    "TASKS",
    "Codec",
    "Example",
    "PromptStream",
    "Task",
    "TaskError",
    "build_task",
    "check_config",
    "sft_batch",
]


def check_config(cfg: RootConfig) -> None:
    """The task's fields alone, reading no data (cheap: run with every validation; the
    files are checked when the task is built, still before launch)."""
    t = cfg.task
    if t.name not in TASKS:
        raise TaskError(f"task.name={t.name!r} must be one of {', '.join(TASKS)}")
    if t.eval_size < 0:
        raise TaskError(f"task.eval_size={t.eval_size} must be >= 0")
    if t.name == "arithmetic":
        from rl.tasks.arithmetic import check_config as arithmetic_config

        arithmetic_config(cfg)
    elif not (t.prompt_key and t.label_key):
        raise TaskError(f"task.prompt_key={t.prompt_key!r} and task.label_key must be named")


def build_task(cfg: RootConfig) -> Task:
    """The task ``cfg.task`` names (``cfg``: the root config, for the model's tokenizer).

    Raises :class:`TaskError` with one line naming the bad field, file or row."""
    t = cfg.task
    if t.name == "arithmetic":
        from rl.tasks.arithmetic import ArithmeticTask

        try:
            return ArithmeticTask(t.digits, t.seed, t.eval_size)
        except ValueError as e:
            raise TaskError(str(e)) from None
    if t.name == "dataset":
        from rl.tasks.dataset import DatasetTask
        from rl.tasks.tokenizer import HFCodec

        path, field = (t.tokenizer, "task.tokenizer") if t.tokenizer else (
            cfg.model.hf_checkpoint, "model.hf_checkpoint")  # fmt: skip
        if not path:
            raise TaskError(
                "task.name=dataset needs a tokenizer: set model.hf_checkpoint or task.tokenizer"
            )
        return DatasetTask(t, HFCodec(path, field))
    raise TaskError(f"task.name={t.name!r} must be one of {', '.join(TASKS)}")
