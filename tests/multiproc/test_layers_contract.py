"""``lint-imports`` (run by ``make lint``) fails the moment a module imports upwards.

The contract (``.importlinter``) is run on a copy of the package, as is and then with one
upward import added to a pure-logic module; and the config is a leaf, in a fresh
interpreter.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(where: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run(
        [str(LINT), "--no-cache", "--config", str(where / ".importlinter")],
        cwd=where, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("layers")
    shutil.copytree(ROOT / "rl", dst / "rl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", dst / ".importlinter")
    return dst


def test_the_package_keeps_its_contracts(copy: Path) -> None:
    res = _lint(copy)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        ("rl/weights/keymap.py", "import rl.trainer", "rl.weights.keymap -> rl.trainer"),
        ("rl/ddma/plan.py", "import rl.serving.launcher", "rl.ddma.plan -> rl.serving"),
        ("rl/engine/trainer.py", "import rl.reward.service", "rl.engine.trainer -> rl.reward"),
    ],
    ids=["keymap-imports-trainer", "ddma-imports-serving", "trainer-imports-reward"],
)
def test_an_upward_or_cross_import_breaks_the_contract(
    copy: Path, tmp_path: Path, module: str, line: str, broken: str
) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(copy, tree)
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    res = _lint(tree)
    assert res.returncode != 0
    assert "BROKEN" in res.stdout and broken in res.stdout, res.stdout[-3000:]


def test_the_config_is_a_leaf() -> None:
    """Importing the dtype map loads no other package of ``rl`` (a fresh interpreter)."""
    code = (
        "import sys, rl.config.dtypes; "
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('rl.')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['config']"


def test_a_test_over_its_time_budget_is_reported_and_fails_past_2_5x(tmp_path):
    """The suite's per-test budget (tests/conftest.py), in a pytest run of its own with a
    budget of 0.4 s: a test over it passes and is listed at the end; one past 2.5x (1 s)
    fails, naming the budget; marked long, it passes and is not listed."""
    folder = tmp_path / "tests" / "unit"
    folder.mkdir(parents=True)
    (tmp_path / "tests" / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (folder / "test_slow.py").write_text(
        "import time, pytest\n\n"
        "def test_slow():\n    time.sleep(0.6)\n\n"
        "def test_too_slow():\n    time.sleep(1.5)\n\n"
        "@pytest.mark.long(reason='it must')\n"
        "def test_slow_but_allowed():\n    time.sleep(1.5)\n\n"
        "def test_quick():\n    pass\n"
    )
    env = {**os.environ, "MSRL_TEST_BUDGET_S": "0.4"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 1, res.stdout[-2000:]
    assert "1 failed, 3 passed" in res.stdout, res.stdout[-2000:]
    assert re.search(r"test_too_slow took 1\.\d s, over 2\.5x the 0\.4 s budget", res.stdout)
    assert "2 tests over the 0.4 s budget of one test (failed past 1 s)" in res.stdout
    listed = re.findall(r"^ +[\d.]+ s  (\S+)$", res.stdout, re.M)
    assert listed == [
        "tests/unit/test_slow.py::test_too_slow",
        "tests/unit/test_slow.py::test_slow",
    ]
