"""The ``wsum`` checksum (rl/ddma/checksum.py) as one Triton kernel, for CUDA buffers.

Why: in torch ops the sum is a product and a reduction per 4 MiB chunk, so a 32 MiB bucket
costs 16 kernel launches and a temporary, and on an H100 launch overhead, not bandwidth,
set its time. The kernel reads each word once, takes its weight and its chunk's factor from
the same tables (which stay in L2), and each of at most ``PROGRAMS`` programs adds its
partial sum into one int32 with an atomic add: addition modulo 2**32 does not depend on
order, so the result is exactly the torch path's, on any GPU and run after run (tests/gpu
checks the two agree). :func:`finish` goes further: the last program writes the result
where it is wanted (a header's checksum slot, a receiver's row of checks), so a bucket's
checksum is one launch and no torch op.

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


@triton.jit(do_not_specialize=["length", "h0", "h1", "h2", "h3", "h4", "h6", "h7"])
def _wsum(x_ptr, w_ptr, f_ptr, out_ptr, n, per_program, scratch_ptr, programs, length,
          head_ptr, h0, h1, h2, h3, h4, h6, h7, CHUNK: tl.constexpr, FACTORS: tl.constexpr,
          BLOCK: tl.constexpr, FINISH: tl.constexpr):  # fmt: skip
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
    part = tl.reduce(acc, 0, _add)
    if FINISH == 0:
        tl.atomic_add(out_ptr, part)
    else:
        # The last program to finish (the counter's acquire-release orders every other
        # program's addition before it) takes the sum, resets the scratch for the next
        # launch, and writes the result: no launch of its own, nothing for the host.
        tl.atomic_add(scratch_ptr, part)
        if tl.atomic_add(scratch_ptr + 1, 1) == programs - 1:
            total = tl.atomic_xchg(scratch_ptr, 0).to(tl.int64) + length
            tl.atomic_xchg(scratch_ptr + 1, 0)
            total = total & 0xFFFFFFFF  # plus the length, modulo 2**32, as a signed int32
            total = tl.where(total >= 0x80000000, total - 0x100000000, total)
            if FINISH == 1:  # the sender: stamp the header, the sum in its slot 5
                tl.store(head_ptr, h0)
                tl.store(head_ptr + 1, h1)
                tl.store(head_ptr + 2, h2)
                tl.store(head_ptr + 3, h3)
                tl.store(head_ptr + 4, h4)
                tl.store(head_ptr + 5, total)
                tl.store(head_ptr + 6, h6)
                tl.store(head_ptr + 7, h7)
            else:  # the receiver: the header as it came, and the sum, into a row of 9
                for i in tl.static_range(8):
                    tl.store(out_ptr + i, tl.load(head_ptr + i))
                tl.store(out_ptr + 8, total)


def _grid(n: int) -> tuple[int, int]:
    """Programs, and words per program."""
    programs = min(triton.cdiv(n, BLOCK), PROGRAMS)
    per_program = triton.cdiv(triton.cdiv(n, programs), BLOCK) * BLOCK
    return triton.cdiv(n, per_program), per_program


def words_sum(
    words: torch.Tensor, weights: torch.Tensor, factors: torch.Tensor, out: torch.Tensor
) -> None:
    """``out += sum_i words[i] * weights[i % chunk] * factors[(i // chunk) % len(factors)]``
    modulo 2**32, all int32 on one CUDA device (``chunk`` = ``len(weights)``; both lengths
    powers of two)."""
    n, chunk, nf = _tables(words, weights, factors)
    if n:
        programs, per_program = _grid(n)
        _wsum[(programs,)](words, weights, factors, out, n, per_program, out, 1, 0, out,
                           0, 0, 0, 0, 0, 0, 0, CHUNK=chunk, FACTORS=nf, BLOCK=BLOCK,
                           FINISH=0)  # fmt: skip


def finish(
    words: torch.Tensor, weights: torch.Tensor, factors: torch.Tensor, scratch: torch.Tensor,
    length: int, head: torch.Tensor, out: torch.Tensor | None = None,
    values: tuple[int, ...] | None = None,
) -> None:  # fmt: skip
    """The sum of :func:`words_sum` plus ``length``, modulo 2**32 as a signed int32, written
    by the kernel itself: with ``values`` (8 ints) the header ``head`` (8 int64) is stamped
    with them and the sum in its slot 5; else ``head`` and the sum go to ``out`` (9
    int64). ``scratch``: 2 int32 zeros, left zero, not shared with a concurrent launch."""
    n, chunk, nf = _tables(words, weights, factors)
    if not n:
        raise ValueError("finish needs at least one word")
    programs, per_program = _grid(n)
    h = values or (0,) * 8
    _wsum[(programs,)](words, weights, factors, head if out is None else out, n, per_program,
                       scratch, programs, length, head, h[0], h[1], h[2], h[3], h[4], h[6],
                       h[7], CHUNK=chunk, FACTORS=nf, BLOCK=BLOCK,
                       FINISH=1 if values else 2)  # fmt: skip


def _tables(words: torch.Tensor, weights: torch.Tensor, factors: torch.Tensor):
    n, chunk, nf = words.numel(), weights.numel(), factors.numel()
    if chunk & (chunk - 1) or nf & (nf - 1):
        raise ValueError(f"table lengths {chunk} and {nf} must be powers of two")
    return n, chunk, nf
