"""The Megatron CPU patches: opt-in, idempotent, and doing what each header says.

Patches mutate process-global state (torch.cuda, sys.modules, Megatron modules), so every
check runs in a fresh interpreter. To stay fast, two scripts run once per module (in
parallel): one that never applies the CPU patches and one that does; each records its
observations as JSON, one key per check, and the tests below assert on those keys.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PATCH_FILES = sorted(
    p for p in (REPO / "megatron_patches").glob("*.py") if p.name not in ("__init__.py", "_util.py")
)

_PRELUDE = """
import json, sys
OUT = {}
def check(key, fn):
    try:
        OUT[key] = fn()
    except BaseException as e:  # recorded, so one failing check does not hide the others
        OUT[key] = {"error": f"{type(e).__name__}: {e}"}
"""

_EPILOGUE = """
print("RESULT " + json.dumps(OUT))
"""

# Never applies the CPU patches: import, the cuda no-op, and bad device strings.
_UNAPPLIED = """
import torch
orig = {n: getattr(torch.cuda, n) for n in ("current_device", "synchronize", "current_stream")}
import megatron_patches as mp

def untouched():
    return sorted(n for n, f in orig.items() if getattr(torch.cuda, n) is f)

check("import_applied", lambda: sorted(mp.applied()))
check("import_untouched", untouched)
check("import_megatron_loaded", lambda: sorted(m for m in sys.modules if m.startswith("megatron.")))
check("import_flash_mla_entry", lambda: repr(sys.modules.get("flash_mla", "absent")))

def ctx_before_apply():
    with mp.cuda_to_cpu():
        return torch.ones(1).type()
check("ctx_before_apply_type", ctx_before_apply)

check("cuda_result", lambda: mp.apply_all("cuda"))
check("cuda_untouched", untouched)
check("cuda_applied", lambda: sorted(mp.applied()))

def bad(device):
    try:
        mp.apply_all(device)
    except ValueError as e:
        return "ValueError: " + str(e)
    return "no error"
for dev in ("tpu", "CPU", ""):
    check(f"bad_{dev}", lambda dev=dev: bad(dev))
check("bad_applied", lambda: sorted(mp.applied()))

def flash_unguarded():
    try:
        import flash_mla  # noqa: F401
    except Exception as e:
        return type(e).__name__
    return "imported"
check("flash_mla_unguarded", flash_unguarded)
"""

# Applies the CPU patches and exercises each of them.
_APPLIED = """
import torch
import megatron_patches as mp

check("first", lambda: mp.apply_all("cpu"))
check("second", lambda: mp.apply_all("cpu"))
check("applied", lambda: sorted(mp.applied()))
check("current_device", lambda: str(torch.cuda.current_device()))
check("synchronize", lambda: repr(torch.cuda.synchronize()))
check("stream_wait", lambda: repr(torch.cuda.current_stream().wait_event(object())))

def in_ctx():
    with mp.cuda_to_cpu():
        return {
            "zeros": torch.zeros(2, device="cuda").device.type,
            "zeros_dev_obj": torch.zeros(2, device=torch.device("cuda", 0)).device.type,
            "type": torch.ones(1).type(),
            "double_type": torch.ones(1, dtype=torch.float64).type(),
            "cuda_method": torch.ones(2).cuda().device.type,
            "to": torch.ones(2).to("cuda").device.type,
        }
check("ctx", in_ctx)
check("after_ctx_type", lambda: torch.ones(1).type())

def flash():
    try:
        import flash_mla  # noqa: F401
    except Exception as e:  # Megatron catches ImportError, so subclasses count as one
        return "ImportError" if isinstance(e, ImportError) else type(e).__name__
    return "imported"
check("flash_mla", flash)
check("flash_mla_entry", lambda: repr(sys.modules.get("flash_mla", "absent")))

