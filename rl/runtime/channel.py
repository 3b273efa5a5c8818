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
The libuv store refuses values over 8 MB: larger messages (up to ``MAX_BYTES``) go as
chunks under their own keys, with only a small signed descriptor in the queue (several
writers may share a queue), which names the chunks, their size and their digest.

The store listens on every interface, so what ``get`` pops is untrusted until checked.
Messages are encoded by :mod:`rl.runtime.codec` (a schema codec: decoding never runs code
the bytes name) and carry an HMAC-SHA256 tag under the job's key
(:mod:`rl.runtime.secret`) over the channel's name, the writer's id and sequence number and
the message (a chunked one: its descriptor, checked before any chunk is fetched): a
message cannot be forged, moved to another channel, nor replayed on its own. A message
that fails any check is dropped, counted (:attr:`Channel.rejected`,
:func:`rejected_total`) and logged in one line, and ``get`` goes on waiting for the next
one.

A process on the node that reaches the store but lacks the key could still *pop* what it
can name, and a message popped is a message lost (a score request: a group waiting for
ever). So a channel's queue and chunk keys are named by :func:`queue_name`, a tag of the
channel's name under the job's key: without the key no one can name them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from rl.runtime import codec, secret

if TYPE_CHECKING:
    from torch.distributed import Store

CHUNK = 4 << 20
M = TypeVar("M")
# A queued value: kind (1 byte) | tag (32) | writer id (16) | sequence number (8) | body,
# the body being the message itself (inline) or the JSON list of its chunks' keys.
_INLINE, _BLOB = b"I", b"B"
_WRITER, _SEQ = 16, 8
_PREFIX = 1 + secret.TAG_BYTES + _WRITER + _SEQ
# The largest message (a trainer batch at the presets' sizes is well under it): a reader
# never fetches more for one descriptor.
MAX_BYTES = 1 << 30
log = logging.getLogger(__name__)
_rejected_lock = threading.Lock()
_rejected_total = 0


class ChannelError(RuntimeError):
    """A message that is not one the channel carries, or no message in time."""


class ProtocolError(ChannelError):
    """An authentic message (signed with the job's key) that breaks the protocol of its
    channel, such as a reply to a request that is not pending. The message names the
    channel and says all there is (a traceback would only show the reader's own code), so
    the launcher reports it in one line (rl/runtime/launch.py)."""


class ChannelTimeout(ChannelError):
    """No message arrived within the wait: for a rank that idles by design (a generator
    rank between start and stop), the normal state, not a failure."""


class _Rejected(Exception):
    """A popped value that is not an authentic message of the channel (internal)."""


def rejected_total() -> int:
    """Messages every channel of this process has dropped (bad tag, undecodable, not a
    declared type, replayed): a metric for the controller; above 0, someone other than
    the job writes to its store."""
    return _rejected_total


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


def queue_name(key: bytes, name: str) -> str:
    """The store key of channel ``name``'s queue: the name, for logs, and 16 bytes of its
    tag under the job's key, which no process without the key can compute."""
    return f"{name}/{secret.derive(key, 'queue/' + name)[:32]}"


