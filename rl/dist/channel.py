"""Typed one-way channels between the controller and the executors, over the job's store.

Why the store: every rank of a launch already shares one (torchrun's agent store, or the
TCPStore rank 0 hosts under our spawner), it works across hosts, and it has real blocking
queues (``queue_push`` / ``queue_pop``), so no rank polls and no extra port or process
group is needed. Control messages and rollout batches are small; weights never travel
here (DDMA moves them trainer -> generator directly).

A channel declares the message types it carries; ``put`` and ``get`` both check them, so a
protocol slip fails where it happens with both type names. Any executor that raises sends
:class:`Failed` on its reply channel, and ``get`` raises it as :class:`RemoteError` with
the remote traceback, so the controller never waits out a timeout for a dead peer.
The libuv store refuses values over 8 MB: larger messages go as chunks under their own
keys, with only a small descriptor in the queue (several writers may share a queue).
"""

from __future__ import annotations

import io
import itertools
import json
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from torch.distributed import Store

CHUNK = 4 << 20
M = TypeVar("M")
_INLINE, _BLOB = b"I", b"B"


class ChannelError(RuntimeError):
    """A message that is not one the channel carries, or no message in time."""


class ChannelTimeout(ChannelError):
    """No message arrived within the wait: for a rank that idles by design (a generator
    rank between start and stop), the normal state, not a failure."""


class RemoteError(RuntimeError):
    """An executor failed; the message carries its role, rank and traceback."""


@dataclass
class Failed:
    """Sent by an executor rank that raised, before it exits."""

    role: str
    rank: int
    error: str


def _store_error() -> type[BaseException]:
    import torch.distributed as dist

    return dist.DistError


class Channel:
    """``put`` from any rank, ``get`` on the one reader. One connection per instance: make
    one instance per thread that uses it (a blocking ``get`` holds its connection)."""

    def __init__(self, store: Store, name: str, types: tuple[type, ...], timeout: float):
        self.store = store.clone()
        self.name, self.types, self.timeout = name, tuple(types), timeout
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def put(self, msg: object) -> None:
        if not isinstance(msg, (*self.types, Failed)):
            raise ChannelError(
                f"channel {self.name!r} carries {self._names()}, not {type(msg).__name__}"
            )
        buf = io.BytesIO()
        torch.save(msg, buf)
        data = buf.getvalue()
        with self._lock:
            if len(data) <= CHUNK:
                self.store.queue_push(self.name, _INLINE + data)
                return
            blob = f"{self.name}/blob/{os.getpid()}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            keys = [f"{blob}/{i}" for i in range(0, len(data), CHUNK)]
            for key, i in zip(keys, range(0, len(data), CHUNK), strict=True):
                # Store.set takes bytes too (torch's stub says str only).
                self.store.set(key, data[i : i + CHUNK])  # type: ignore[arg-type]
            self.store.queue_push(self.name, _BLOB + json.dumps(keys).encode())

    def get(self, timeout: float | None = None) -> object:
        """The next message (blocks up to ``timeout``, default the channel's): one of the
        channel's types, which the caller tells apart (or :meth:`expect` one)."""
        wait = self.timeout if timeout is None else timeout
        with self._lock:
            self.store.set_timeout(timedelta(seconds=wait))
            try:
                raw = self.store.queue_pop(self.name)
                if raw[:1] == _BLOB:
                    keys = json.loads(raw[1:])
                    data = b"".join(self.store.multi_get(keys))
                    for key in keys:
                        self.store.delete_key(key)
                else:
                    data = raw[1:]
            except _store_error() as e:
                if "timeout" in str(e).lower():
                    raise ChannelTimeout(
                        f"no message on channel {self.name!r} within {wait:.0f}s"
                    ) from None
                raise
        msg = torch.load(io.BytesIO(data), weights_only=False)
        if isinstance(msg, Failed):
            raise RemoteError(f"{msg.role} rank {msg.rank} failed:\n{msg.error}")
        if not isinstance(msg, self.types):
            raise ChannelError(
                f"channel {self.name!r} expected {self._names()}, got {type(msg).__name__}"
            )
        return msg

    def wait(self) -> object:
        """The next message, however long it takes: for an executor's inbox, where no
        command for a while (a long warm-up, a long evaluation) is normal. A dead
        controller still ends the wait: its store's connection breaks."""
        while True:
            try:
                return self.get()
            except ChannelTimeout:
                continue

    def expect(self, kind: type[M], timeout: float | None = None) -> M:
        """The next message, which must be a ``kind``."""
        msg = self.get(timeout)
        if not isinstance(msg, kind):
            raise ChannelError(
                f"channel {self.name!r}: expected {kind.__name__}, got {type(msg).__name__}"
            )
        return msg

    def _names(self) -> str:
        return " | ".join(t.__name__ for t in self.types)