def causal():
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils
    m = utils.get_default_causal_mask(3)
    shared = fused_softmax.get_default_causal_mask is utils.get_default_causal_mask
    return {"device": m.device.type, "mask": m.tolist(), "same_in_fused_softmax": shared}
check("causal_mask", causal)

def rng():
    from megatron.core.tensor_parallel import random as r
    torch.manual_seed(0)
    t = r.CudaRNGStatesTracker()
    t.add("a", 5)
    with t.fork("a"):
        x1 = torch.rand(3).tolist()
    with t.fork("a"):
        x2 = torch.rand(3).tolist()
    outside = torch.rand(3).tolist()
    t2 = r.CudaRNGStatesTracker()
    t2.add("a", 5)
    with t2.fork("a"):
        x1_again = torch.rand(3).tolist()
    torch.manual_seed(0)
    unforked = torch.rand(3).tolist()  # the same default stream, never forked
    torch.manual_seed(5)
    seeded = torch.rand(3).tolist()  # what the tracker's "a" stream must start with
    return {"x1": x1, "x2": x2, "outside": outside, "x1_again": x1_again,
            "unforked": unforked, "seeded": seeded}
check("rng", rng)

def optional():
    import megatron.core  # noqa: F401
    from megatron.core import timers
    from megatron.core.inference.contexts import dynamic_context as dc
    left_out = [m for m in ("flashinfer", "wandb") if m not in sys.modules]
    import wandb  # noqa: F401
    return {"left_out": left_out, "have": [dc.HAVE_FLASHINFER, dc.HAVE_WANDB],
            "timers_wandb": repr(timers.wandb), "later_import": "wandb" in sys.modules}
check("optional_imports", optional)
"""


_SCRIPTS = {"unapplied": _UNAPPLIED, "applied": _APPLIED}


def _start(body: str, fake_dir: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(fake_dir)])}
    return subprocess.Popen(
        [sys.executable, "-c", _PRELUDE + body + _EPILOGUE],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{err[-3000:]}"
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, f"no result line in output:\n{out[-2000:]}\n{err[-2000:]}"
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    # A stand-in for SGLang's flash_mla on a machine without CUDA: importing it raises
    # OSError (its CUDA library cannot load), which Megatron's `except ImportError` misses.
    fake_dir = tmp_path_factory.mktemp("fake_flash_mla")
    (fake_dir / "flash_mla.py").write_text("raise OSError('libcuda.so.1: cannot open')\n")
    procs = {name: _start(body, fake_dir) for name, body in _SCRIPTS.items()}
    return {name: _finish(proc) for name, proc in procs.items()}


@pytest.fixture
def unapplied(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["unapplied"]


@pytest.fixture
def applied(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return runs["applied"]


def _patch_names() -> list[str]:
    """NAME of every patch module, read from the source (no import, no side effects)."""
    names = []
    for path in PATCH_FILES:
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["NAME"]
                and isinstance(node.value, ast.Constant)
            ):
                names.append(node.value.value)
    return names


def test_import_applies_nothing(unapplied: dict[str, Any]) -> None:
    """Importing the package must be side-effect free; GPU runs import it too."""
    assert unapplied["import_applied"] == []
    assert unapplied["import_untouched"] == ["current_device", "current_stream", "synchronize"]
    assert unapplied["import_megatron_loaded"] == []
    assert unapplied["import_flash_mla_entry"] == "'absent'"


def test_cuda_to_cpu_is_inert_before_apply(unapplied: dict[str, Any]) -> None:
    """The context manager only redirects once the CPU patches are applied."""
    assert unapplied["ctx_before_apply_type"] == "torch.FloatTensor"


def test_apply_all_cuda_is_a_no_op(unapplied: dict[str, Any]) -> None:
    """On GPU clusters the same code path must run with torch untouched."""
    assert unapplied["cuda_result"] == []
    assert unapplied["cuda_untouched"] == ["current_device", "current_stream", "synchronize"]
    assert unapplied["cuda_applied"] == []


@pytest.mark.parametrize("device", ["tpu", "CPU", ""])
def test_apply_all_rejects_unknown_device(unapplied: dict[str, Any], device: str) -> None:
    """A typo in the device must not silently skip (or apply) the patches."""
    result = unapplied[f"bad_{device}"]
    assert isinstance(result, str) and result.startswith("ValueError: "), result
    assert repr(device) in result
    assert unapplied["bad_applied"] == []


def test_apply_all_cpu_applies_every_patch_once(applied: dict[str, Any]) -> None:
    """First call applies every patch module (flash_mla guard first); the second, none."""
    names = _patch_names()
    assert len(names) == len(PATCH_FILES)
    first = applied["first"]
    assert isinstance(first, list), first
    assert sorted(first) == sorted(names)
    assert first[0] == "flash_mla_guard"
    assert applied["second"] == []
    assert applied["applied"] == sorted(names)


def test_current_device_and_sync(applied: dict[str, Any]) -> None:
    """Megatron's device=torch.cuda.current_device() and stream waits work on CPU."""
    assert applied["current_device"] == "cpu"
    assert applied["synchronize"] == "None"
    assert applied["stream_wait"] == "None"


