"""Tasks: what the RL loop trains and evaluates on (the protocol is in ``common.py``).

Each task is one module of ``rl/tasks/kinds/`` defining ``TASK`` (found by listing the
package); ``build_task(cfg)`` builds the one ``task.name`` names. The loop, the trainer and
the generator see only the protocol.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from rl.plugins import discover
from rl.tasks.common import Codec, Example, PromptStream, Task, TaskError, TaskKind, sft_batch

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

__all__ = [
    "Codec",
    "Example",
    "PromptStream",
    "Task",
    "TaskError",
    "TaskKind",
    "build_task",
    "check_config",
    "registry",
    "sft_batch",
]


@cache
def registry() -> dict[str, TaskKind]:
    """``task.name`` -> the task, one per module of rl/tasks/kinds/."""
    from rl.tasks import kinds as package

    return discover(package, "TASK", lambda k: k.name)


def _kind(cfg: RootConfig) -> TaskKind:
    kind = registry().get(cfg.task.name)
    if kind is None:
        raise TaskError(f"task.name={cfg.task.name!r} must be one of {', '.join(registry())}")
    return kind


def check_config(cfg: RootConfig) -> None:
    """The task's fields alone, reading no data (cheap: run with every validation; the
    files are checked when the task is built, still before launch)."""
    kind = _kind(cfg)
    if cfg.task.eval_size < 0:
        raise TaskError(f"task.eval_size={cfg.task.eval_size} must be >= 0")
    kind.check(cfg)


def build_task(cfg: RootConfig) -> Task:
    """The task ``cfg.task`` names (``cfg``: the root config, for the model's tokenizer).

    Raises :class:`TaskError` with one line naming the bad field, file or row."""
    return _kind(cfg).build(cfg)
