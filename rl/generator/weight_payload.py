"""Weight payloads for SGLang's ``/update_weights_from_tensor``: buckets and their wire form.

Why buckets: a payload carries tensors by reference (``torch.multiprocessing``'s
``file_system`` strategy puts each storage in a shared-memory file and sends its name), so
the cost is per *storage*, not per byte. Flattening many tensors into one byte buffer per
bucket turns hundreds of shared-memory files per update into a handful, and bounds the
extra memory of an update to one bucket in flight. The byte layout is SGLang's
``flattened_bucket`` load format: a uint8 tensor plus, per tensor, its name, shape, dtype
and ``[start, end)`` byte range (as ``SimpleNamespace``, which SGLang's safe unpickler
accepts). Offsets are aligned so every slice can be viewed back as its dtype.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import cast

import torch

from rl.serving import server_api

ALIGN = 64  # bytes; covers every dtype's itemsize and keeps slices cache-line aligned


def use_file_system_sharing() -> None:
    """SGLang's server opens shared tensors by file name; the default ``file_descriptor``
    strategy would need fd passing over a socket, which HTTP does not do."""
    torch.multiprocessing.set_sharing_strategy("file_system")


@dataclass
class FlatBucket:
    flat: torch.Tensor  # uint8, 1-D
    meta: list[SimpleNamespace]

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.meta]

    @classmethod
    def pack(cls, named: list[tuple[str, torch.Tensor]]) -> FlatBucket:
        """Copy ``named`` into one aligned byte buffer (one gather-copy per tensor)."""
        if not named:
            raise ValueError("cannot pack an empty bucket")
        meta, offset = [], 0
        for name, t in named:
            start = -(-offset // ALIGN) * ALIGN
            nbytes = t.numel() * t.element_size()
            meta.append(
                SimpleNamespace(
                    name=name,
                    shape=torch.Size(t.shape),
                    dtype=t.dtype,
                    start_idx=start,
                    end_idx=start + nbytes,
                    numel=nbytes,
                )
            )
            offset = start + nbytes
        flat = torch.zeros(offset, dtype=torch.uint8)
        for m, (_, t) in zip(meta, named, strict=True):
            flat[m.start_idx : m.end_idx].copy_(
                t.detach().cpu().contiguous().view(-1).view(torch.uint8)
            )
        return cls(flat, meta)

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffer, as the server reconstructs them."""
        return [
            (m.name, self.flat[m.start_idx : m.end_idx].view(m.dtype).view(m.shape))
            for m in self.meta
        ]


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into lists of at most ``bucket_bytes`` (a tensor larger than
    that gets a list of its own). Lazy, so a caller streaming shards never holds more
    than one group."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size() + ALIGN
        if group and size + n > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, t))
        size += n
    if group:
        yield group


SHM_RETRIES = 5


def serialize(obj: object) -> str:
    """SGLang's wire form: ForkingPickler bytes, base64 (one entry per server TP rank).

    Pickling moves tensors into shared memory through torch's ``torch_shm_manager``, whose
    connection times out after a fixed short wait when the machine is overloaded (seen
    once in 200 steps with every core busy): that is retried with a back-off, not fatal."""
    for attempt in range(SHM_RETRIES):
        buf = io.BytesIO()
        try:
            ForkingPickler(buf).dump(obj)
            return base64.b64encode(buf.getvalue()).decode()
        except RuntimeError as e:
            if "Shared memory manager connection has timed out" not in str(e):
                raise
            if attempt == SHM_RETRIES - 1:
                raise
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def hand_back(keep: object) -> None:
    """Give back the reference that pickling ``keep`` (what :func:`update_call` returned)
    took on each of its shared storages, once no server will open the payload.

    Why: torch's ``file_system`` sharing takes one reference per storage when it pickles
    it, for the receivers (the first process to open the file takes it over), and the
    file is unlinked by whoever drops the last reference. A payload no server opened (the
    server was killed first, or refused it before loading) leaves that reference to
    nobody: the bucket would stay in ``/dev/shm`` as long as this process lives, and for
    good once its ``torch_shm_manager`` is killed with it. Handed back although a server
    did open it, the count is one short: the file goes when the last holder but one drops
    it (mappings survive that), and the last one's count ends below zero, which unlinks
    nothing. Never an unlink twice, which aborts the process (a destructor raises)."""
    if isinstance(keep, dict):
        tensors = [t for t in keep.values() if isinstance(t, torch.Tensor)]
    else:
        tensors = [t for _, t in cast("list[tuple[str, torch.Tensor]]", keep)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    for storage in storages.values():  # one reference per storage, however many views
        if storage.is_shared():
            storage._shared_decref()


def update_call(
    payload: FlatBucket | list[tuple[str, torch.Tensor]], tp: int
) -> tuple[server_api.Call, object]:
    """The ``/update_weights_from_tensor`` call of one payload to a server with ``tp``
    ranks (SGLang wants one serialized entry per rank; each rank's loader cuts its own
    shard), and the object that owns its shared storages: keep that alive until the
    server has answered, or the shared-memory files may be gone before the server opens
    them; :func:`hand_back` it if no server opened it."""
    if isinstance(payload, FlatBucket):
        keep: object = {"flattened_tensor": payload.flat, "metadata": payload.meta}
        load_format = "flattened_bucket"
    else:
        keep = [(n, t.detach().cpu().contiguous()) for n, t in payload]
        load_format = None
    return server_api.update_weights_from_tensor([serialize(keep)] * tp, load_format), keep
