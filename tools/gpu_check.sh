#!/usr/bin/env bash
# The GPU acceptance check: one command on any machine with a CUDA GPU.
#
#   tools/gpu_check.sh            # builds (or reuses) the GPU venv: requirements/gpu.txt added
#   MSRL_PYTHON=python3 tools/gpu_check.sh   # an interpreter that already has the packages
#
# Runs tests/gpu (the trainer on cuda:0 against transformers and its own CPU step; DDMA's
# device path: packing, the device checksum, FP8 quantization and the scatter on the GPU,
# bit-exact with the CPU path, no payload through host memory, a bucket handed to another
# process as a CUDA IPC handle; the cuda_ipc transport into a live bf16 and a live FP8
# SGLang server), then tools/bench/weight_sync.py --device cuda, and writes
# one JSON, tools/bench/results/gpu_check.json, naming the device, each test's outcome, the
# benchmark's figures and what this check did not run. Exits non-zero if a test failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${MSRL_PYTHON:-$(MSRL_GPU=1 tools/setup_env.sh)/bin/python}"
out="${MSRL_GPU_CHECK_OUT:-$root/tools/bench/results}"
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: torch.cuda.is_available() is False")'
# SGLang's CUDA build is the one package such a machine may lack (a wheel of torch and its
# kernels is gigabytes): without it its tests are not run, and the JSON says so and why.
ignore=()
if ! "$py" -c 'import sglang' 2> "$tmp/sglang.err"; then
  ignore=(--ignore=tests/gpu/test_sglang_cuda.py)
  tail -n1 "$tmp/sglang.err" > "$tmp/sglang.missing"
  echo "sglang does not import here ($(cat "$tmp/sglang.missing")): tests/gpu/test_sglang_cuda.py is not run"
fi
"$py" -m pytest tests/gpu "${ignore[@]}" -p no:cacheprovider -o addopts="" -rA -v \
  --junitxml="$tmp/junit.xml" 2>&1 | tee "$tmp/pytest.log" || true
"$py" tools/bench/weight_sync.py --device cuda --out "$tmp/bench.json" 2>&1 | tee "$tmp/bench.log" \
  || echo '{"error": "the benchmark failed: see its log"}' > "$tmp/bench.json"

"$py" - "$tmp" "$out/gpu_check.json" <<'PY'
import json, subprocess, sys, xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path
import torch

tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
tests = {}
for case in ET.parse(tmp / "junit.xml").iter("testcase"):
    what = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
    tests[f"{case.get('classname')}::{case.get('name')}"] = {
        "outcome": what[0] if what else "passed", "seconds": round(float(case.get("time")), 2)}
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
try:
    import transformer_engine  # noqa: F401
    te = "imports"
except Exception as e:
    te = f"not importable: {type(e).__name__}: {str(e)[:200]}"
result = {
    "check": "tools/gpu_check.sh",
    "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
    "nvidia_smi": smi, "torch": torch.__version__, "cuda": torch.version.cuda,
    **{name: version(dist) for name, dist in (("megatron_core", "megatron-core"),
                                              ("transformers", "transformers"))},
    "transformer_engine": te,
    "tests": tests,
    "passed": sum(t["outcome"] == "passed" for t in tests.values()),
    "failed": sum(t["outcome"] in ("failure", "error") for t in tests.values()),
    # On a GPU nothing may be skipped: a skip here would be a GPU path that did not run.
    "skipped": sum(t["outcome"] == "skipped" for t in tests.values()),
    "weight_sync_device": json.loads((tmp / "bench.json").read_text()),
    "not_run": {
        "nccl_p2p": "needs two GPUs (NCCL refuses two ranks on one device)"
        if torch.cuda.device_count() < 2 else "not built yet: no NCCL p2p case in tests/gpu",
        "rl_job": "the 30-step smollm2_arith_gpu job is not in this check yet",
    },
}
if (tmp / "sglang.missing").exists():
    why = (tmp / "sglang.missing").read_text().strip()[:200]
    result["not_run"]["sglang_cuda"] = f"tests/gpu/test_sglang_cuda.py: sglang does not import ({why})"
dest.write_text(json.dumps(result, indent=2) + "\n")
print(f"wrote {dest}: {result['passed']} passed, {result['failed']} failed, "
      f"{result['skipped']} skipped on {result['device']}")
sys.exit(1 if result["failed"] or result["skipped"] or not tests else 0)
PY
