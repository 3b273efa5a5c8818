"""The trainer's kernels made repeatable (``rl.deterministic``): the same batches from the
same checkpoint give the same weights, bit for bit, on a rerun.

On CPU nothing is switched: a rank's thread count is fixed (``trainer.threads_per_rank``)
and with it every reduction's order; the deterministic job tests measure that. On CUDA,
cuBLAS picks its workspace per stream and some kernels accumulate with atomics, so torch's
deterministic algorithms are switched on (an op that has none raises, naming itself,
rather than silently drifting), cuBLAS gets a fixed workspace and cuDNN stops
benchmarking. Called on each trainer rank before its first CUDA kernel."""

from __future__ import annotations

import os

import torch

# cuBLAS reproducibility needs one of its two fixed workspace configurations (see the
# CUDA docs' "Results reproducibility"); read when the first cuBLAS handle is created.
CUBLAS_WORKSPACE = ":4096:8"


def deterministic_kernels(device: str) -> None:
    """Make this rank's training kernels repeatable on ``device`` (idempotent)."""
    if device != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
