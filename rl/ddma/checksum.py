"""Bucket checksums, computed where the bytes are.

Two kinds behind one interface (:class:`Kind`); a message's header says which one its
sender used (through its magic: :mod:`rl.ddma.wire`), so any receiver verifies any sender.

* ``xxh3`` (host memory): xxh3-64 over a numpy view of the bytes; it runs at memory speed on
  a CPU (about 27 GB/s against 11 GB/s for memcpy on the CI machine). On a CUDA buffer it
  would first copy every byte to the host, which is what a GPU transport must never do.
* ``wsum`` (any device, the default on CUDA): the bytes viewed as int32 words ``x_i``, and
  ``sum_i w_i * x_i`` modulo 2**32, with ``w_i`` odd pseudo-random weights fixed by the
  word's position, computed on the buffer's own device, no host copy: on CUDA as one
  Triton kernel (rl/ddma/checksum_triton.py) where Triton imports, else (and on CPU, so
  CPU tests cover it) as torch's element-wise products and sums in int32 per chunk; both
  give the same value. Why int32: a GPU has no native 64-bit integer multiply.

  What it detects, always: any change confined to one word (a flipped bit or byte), since
  an odd weight times a non-zero change is non-zero modulo 2**32. Two swapped words are
  missed only if ``(w_i - w_j) * (x_j - x_i)`` vanishes modulo 2**32; the weights are
  scrambled so that no pair of positions is special. It is an integrity check against
  transport and buffer-reuse bugs, not against an adversary: the job's channels carry
  HMACs, the DDMA group does not.

  Memory: the weights of one chunk (``CHUNK_WORDS`` int32, 4 MiB) are cached per device,
  and the products of one chunk (in L2 on a GPU) are the only temporary.

Pure logic: torch and xxhash only, no torch.distributed.
"""

from __future__ import annotations

from typing import Protocol

import torch
import xxhash

from rl.ddma import kernels

# int32 words per reduction: 4 MiB of weights cached per device. It and the number of chunk
# factors are powers of two (rl/ddma/checksum_triton.py masks and shifts by them).
CHUNK_WORDS = 1 << 20


def _signed(h: int, bits: int = 64) -> int:
    h &= (1 << bits) - 1
    return h - (1 << bits) if h >= 1 << (bits - 1) else h


class Kind(Protocol):
    """A checksum over a uint8 tensor, as a signed int64 (what the header holds)."""

    name: str

    def tensor(self, payload: torch.Tensor) -> torch.Tensor:
        """The checksum as a 0-d int64 tensor (on the payload's device where it ran there)."""
        ...

    def __call__(self, payload: torch.Tensor) -> int: ...


class Xxh3:
    """The ``xxh3`` kind (see the module docstring)."""

    name = "xxh3"

    def tensor(self, payload: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self(payload), dtype=torch.int64)

    def __call__(self, payload: torch.Tensor) -> int:
        return _signed(xxhash.xxh3_64_intdigest(payload.cpu().numpy().data))


def _mix(i: torch.Tensor) -> torch.Tensor:
    """Odd pseudo-random int32 weights of positions ``i`` (int64): splitmix64's finaliser
    with torch's wrapping int64 arithmetic (arithmetic shifts masked to logical ones),
    its low 32 bits as a signed int32."""
    z = i * _signed(0x9E3779B97F4A7C15) + _signed(0xBF58476D1CE4E5B9)
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed(0x94D049BB133111EB)
    z = (z ^ ((z >> 31) & ((1 << 33) - 1))) | 1
    return ((z & 0x7FFFFFFF) - (z & 0x80000000)).to(torch.int32)


# Each chunk's sum is weighted by an odd factor of its own, so a chunk's words are not
# interchangeable with the same positions of another chunk.
_CHUNK_FACTOR = [int(f) for f in _mix(torch.arange(1, 4097, dtype=torch.int64)).tolist()]
_TAIL_FACTOR = _signed(0x2545F4914F6CDD1D, 32) | 1


