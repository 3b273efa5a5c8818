"""The CPU shim SGLang servers start with (rl/serving/cpu_shim.py), in a real child
interpreter with the environment a server gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import rl
from rl.serving.cpu_shim import server_env


def test_cpu_shim_only_touches_cpu_servers(tmp_path):
    base = {"PYTHONPATH": "/somewhere", "X": "1"}
    repo = str(Path(rl.__file__).resolve().parents[1])  # for the DDMA receiver
    assert server_env("cuda", tmp_path / "shim", base, threads=2) == {
        **base,
        "PYTHONPATH": f"{repo}:/somewhere",
    }
    env = server_env("cpu", tmp_path / "shim", base, threads=2)
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "shim"), repo, "/somewhere"]
    assert env["OMP_NUM_THREADS"] == "2" and env["X"] == "1"
    # The stub imports (what SGLang's rotary module needs) and refuses to be called.
    code = (
        "from vllm._custom_ops import rotary_embedding\n"
        "try:\n    rotary_embedding()\nexcept RuntimeError as e:\n    print(e)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "CPU-shim stub" in res.stdout
