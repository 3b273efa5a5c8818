"""CPU shim for SGLang servers: what SGLang 0.5.23 needs to serve on a machine without CUDA.

Why: SGLang's official CPU path needs an sgl-kernel built for AMX Xeons, which PyPI does
not ship. Its generic path (``--device cpu``, torch-native attention) works at TP=1 in
FP32/BF16, except for one import: ``layers/rotary_embedding/base.py`` does
``from vllm._custom_ops import rotary_embedding``, and vLLM's wheel is CUDA-only. That
function is only called on CUDA paths, so a stub module that raises if ever called is
enough for the import to succeed.

What it replaces: nothing in SGLang's code. It writes a ``vllm/_custom_ops.py`` stub into a
directory and puts that directory on the *server's* PYTHONPATH only (the trainer and
clients never see a fake ``vllm``). It also caps the server's intra-op threads so a server
and trainer ranks sharing a small machine do not oversubscribe it, and makes SGLang honour
per-request sampling seeds on CPU (rl/serving/cpu_seeds.py, through a ``sitecustomize``
in the same directory, which then runs any other ``sitecustomize`` the server's path holds;
it also loads the other CPU patches of this folder, each with its own header).

The stub and the CPU patches are for ``device == "cpu"`` only; on every device the
``sitecustomize`` keeps the keys out of ``/server_info`` (rl/serving/hide_keys.py).
Versions: sglang 0.5.23 (torch 2.14.1). Re-check when SGLang is upgraded: if the rotary
import is gone, keep only the ``sitecustomize``.

Known CPU limits (not shimmed, rejected by config validation instead): TP > 1, FP8
quantization and ``release_memory_occupation`` need CUDA.
"""

from __future__ import annotations

import os
from pathlib import Path

from rl.serving.cpu_batch_invariant import BATCH_INVARIANT_ENV
from rl.serving.cpu_fork import FORK_ENV
from rl.serving.model_modules import skip_unused

STUB = '''"""Stub of vllm._custom_ops written by rl/serving/cpu_shim.py (see its header).

SGLang imports rotary_embedding from here at import time; on CPU it never calls it.
"""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError(
        "vllm._custom_ops.rotary_embedding is a CPU-shim stub (rl/serving/cpu_shim.py); "
        "it must never be called on CPU"
    )
'''


# Run by Python at the start of every process of a server: on every device, no key in
# /server_info (rl/serving/hide_keys.py); on CPU (``CPU_ENV``), no Megatron-Core import
# (rl/serving/cpu_no_megatron.py), per-request sampling seeds (rl/serving/cpu_seeds.py),
# for a deterministic run batch-invariant products (rl/serving/cpu_batch_invariant.py), no
# semaphore left behind (rl/serving/server_footprint.py), child processes forked, not
# spawned (rl/serving/cpu_fork.py), routed experts in a plain host buffer
# (rl/serving/cpu_routed_experts.py), Qwen2-MoE's gated shared expert in torch
# (rl/serving/cpu_shared_expert_gate.py), and one attention call per batch, not per request
# (rl/serving/cpu_batched_attention.py; not in a batch-invariant run).
SITE = '''"""Written by rl/serving/cpu_shim.py: runs rl/serving/hide_keys.py and, on CPU,
rl/serving/cpu_no_megatron.py, rl/serving/cpu_seeds.py, rl/serving/server_footprint.py,
rl/serving/cpu_fork.py, rl/serving/cpu_routed_experts.py,
rl/serving/cpu_shared_expert_gate.py, rl/serving/cpu_batched_attention.py, and
rl/serving/cpu_batch_invariant.py when the launcher asked."""

import os

try:
    from rl.serving import hide_keys
except ImportError:
    pass
else:
    hide_keys.install()
if os.environ.get("MSRL_SERVER_CPU") == "1":
    try:
        from rl.serving import (
            cpu_batch_invariant, cpu_batched_attention, cpu_fork, cpu_no_megatron,
            cpu_routed_experts, cpu_seeds, cpu_shared_expert_gate, server_footprint
        )
    except ImportError:
        pass
    else:
        cpu_no_megatron.install()
        cpu_seeds.install()
        cpu_batch_invariant.install()
        server_footprint.install()
        cpu_fork.install()
        cpu_routed_experts.install()
        cpu_shared_expert_gate.install()
        cpu_batched_attention.install()

# Then the sitecustomize this one shadows, if the path holds one (a site's own).
import importlib.machinery as _machinery
import importlib.util as _util
import sys as _sys

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in _sys.path if os.path.abspath(p or ".") != _here]
_spec = _machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(_util.module_from_spec(_spec))
'''
CPU_ENV = "MSRL_SERVER_CPU"


def _write(target: Path, text: str) -> None:
    if not target.exists() or target.read_text() != text:
        tmp = target.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, target)  # atomic: servers starting in parallel never see half a file


def write_stub(root: Path, cpu: bool = True) -> Path:
    """Write the ``sitecustomize`` and, for a CPU server, the stub package under
    ``root``; return the directory to put on sys.path."""
    root.mkdir(parents=True, exist_ok=True)
    if cpu:
        pkg = root / "vllm"
        pkg.mkdir(parents=True, exist_ok=True)
        _write(pkg / "__init__.py", '"""CPU-shim stub package (rl/serving/cpu_shim.py)."""\n')
        _write(pkg / "_custom_ops.py", STUB)
    _write(root / "sitecustomize.py", SITE)
    return root


def server_env(
    device: str,
    shim_root: Path,
    env: dict[str, str],
    threads: int | None = None,
    batch_invariant: bool = False,
    model_path: str | None = None,
) -> dict[str, str]:
    """The environment for one SGLang server process on ``device``.

    ``threads`` caps the server's intra-op threads (OMP/MKL); None keeps torch's default
    (all cores). ``batch_invariant``: pad small products (rl/generator/
    cpu_batch_invariant.py). ``model_path``: the checkpoint, whose architectures are the
    only model modules the server imports (rl/serving/model_modules.py)."""
    out = dict(env)
    # This checkout, for the DDMA receiver SGLang imports as a custom weight loader.
    paths = [
        str(write_stub(shim_root, cpu=device == "cpu")),
        str(Path(__file__).resolve().parents[2]),
    ]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    out["PYTHONPATH"] = os.pathsep.join(paths)
    if device != "cpu":
        return out
    out[CPU_ENV] = "1"
    if threads is not None:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            out[var] = str(threads)
    if batch_invariant:
        out[BATCH_INVARIANT_ENV] = "1"
    out.setdefault(FORK_ENV, "1")  # MSRL_SGLANG_FORK=0 in the environment: spawn, as SGLang
    if model_path is not None:
        skip_unused(out, model_path)
    return out
