"""Bucket messages: pack source slices into one buffer, verify it, scatter it into shards.

A message is ``HEADER_BYTES`` of int64 header followed by the pieces' bytes at the offsets
the plan fixed. The header carries the plan digest (both sides planned the same
transfer), the policy version, the bucket index and a checksum of the payload, so a
receiver never writes bytes it cannot vouch for. The checksum is computed where the
buffer lies (:mod:`rl.ddma.checksum`: xxh3 in host memory, a weighted sum on the device
of a CUDA buffer), and the magic says which kind, so a receiver on either device verifies
a sender on either.

The gather-copy (pack) and scatter-copy (unpack) are one memcpy-speed pass over the
bytes, no intermediate tensors: on a CUDA buffer a bucket's copies, and its FP8 pieces'
quantization, are one Triton launch each from a table kept on the device
(rl/ddma/fused.py; the same bytes as rl/ddma/fp8.py); whatever those kernels do not take
(a cast to the destination dtype, a host tensor, another device) is a torch copy per
piece, small ones in batches (rl/ddma/pieces.py).

On a CUDA buffer nothing waits for the device, so the host runs ahead and a small bucket
costs what its bytes cost: the checksum kernel writes the header itself, and
:func:`verify` reads header and checksum back in one transfer. :class:`Deferred` goes
further where a caller may write a bucket before it is verified (into a staging copy
swapped in only once the whole version has been verified): the checks of a whole sync
then cost one host sync.

Pure logic: torch tensors only, no torch.distributed.
"""

from __future__ import annotations

import torch

from rl.ddma import checksum as cks
from rl.ddma import fp8, fused, pieces
from rl.ddma.plan import HEADER_BYTES, Bucket, Plan, is_scale, scale_name

MAGIC = 0x44444D41  # "DDMA": payload checksum xxh3
MAGIC_WSUM = 0x44444D57  # "DDMW": payload checksum wsum
MAGICS = {cks.XXH3.name: MAGIC, cks.WSUM.name: MAGIC_WSUM}
_KIND_OF = {m: cks.KINDS[k] for k, m in MAGICS.items()}
# A relay rank whose parent died sends this in place of each bucket it can no longer
# forward, so the servers below it finish the version at once (and fail it) instead of
# waiting for bytes that will never come.
LOST = 0x4C4F5354  # "LOST"
_FIELDS = ("magic", "digest", "version", "index", "nbytes", "checksum", "src", "dst")


class BucketError(RuntimeError):
    """A message that must not be applied: wrong plan, version, bucket or checksum."""


class LostUpstream(BucketError):
    """The bucket stands for one a relaying server upstream could not forward."""


