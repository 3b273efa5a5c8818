"""Tasks: what the RL loop trains and evaluates on (the protocol is in ``common.py``).

Each task is one module of ``rl/tasks/kinds/`` defining ``TASK`` (found by listing the
package) with its own config dataclass, which :func:`store_schemas` makes a choice of
Hydra's ``task`` group; ``build_task(cfg)`` builds the one ``task=<name>`` picks. The loop,
the trainer and the generator see only the protocol. Composing any config imports every
task's module (the planner too, which runs without torch), so a task imports torch inside
its functions.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from rl.plugins import chosen, discover
from rl.tasks.common import (
    Codec,
    Example,
    PromptStream,
    Task,
    TaskContext,
    TaskError,
    TaskKind,
    sft_batch,
)

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

__all__ = [
    "Codec",
    "Example",
    "PromptStream",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskKind",
    "build_task",
    "check_config",
    "registry",
    "sft_batch",
    "store_schemas",
]


@cache
def registry() -> dict[str, TaskKind]:
    """``task=<name>`` -> the task, one per module of rl/tasks/kinds/."""
    from rl.tasks import kinds as package

    return discover(package, "TASK", lambda k: k.name)


def store_schemas() -> None:
    """Every task as a choice of Hydra's ``task`` group, typed by its config."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for kind in registry().values():
        cs.store(group="task", name=kind.name, node=kind.config)


def _kind(cfg: RootConfig) -> TaskKind:
    return chosen(cfg.task, registry(), lambda k: k.config, "task", TaskError)


def check_config(cfg: RootConfig) -> None:
    """The task's fields alone, reading no data (cheap: run with every validation; the
    files are checked when the task is built, still before launch)."""
    kind = _kind(cfg)
    if cfg.task.eval_size < 0:
        raise TaskError(f"task.eval_size={cfg.task.eval_size} must be >= 0")
    kind.check(cfg.task, TaskContext.of(cfg))


def build_task(cfg: RootConfig) -> Task:
    """The task ``cfg.task`` names (``cfg``: the root config, for the model's tokenizer).

    Raises :class:`TaskError` with one line naming the bad field, file or row."""
    return _kind(cfg).build(cfg.task, TaskContext.of(cfg))
