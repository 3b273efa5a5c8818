#!/usr/bin/env bash
# Run the main job on this machine under torchrun (one process per trainer rank).
#   launch/local.sh [hydra overrides...]        e.g. launch/local.sh trainer.tp=1 trainer.dp=2
# The rank count is read from the composed config (tp*pp*dp), so it cannot disagree with it.
# `python -m rl.train` does the same without torchrun; this script is the torchrun path that
# SLURM jobs use (srun torchrun --rdzv_backend c10d ...).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/tools/setup_env.sh")"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
nproc="$("$venv/bin/python" -m rl.world_size "$@")"
# torchrun through rl/runtime/torchrun.py: its stores listen on loopback (--local-addr:
# the agent store's address), not on every interface.
exec "$venv/bin/python" -m rl.runtime.torchrun --standalone --local-addr 127.0.0.1 \
  --nproc-per-node "$nproc" -m rl.train "$@"
