"""Every extension point is a package with one module per choice (rl/plugins.py): model
families, DDMA transports, off-policy corrections, RL objectives, advantage estimators and
tasks. Each registry
lists exactly its package's modules, a name declared twice is refused, and a choice is
added by dropping one module into the package, with nothing else touched."""

from __future__ import annotations

import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl import plugins, tasks
from rl.algorithms import advantages, corrections, objectives
from rl.algorithms import registry as algorithms
from rl.batch import TrainBatch
from rl.config.errors import ConfigError
from rl.ddma import transport, transports
from tests.helpers.configs import composed


def _modules(package) -> set[str]:
    return {m.name for m in pkgutil.iter_modules(package.__path__)}


def test_each_registry_is_its_package():
    assert set(algorithms.corrections()) == _modules(corrections) == {
        "aipo", "icepop", "none", "tis"}  # fmt: skip
    assert set(algorithms.objectives()) == _modules(objectives) == {"gspo", "pg", "ppo_clip"}
    assert set(algorithms.estimators()) == _modules(advantages) == {
        "dr_grpo", "gae", "grpo", "reinforce_pp", "rloo"}  # fmt: skip
    assert set(tasks.registry()) == _modules(tasks.kinds) == {"arithmetic", "dataset", "retrieval"}
    assert set(transport.registry()) == _modules(transports)


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    """An empty package ``tmp_plugins`` on the path."""
    (tmp_path / "tmp_plugins").mkdir()
    (tmp_path / "tmp_plugins" / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    yield tmp_path / "tmp_plugins"
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "tmp_plugins"]:
        del sys.modules[name]


def test_a_name_declared_twice_is_refused(package: Path):
    import importlib

    (package / "a.py").write_text("from types import SimpleNamespace\nX = SimpleNamespace(n='x')\n")
    (package / "b.py").write_text("from types import SimpleNamespace\nX = SimpleNamespace(n='x')\n")
    with pytest.raises(RuntimeError, match=r"'x' is declared twice in tmp_plugins \(b\)"):
        plugins.discover(importlib.import_module("tmp_plugins"), "X", lambda o: o.n)


@pytest.fixture
def extended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    """A folder each added to the correction, estimator and task packages, as if a user's
    module had been dropped into each; the registries forget what they had found."""
    packages = {"corrections": corrections, "advantages": advantages, "tasks": tasks.kinds}
    folders = {name: tmp_path / name for name in packages}
    for name, package in packages.items():
        folders[name].mkdir()
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(folders[name])])
    registries = (algorithms.corrections, algorithms.estimators, tasks.registry)
    for cached in registries:
        cached.cache_clear()
    yield folders
    for cached in registries:
        cached.cache_clear()
    for name in [m for m in sys.modules if m.endswith((".half", ".constant", ".best_of"))]:
        del sys.modules[name]


def test_a_correction_is_one_module(extended: dict[str, Path]):
    (extended["corrections"] / "half.py").write_text(
        "from dataclasses import dataclass\n"
        "import torch\n"
        "from rl.algorithms.weights import Correction, Weight\n"
        "from rl.config.schema import CorrectionConfig\n"
        "@dataclass\n"
        "class HalfConfig(CorrectionConfig):\n"
        "    name: str = 'half'\n"
        "    w: float = 0.5\n"
        "CORRECTION = Correction(HalfConfig, lambda c: lambda r: Weight(torch.full_like(r, c.w)))\n"
    )
    # a choice of its config group, with its own field, typed
    cfg = composed(["algorithm/correction=half", "algorithm.correction.w=0.5"])
    with pytest.raises(Exception, match="could not be converted"):
        composed(["algorithm/correction=half", "algorithm.correction.w=many"])
    loss = algorithms.loss_from_config(cfg.algorithm)
    lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    mb = TrainBatch(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[1.0, 1.0, 0.0]]),
                    behaviour_logprobs=torch.tensor([[-1.5, -0.5, 0.0]]),
                    advantages=torch.tensor([[2.0, -1.0, 0.0]]))  # fmt: skip
    assert loss(lp, mb).loss_sum.item() == pytest.approx(-0.5 * (2.0 * -1.0 + -1.0 * -2.0))


def test_an_advantage_estimator_is_one_module(extended: dict[str, Path]):
    """Each sample against the best of its group: one module, a choice of
    ``algorithm/advantage`` with its own field, what it needs checked before launch."""
    (extended["advantages"] / "best_of.py").write_text(
        "from dataclasses import dataclass\n"
        "from rl.algorithms.estimator import Estimate, Estimator, grouped, per_sequence\n"
        "from rl.config.schema import AdvantageConfig\n"
        "@dataclass\n"
        "class BestOfConfig(AdvantageConfig):\n"
        "    name: str = 'best_of'\n"
        "    scale: float = 1.0\n"
        "def estimate(c, a, batch):\n"
        "    r = grouped(batch, a.group_size)\n"
        "    adv = c.scale * (r - r.max(dim=1, keepdim=True).values)\n"
        "    return Estimate(per_sequence(adv, batch.loss_mask), {})\n"
        "ESTIMATOR = Estimator(BestOfConfig, estimate, frozenset({'groups', 'ref_logprobs'}))\n"
    )
    cfg = composed(["algorithm/advantage=best_of", "algorithm.advantage.scale=2",
                    "algorithm.kl_coef=0.1", "algorithm.group_size=2"])  # fmt: skip
    algorithms.check_config(cfg.algorithm, max_response_tokens=4)
    mb = TrainBatch(torch.zeros(2, 2, dtype=torch.long), torch.tensor([[1.0, 0.0]] * 2),
                    rewards=torch.tensor([1.0, 0.5]))  # fmt: skip
    batch, figures = algorithms.with_advantages(cfg.algorithm, mb)
    assert batch.advantages is not None
    assert batch.advantages[:, 0].tolist() == [0.0, -1.0]
    assert figures["adv_zero_frac"] == 0.5
    with pytest.raises(ConfigError, match=r"^algorithm/advantage=best_of needs the reference"):
        algorithms.check_config(composed(["algorithm/advantage=best_of"]).algorithm, 4)


def test_a_task_is_one_module(extended: dict[str, Path]):
    (extended["tasks"] / "constant.py").write_text(
        "from dataclasses import dataclass\n"
        "from rl.config.schema import TaskConfig\n"
        "from rl.tasks.common import TaskError, TaskKind\n"
        "@dataclass\n"
        "class ConstantConfig(TaskConfig):\n"
        "    name: str = 'constant'\n"
        "    text: str = 'a task'\n"
        "def check(task, ctx):\n"
        "    if task.eval_size > 3:\n"
        "        raise TaskError(f'task.eval_size={task.eval_size} must be <= 3')\n"
        "TASK = TaskKind(ConstantConfig, check, lambda task, ctx: task.text)\n"
    )
    cfg = composed(["task=constant", "task.eval_size=2", "task.text=another"])
    tasks.check_config(cfg)
    assert tasks.build_task(cfg) == "another"
    with pytest.raises(tasks.TaskError, match=r"task\.eval_size=9 must be <= 3"):
        tasks.check_config(composed(["task=constant", "task.eval_size=9"]))
