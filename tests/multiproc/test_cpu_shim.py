"""The CPU shim SGLang servers start with (rl/serving/cpu_shim.py), in a real child
interpreter with the environment a server gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import rl
from rl.serving.cpu_shim import CPU_ENV, server_env


def test_cpu_shim_only_touches_cpu_servers(tmp_path):
    base = {"PYTHONPATH": "/somewhere", "X": "1"}
    repo = str(Path(rl.__file__).resolve().parents[1])  # for the DDMA receiver
    # A GPU server: the sitecustomize (its keys kept out of /server_info), no stub.
    gpu = tmp_path / "gpu"
    assert server_env("cuda", gpu, base, threads=2) == {
        **base,
        "PYTHONPATH": f"{gpu}:{repo}:/somewhere",
    }
    assert (gpu / "sitecustomize.py").exists() and not (gpu / "vllm").exists()
    env = server_env("cpu", tmp_path / "shim", base, threads=2)
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "shim"), repo, "/somewhere"]
    assert env["OMP_NUM_THREADS"] == "2" and env["X"] == "1" and env[CPU_ENV] == "1"
    # The stub imports (what SGLang's rotary module needs) and refuses to be called.
    code = (
        "from vllm._custom_ops import rotary_embedding\n"
        "try:\n    rotary_embedding()\nexcept RuntimeError as e:\n    print(e)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "CPU-shim stub" in res.stdout


def test_a_cpu_server_imports_neither_megatron_nor_other_model_modules(tmp_path):
    """A CPU server's processes cannot import Megatron-Core (SGLang's debug dumper would
    import it and wandb: rl/serving/cpu_no_megatron.py), and SGLang's registry skips every
    model module but the checkpoint's (rl/serving/model_modules.py); both can be undone."""
    from rl.serving.model_modules import DISABLED_ENV

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"]}')
    env = server_env("cpu", tmp_path / "shim", {}, model_path=str(model))
    skipped = env[DISABLED_ENV].split(",")
    assert "qwen3_moe" not in skipped and "transformers" not in skipped
    assert {"llama", "qwen3", "qwen2_moe", "deepseek_v2"} <= set(skipped)
    assert DISABLED_ENV not in server_env("cuda", tmp_path / "shim", {}, model_path=str(model))
    assert (
        server_env("cpu", tmp_path / "shim", {DISABLED_ENV: "x"}, model_path=str(model))[
            DISABLED_ENV
        ]
        == "x"
    )  # a user's own list stands

    probe = "import importlib.util, megatron.core\nprint('imported')\n"
    blocked = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "a CPU server's shim" in blocked.stderr
    env["MSRL_SGLANG_MEGATRON"] = "1"
    allowed = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert allowed.returncode == 0 and "imported" in allowed.stdout, allowed.stderr[-2000:]


def test_the_servers_sitecustomize_runs_the_one_it_shadows(tmp_path):
    """A site's own sitecustomize, later on the server's path, still runs."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_RAN = 1\n")
    env = server_env("cuda", tmp_path / "shim", {"PYTHONPATH": str(site)})
    code = (
        "import builtins, sys\n"
        "print(getattr(builtins, 'SITE_RAN', 0), sys.modules['sitecustomize'].__file__)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    ran, first = res.stdout.split()
    assert ran == "1" and first == str(tmp_path / "shim" / "sitecustomize.py")
