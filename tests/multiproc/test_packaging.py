"""The distribution builds as megatron-sglang-rl with both import packages and pinned deps."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_contains_packages_and_requirements(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("megatron_sglang_rl-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = next(n for n in names if n.endswith("METADATA"))
        metadata = z.read(meta).decode()
    assert "rl/engine/trainer.py" in names
    assert "megatron_patches/__init__.py" in names
    assert not any(n.startswith("tests/") for n in names)
    assert "Requires-Dist: torch==2.14.1" in metadata
    assert 'Requires-Dist: megatron-core==0.16.1; python_version < "3.12"' in metadata
    assert "Requires-Dist: apex" not in metadata
    assert "Provides-Extra: sglang" in metadata
    assert 'Requires-Dist: sglang==0.5.23; extra == "sglang"' in metadata
    assert "rl/serving/cpu_shim.py" in names
