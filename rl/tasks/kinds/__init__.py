"""One module per task, each defining ``TASK`` (a :class:`rl.tasks.common.TaskKind`; found
by rl/tasks/__init__.py, as model families are): ``task=<name>`` picks it."""
