"""The CPU shim's fork patch (rl/serving/cpu_fork.py) on a stand-in for SGLang's engine
module: spawn becomes fork, everything else is multiprocessing's own."""

from __future__ import annotations

import multiprocessing
from types import ModuleType

from rl.serving import cpu_fork
from rl.serving.cpu_shim import server_env


def test_the_engines_spawn_becomes_fork_and_nothing_else_changes(monkeypatch, tmp_path):
    asked: list[tuple[str | None, bool]] = []
    monkeypatch.setattr(
        multiprocessing, "set_start_method", lambda m, force=False: asked.append((m, force))
    )
    engine = ModuleType(cpu_fork.ENGINE)
    engine.mp = multiprocessing  # type: ignore[attr-defined]
    cpu_fork.patch_engine(engine)
    view = engine.mp  # type: ignore[attr-defined]
    cpu_fork.patch_engine(engine)  # idempotent
    assert engine.mp is view  # type: ignore[attr-defined]
    view.set_start_method("spawn", force=True)
    view.set_start_method("forkserver")
    assert asked == [("fork", True), ("forkserver", False)]
    assert view.Process is multiprocessing.Process and view.Queue is multiprocessing.Queue
    # On by default for a CPU server; the environment can turn it off; never on CUDA.
    assert server_env("cpu", tmp_path, {})[cpu_fork.FORK_ENV] == "1"
    assert server_env("cpu", tmp_path, {cpu_fork.FORK_ENV: "0"})[cpu_fork.FORK_ENV] == "0"
    assert cpu_fork.FORK_ENV not in server_env("cuda", tmp_path, {})