class WeightedSum:
    """The ``wsum`` kind (see the module docstring)."""

    name = "wsum"

    def __init__(self, fused: bool = True, finish: bool = True) -> None:
        # fused: one Triton kernel for a CUDA payload (rl/ddma/checksum_triton.py), the
        # same value as the torch ops (tests/gpu checks); False keeps the torch ops.
        # finish: that kernel also writes the header (:meth:`stamp`, :meth:`row`).
        self.fused, self.finish = fused, finish
        self._weights: dict[torch.device, torch.Tensor] = {}
        self._factors: dict[torch.device, torch.Tensor] = {}
        self._scratches: dict[tuple[torch.device, int], torch.Tensor] = {}

    def weights(self, device: torch.device) -> torch.Tensor:
        w = self._weights.get(device)
        if w is None:
            w = _mix(torch.arange(CHUNK_WORDS, dtype=torch.int64, device=device))
            self._weights[device] = w
        return w

    def tensor(self, payload: torch.Tensor) -> torch.Tensor:
        """The checksum as a 0-d int64 tensor on the payload's device (no host sync)."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"a checksum runs over a 1-d uint8 tensor, got {payload.dtype}")
        n = payload.numel()
        whole = n // 4 * 4
        w = self.weights(payload.device)
        total = torch.zeros((), dtype=torch.int32, device=payload.device)
        if whole and payload.data_ptr() % 4 == 0:
            words = payload[:whole].view(torch.int32)
        else:  # an unaligned view cannot be reinterpreted in place
            words = payload[:whole].clone().view(torch.int32)
        kernel = kernels.load("checksum_triton") if self.fused and payload.is_cuda else None
        if kernel is not None:
            kernel.words_sum(words, w, self._factor_table(payload.device), total)
        else:
            for c, start in enumerate(range(0, words.numel(), CHUNK_WORDS)):
                part = words[start : start + CHUNK_WORDS]
                s = (part * w[: part.numel()]).sum(dtype=torch.int32)  # wraps modulo 2**32
                total += s * _CHUNK_FACTOR[c % len(_CHUNK_FACTOR)]
        if whole < n:  # the last < 4 bytes, zero-padded to one more word
            tail = torch.zeros(4, dtype=torch.uint8, device=payload.device)
            tail[: n - whole] = payload[whole:]
            total += tail.view(torch.int32)[0] * _TAIL_FACTOR
        # The length too: a truncated payload never sums the same.
        return (total + _signed(n, 32)).to(torch.int64)

    def __call__(self, payload: torch.Tensor) -> int:
        return int(self.tensor(payload).item())

    def stamp(self, payload: torch.Tensor, head: torch.Tensor, values: tuple[int, ...]) -> bool:
        """Write the header ``values`` (8 ints) into ``head`` (8 int64) with the payload's
        checksum in slot 5, as one kernel and no other op (the fused path on a device);
        False, having done nothing: not taken here (use :meth:`tensor`)."""
        return self._finish(payload, head, None, values)

    def row(self, payload: torch.Tensor, head: torch.Tensor, out: torch.Tensor) -> bool:
        """Copy the header ``head`` (8 int64) and the payload's checksum into ``out`` (9
        int64), as :meth:`stamp` does; False, having done nothing: not taken here."""
        return self._finish(payload, head, out, None)

    def _finish(self, payload, head, out, values) -> bool:
        n = payload.numel()
        take = self.fused and self.finish
        kernel = kernels.for_tensor("checksum_triton", payload) if take else None
        # A payload of whole, aligned words only: the rare rest takes the torch ops.
        if kernel is None or not n or n % 4 or payload.data_ptr() % 4 or payload.dim() != 1:
            return False
        if payload.dtype != torch.uint8:
            raise ValueError(f"a checksum runs over a 1-d uint8 tensor, got {payload.dtype}")
        dev = payload.device
        kernel.finish(payload.view(torch.int32), self.weights(dev), self._factor_table(dev),
                      self._scratch(dev), _signed(n, 32), head, out, values)  # fmt: skip
        return True

    def _factor_table(self, device: torch.device) -> torch.Tensor:
        f = self._factors.get(device)
        if f is None:
            f = torch.tensor(_CHUNK_FACTOR, dtype=torch.int32, device=device)
            self._factors[device] = f
        return f

    def _scratch(self, device: torch.device) -> torch.Tensor:
        """Two int32 zeros per device and stream (each launch leaves them zero; launches
        on one stream never overlap, on two streams they may)."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        t = self._scratches.get((device, stream))
        if t is None:
            t = self._scratches[(device, stream)] = torch.zeros(2, dtype=torch.int32, device=device)
        return t


XXH3 = Xxh3()
WSUM = WeightedSum()
KINDS: dict[str, Kind] = {XXH3.name: XXH3, WSUM.name: WSUM}


def for_device(device: torch.device | str) -> Kind:
    """The checksum computed where a buffer on ``device`` lies: xxh3 in host memory,
    the weighted sum on an accelerator."""
    return XXH3 if torch.device(device).type == "cpu" else WSUM