def write_lost(buf: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """Stamp ``buf`` as the stand-in of ``bucket`` (see :data:`LOST`); the message to send."""
    head = buf[:HEADER_BYTES].view(torch.int64)
    head.zero_()
    head[0], head[3], head[4] = LOST, bucket.index, bucket.nbytes
    return buf[: bucket.nbytes]


def write_header(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, version: int, payload: bool = True
) -> None:
    """Stamp the header; ``payload=False`` leaves the checksum out (0), for a transport
    whose bytes never leave this host's memory (rl/ddma/shm.py, when asked)."""
    kind = cks.for_device(buf.device)
    values = (MAGICS[kind.name], plan.digest, version, bucket.index, bucket.nbytes, 0,
              bucket.src, bucket.dst)  # fmt: skip
    head = buf[:HEADER_BYTES].view(torch.int64)
    body = buf[HEADER_BYTES : bucket.nbytes]
    if payload and isinstance(kind, cks.WeightedSum) and kind.stamp(body, head, values):
        return  # one kernel summed the payload and wrote the header
    if buf.is_cuda:  # a pageable host tensor would make the copy wait for the device
        head.copy_(torch.tensor(values, dtype=torch.int64, pin_memory=True), non_blocking=True)
    else:
        head.copy_(torch.tensor(values, dtype=torch.int64))
    if payload:  # on a device the sum stays there: no host sync to stamp it
        head[5] = kind.tensor(body)


def read_header(buf: torch.Tensor) -> dict[str, int]:
    return dict(zip(_FIELDS, buf[:HEADER_BYTES].view(torch.int64).tolist(), strict=True))


def verify(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, version: int, payload: bool = True
) -> None:
    """Raise :class:`BucketError` unless ``buf`` is exactly ``bucket`` of ``plan`` at
    ``version`` with an intact payload (``payload=False``: the header only)."""
    kind = cks.for_device(buf.device)
    summed = payload and buf.is_cuda  # header and checksum come back in one transfer
    row = (_row(buf, bucket, kind) if summed else buf[:HEADER_BYTES].view(torch.int64)).tolist()
    h = dict(zip(_FIELDS, row[:8], strict=True))
    _check_header(h, plan, bucket, version)
    if not payload:
        return
    sent = _KIND_OF[h["magic"]]  # the sender's kind, whatever device it ran on
    if not summed or sent is not kind:
        row = [*row[:8], sent(buf[HEADER_BYTES : bucket.nbytes])]
    _check_sum(h, row[8], sent, bucket)


def _row(buf: torch.Tensor, bucket: Bucket, kind: cks.Kind) -> torch.Tensor:
    """The header and the payload's checksum (``kind``), 9 int64 on the buffer's device,
    queued there (one kernel where it can)."""
    head, body = buf[:HEADER_BYTES].view(torch.int64), buf[HEADER_BYTES : bucket.nbytes]
    row = head.new_empty(9)
    if isinstance(kind, cks.WeightedSum) and kind.row(body, head, row):
        return row
    return torch.cat([head, kind.tensor(body).to(head.device).view(1)])


def _where(bucket: Bucket) -> str:
    return f"bucket {bucket.index} (trainer rank {bucket.src} -> generator rank {bucket.dst})"


def _check_header(h: dict[str, int], plan: Plan, bucket: Bucket, version: int) -> None:
    """Checks are ordered so the message names the most likely cause (a different plan
    means different architectures or layouts)."""
    where = _where(bucket)
    if h["magic"] == LOST:
        raise LostUpstream(f"{where}: a relaying server upstream was lost before it")
    if h["magic"] not in _KIND_OF:
        raise BucketError(f"{where}: not a DDMA message (magic {h['magic']:#x})")
    if h["digest"] != plan.digest:
        raise BucketError(
            f"{where}: sender planned a different transfer (digest {h['digest']:#x}, "
            f"receiver {plan.digest:#x}): model architecture, layouts, dtype or bucket size "
            "differ between trainer and generator"
        )
    if h["version"] != version:
        raise BucketError(f"{where}: carries version {h['version']}, expected {version}")
    if (h["index"], h["nbytes"]) != (bucket.index, bucket.nbytes):
        raise BucketError(f"{where}: got bucket {h['index']} of {h['nbytes']} bytes")


def _check_sum(h: dict[str, int], got: int, kind: cks.Kind, bucket: Bucket) -> None:
    if got != h["checksum"]:
        raise BucketError(
            f"{_where(bucket)}: {kind.name} checksum mismatch ({got:#x} != {h['checksum']:#x})"
        )


class Deferred:
    """:func:`verify` of many buckets with one host sync, at :meth:`finish`.

    Each :meth:`add` queues the bucket's checksum on its device and keeps a copy of its
    header and that checksum (72 bytes), so the buffer can take the next bucket at once;
    :meth:`finish` reads them all back and raises what :func:`verify` would have raised
    for the first bad bucket, in the order added. Only for a caller whose writes of an
    unverified bucket are harmless: they must land in a staging copy that is swapped in
    only after :meth:`finish` returned. The receiver checks the checksum kind of its own
    device (the sender's bytes are gone by then): buckets land on a device only when both
    ends are on one.
    """

    def __init__(self) -> None:
        self._rows: list[torch.Tensor] = []
        self._of: list[tuple[Plan, Bucket, int, cks.Kind | None]] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(
        self, buf: torch.Tensor, plan: Plan, bucket: Bucket, version: int, payload: bool = True
    ) -> None:
        kind = cks.for_device(buf.device) if payload else None
        if kind is None:
            head = buf[:HEADER_BYTES].view(torch.int64)
            self._rows.append(torch.cat([head, head.new_zeros(1)]))
        else:
            self._rows.append(_row(buf, bucket, kind))
        self._of.append((plan, bucket, version, kind))

    def finish(self) -> None:
        """Raise :class:`BucketError` for the first bad bucket added since the last call."""
        rows, of = self._rows, self._of
        self._rows, self._of = [], []
        if not rows:
            return
        for row, (plan, bucket, version, kind) in zip(torch.stack(rows).tolist(), of, strict=True):
            h = dict(zip(_FIELDS, row[:8], strict=True))
            _check_header(h, plan, bucket, version)
            if kind is None:
                continue
            if _KIND_OF[h["magic"]] is not kind:
                raise BucketError(
                    f"{_where(bucket)}: the sender checksummed it with "
                    f"{_KIND_OF[h['magic']].name}, a receiver on its device verifies {kind.name}"
                )
            _check_sum(h, row[8], kind, bucket)


def dst_dtype(plan: Plan, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the destination holds ``name`` in (FP8 weights and their scales aside,
    the transfer dtype)."""
    if is_scale(name):
        return torch.float32
    return torch.float8_e4m3fn if plan.quantized(name) else dtype


SrcGetter = pieces.SrcGetter
DstGetter = pieces.DstGetter


def pack(
    buf: torch.Tensor,
    plan: Plan,
    bucket: Bucket,
    src: SrcGetter,
    dtype: torch.dtype,
    version: int,
) -> torch.Tensor:
    """Gather-copy ``bucket``'s source slices into ``buf`` and stamp the header."""
    copy_pieces(buf, plan, bucket, src, dtype)
    write_header(buf, plan, bucket, version)
    return buf[: bucket.nbytes]


@torch.no_grad()  # the sources are live parameters: a weight sync is no autograd op
def copy_pieces(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, src: SrcGetter, dtype: torch.dtype
) -> None:
    """The payload half of :func:`pack` (no header)."""
    block = plan.fp8_block
    typed = pieces.Typed(buf)
    plain = []
    for pl in fused.pack(buf, plan, bucket, src, dtype):  # what no kernel took
        p = pl.piece
        part = src(p.key, p.layer).narrow(p.dim, p.src_start, p.length)  # type: ignore[arg-type]
        data, scale = typed.views(pl, dtype)
        if scale is None:
            plain.append((data, part))
        else:  # block-aligned (checked by the planner): these are the destination's blocks
            q, s = fp8.quantize_blockwise(part, block)  # type: ignore[arg-type]
            data.copy_(q)
            scale.copy_(s)
    pieces.copy(plain, buf.is_cuda)


@torch.no_grad()  # the destinations may be parameters too (a server's, a test's)
def unpack(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, dst: DstGetter, dtype: torch.dtype
) -> None:
    """Scatter-copy a verified message (of ``dtype`` elements) into the destination."""
    typed = pieces.Typed(buf)
    pairs = []
    for pl in fused.unpack(buf, plan, bucket, dst, dtype):  # what no kernel took
        p = pl.piece
        data, scale = typed.views(pl, dtype)
        pairs.append((dst(p.dst_name).narrow(p.dim, p.dst_start, p.length), data))
        if scale is not None:
            b = plan.fp8_block
            assert b is not None  # only an FP8 plan sends scales
            rows = dst(scale_name(p.dst_name)).narrow(p.dim, p.dst_start // b, scale.shape[p.dim])
            pairs.append((rows, scale))
    pieces.copy(pairs, buf.is_cuda)


def zero_fill(plan: Plan, rank: int, dst: DstGetter) -> None:
    """Write the destination's padding rows (the vocab tail), which are never sent."""
    for p in plan.fills:
        if p.dst == rank:
            dst(p.dst_name).narrow(p.dim, p.dst_start, p.length).zero_()