class Channel:
    """``put`` from any rank, ``get`` on the one reader. One connection per instance: make
    one instance per thread that uses it (a blocking ``get`` holds its connection).
    ``key`` is the job's secret (:func:`rl.runtime.secret.load`), the same on every rank."""

    def __init__(
        self, store: Store, name: str, types: tuple[type, ...], timeout: float, *, key: bytes
    ):
        if len(key) < 16:
            raise ChannelError(f"channel {name!r}: the job's key is missing or too short")
        self.store = store.clone()
        self.name, self.types, self.timeout = name, tuple(types), timeout
        self._schema = (*self.types, Failed)
        try:  # a type the codec cannot carry fails here, not at the first message
            codec.check_types(self._schema)
        except codec.CodecError as e:
            raise ChannelError(f"channel {name!r}: {e}") from None
        self._key, self._scope = key, b"msrl/channel\0" + name.encode() + b"\0"
        self._queue = queue_name(key, name)
        self._lock = threading.Lock()
        self._writer, self._seq = secrets.token_bytes(_WRITER), itertools.count(1)
        self._last: dict[bytes, int] = {}  # writer -> last sequence number read
        self.rejected = 0  # messages dropped by this endpoint

    def put(self, msg: object) -> None:
        if not isinstance(msg, self._schema):
            raise ChannelError(
                f"channel {self.name!r} carries {self._names()}, not {type(msg).__name__}"
            )
        try:
            data = codec.encode(msg, self._schema)
        except codec.CodecError as e:
            raise ChannelError(f"channel {self.name!r}: cannot send {e}") from None
        if len(data) > MAX_BYTES:
            raise ChannelError(
                f"channel {self.name!r}: a {type(msg).__name__} of {len(data)} bytes is over "
                f"the {MAX_BYTES} a message may take"
            )
        with self._lock:
            seq = next(self._seq)
            stamp = self._writer + seq.to_bytes(_SEQ, "big")
            kind, body = _INLINE, data
            if len(data) > CHUNK:
                blob = f"{self._queue}/blob/{os.getpid()}-{self._writer.hex()}-{seq}"
                keys = [f"{blob}/{i}" for i in range(0, len(data), CHUNK)]
                for key, i in zip(keys, range(0, len(data), CHUNK), strict=True):
                    # Store.set takes bytes too (torch's stub says str only).
                    self.store.set(key, data[i : i + CHUNK])  # type: ignore[arg-type]
                # Signed in the message's place, the descriptor carries the chunks' size and
                # digest: a reader checks it before it fetches anything.
                kind, body = _BLOB, json.dumps({"keys": keys, "size": len(data),
                                                "sha256": hashlib.sha256(data).hexdigest()}
                                               ).encode()  # fmt: skip
            tag = secret.sign(self._key, self._scope + stamp + body)
            self.store.queue_push(self._queue, kind + tag + stamp + body)

    def get(self, timeout: float | None = None) -> object:
        """The next authentic message (blocks up to ``timeout``, default the channel's):
        one of the channel's types, which the caller tells apart (or :meth:`expect` one).
        Anything else popped meanwhile is dropped and counted, and the wait goes on."""
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._lock:
            while True:
                raw = self._pop(deadline - time.monotonic(), wait)
                try:
                    msg = self._open(raw)
                    break
                except _Rejected as e:
                    self._reject(str(e))
        if isinstance(msg, Failed):
            raise RemoteError(f"{msg.role} rank {msg.rank} failed:\n{msg.error}")
        return msg

    def _pop(self, left: float, wait: float) -> bytes:
        timed_out = ChannelTimeout(f"no message on channel {self.name!r} within {wait:.0f}s")
        deadline = time.monotonic() + left
        while (left := deadline - time.monotonic()) > 0:
            self.store.set_timeout(timedelta(seconds=left))
            try:
                return self.store.queue_pop(self._queue)
            except _store_error() as e:
                if "timeout" in str(e).lower():
                    break
                # The store's pop waits for the queue, then pops: another process popping
                # in between (none of the job's) leaves it empty. Wait again.
                if "queue is empty" not in str(e):
                    raise
        raise timed_out

    def _open(self, raw: bytes) -> object:
        """The message in one popped value, or :class:`_Rejected` saying why not."""
        t = 1 + secret.TAG_BYTES
        kind, tag, stamp, body = raw[:1], raw[1:t], raw[t:_PREFIX], raw[_PREFIX:]
        if len(raw) < _PREFIX or kind not in (_INLINE, _BLOB):
            raise _Rejected(f"{len(raw)}-byte value of kind {kind!r} is not a channel message")
        # Inline, the tag covers the message; chunked, the descriptor (with the chunks'
        # size and digest), so nothing is fetched for a value not signed by the job.
        if not secret.verify(self._key, self._scope + stamp + body, tag):
            raise _Rejected("bad tag (not signed with the job's key for this channel)")
        writer, seq = stamp[:_WRITER], int.from_bytes(stamp[_WRITER:], "big")
        if seq <= self._last.get(writer, 0):
            raise _Rejected(f"replayed message (writer {writer.hex()[:8]} sequence {seq})")
        self._last[writer] = seq
        data = body if kind == _INLINE else self._chunks(body)
        try:
            return codec.decode(data, self._schema)
        except codec.CodecError as e:
            raise _Rejected(f"undecodable: {e}") from None

    def _chunks(self, body: bytes) -> bytes:
        """A chunked message, reassembled from the keys its (authentic) descriptor lists,
        which must be this channel's chunk keys, all present, adding up to its size and
        digest."""
        try:
            desc = json.loads(body)
            keys, size, digest = desc["keys"], desc["size"], desc["sha256"]
        except (ValueError, TypeError, KeyError):
            raise _Rejected("chunk descriptor is not one of ours") from None
        prefix = f"{self._queue}/blob/"
        if not (
            isinstance(size, int)
            and 0 < size <= MAX_BYTES
            and isinstance(keys, list)
            and len(keys) == -(-size // CHUNK)
            and all(isinstance(k, str) and k.startswith(prefix) for k in keys)
        ):
            raise _Rejected(f"chunk descriptor is not {prefix}* keys of at most {MAX_BYTES} bytes")
        if not self.store.check(keys):
            raise _Rejected("chunk descriptor names keys that do not exist")
        data = b"".join(self.store.multi_get(keys))
        for key in keys:
            self.store.delete_key(key)
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise _Rejected("chunks do not match their descriptor's size and digest")
        return data

    def _reject(self, why: str) -> None:
        global _rejected_total
        self.rejected += 1
        with _rejected_lock:
            _rejected_total += 1
        why = why.replace("\n", " ")  # one line, whatever a peer's error held
        log.warning("channel %r: dropped a message: %s", self.name, why[:400])

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