def test_cuda_to_cpu_redirects_inside_only(applied: dict[str, Any]) -> None:
    """Inside the mode CUDA requests land on CPU and type() reports CUDA; outside, not."""
    assert applied["ctx"] == {
        "zeros": "cpu",
        "zeros_dev_obj": "cpu",
        "type": "torch.cuda.FloatTensor",
        "double_type": "torch.cuda.DoubleTensor",
        "cuda_method": "cpu",
        "to": "cpu",
    }
    assert applied["after_ctx_type"] == "torch.FloatTensor"


def test_flash_mla_guard_turns_import_into_import_error(
    unapplied: dict[str, Any], applied: dict[str, Any]
) -> None:
    """Megatron's attention only catches ImportError around `from flash_mla import ...`."""
    assert unapplied["flash_mla_unguarded"] == "OSError"  # the failure the guard exists for
    assert applied["flash_mla"] == "ImportError"
    assert applied["flash_mla_entry"] == "None"


def test_megatron_loads_without_its_optional_inference_and_timer_imports(
    applied: dict[str, Any],
) -> None:
    """Neither flashinfer nor wandb loads with Megatron (its dynamic inference context and
    timers take their fallbacks), and wandb still imports for anyone else afterwards."""
    assert applied["optional_imports"] == {
        "left_out": ["flashinfer", "wandb"],
        "have": [False, False],
        "timers_wandb": "None",
        "later_import": True,
    }


def test_causal_mask_on_cpu(applied: dict[str, Any]) -> None:
    """attention_mask=None builds the mask on CPU, for both references Megatron holds."""
    assert applied["causal_mask"] == {
        "device": "cpu",
        "mask": [[False, True, True], [False, False, True], [False, False, False]],
        "same_in_fused_softmax": True,
    }


def test_rng_tracker_forks_cpu_state(applied: dict[str, Any]) -> None:
    """Forked streams advance, reproduce from their seed, and leave the default alone."""
    rng = applied["rng"]
    assert "error" not in rng, rng
    assert rng["x1"] == rng["seeded"]  # the "a" stream is torch.manual_seed(5)'s stream
    assert rng["x1"] != rng["x2"]  # the tracked state advances across forks
    assert rng["x1_again"] == rng["x1"]  # same seed, new tracker: same values
    assert rng["outside"] == rng["unforked"]  # forking did not consume default draws


@pytest.mark.parametrize("path", PATCH_FILES, ids=lambda p: p.stem)
def test_patch_module_header(path: Path) -> None:
    """Each patch documents why it exists, what it replaces and for which versions."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc is not None
    for word in ("Why", "Replaces", "Versions"):
        assert word in doc, f"{path.name}: docstring lacks {word!r}"
