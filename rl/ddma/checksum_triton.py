"""The ``wsum`` checksum (rl/ddma/checksum.py) as one Triton kernel, for CUDA buffers.

Why: in torch ops the sum is a product and a reduction per 4 MiB chunk, so a 32 MiB bucket
costs 16 kernel launches and a temporary, and on an H100 launch overhead, not bandwidth,
set its time. The kernel reads each word once, takes its weight and its chunk's factor from
the same tables (which stay in L2), and each of at most ``PROGRAMS`` programs adds its
partial sum into one int32 with an atomic add: addition modulo 2**32 does not depend on
order, so the result is exactly the torch path's, on any GPU and run after run (tests/gpu
checks the two agree).

GPU-only: imported lazily by rl/ddma/checksum.py when the payload is on CUDA and Triton
imports; never on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # words per step of a program
PROGRAMS = 1024  # at most: each program adds its partial sum with one atomic


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _wsum(x_ptr, w_ptr, f_ptr, out_ptr, n, per_program,
          CHUNK: tl.constexpr, FACTORS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for k in range(0, per_program, BLOCK):
        offs = start + k + tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(x_ptr + offs, mask=keep, other=0)
        # CHUNK and FACTORS are powers of two: these are masks and shifts, not divisions.
        w = tl.load(w_ptr + offs % CHUNK, mask=keep, other=0)
        f = tl.load(f_ptr + (offs // CHUNK) % FACTORS, mask=keep, other=0)
        acc += x * w * f
    # tl.sum's own reduction, spelled out: Triton's interpreter (the CPU tests) evaluates
    # tl.sum in int64 and refuses a result beyond int32, where this must wrap.
    tl.atomic_add(out_ptr, tl.reduce(acc, 0, _add))


def words_sum(
    words: torch.Tensor, weights: torch.Tensor, factors: torch.Tensor, out: torch.Tensor
) -> None:
    """``out += sum_i words[i] * weights[i % chunk] * factors[(i // chunk) % len(factors)]``
    modulo 2**32, all int32 on one CUDA device (``chunk`` = ``len(weights)``; both lengths
    powers of two)."""
    n, chunk, nf = words.numel(), weights.numel(), factors.numel()
    if chunk & (chunk - 1) or nf & (nf - 1):
        raise ValueError(f"table lengths {chunk} and {nf} must be powers of two")
    if n:
        programs = min(triton.cdiv(n, BLOCK), PROGRAMS)
        per_program = triton.cdiv(triton.cdiv(n, programs), BLOCK) * BLOCK
        grid = (triton.cdiv(n, per_program),)
        _wsum[grid](words, weights, factors, out, n, per_program, CHUNK=chunk, FACTORS=nf,
                    BLOCK=BLOCK)  # fmt: skip
