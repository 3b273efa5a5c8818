"""DDMA into a live SGLang server through its weight-update API (rl/serving/server_api.py).

Every transport (rl/ddma/transport.py, ``rollout.weight_sync.transport``) ends in one
receiver (:mod:`rl.ddma.sglang_receiver`, staging then commit), and this target is what a
server is to each side of the transport's lifecycle:

* to a trainer rank's sending half (rl/ddma/sender.py, which gets this class injected),
  the server's weight-update API: :meth:`SGLangTarget.post` carries one request, an
  entry per server rank (a staged transport, ``ipc`` or ``cuda_ipc``, names its slots
  there), and :meth:`~SGLangTarget.check` reads the ranks' statuses;
  :meth:`~SGLangTarget.push` does it all for one server alone, as tests and benchmarks do;
* to the controller (one process, rl/controller/weight_sync.py), the server's side of a
  version: :meth:`open_group` puts its ranks in a DDMA group (a group transport, ``p2p``
  or ``p2p_shm``, one per server or one for many with relays), :meth:`receive` has them
  take a version in a request of their own (from the trainer ranks or, relayed, from the
  same rank of a parent server, rl/ddma/relay.py), and :meth:`begin` and
  :meth:`commit` / :meth:`abort` bracket the transfer: generation is paused only for
  that window, and a failed version is discarded whole.

A version is never served over KV that another version computed: :meth:`commit` empties
the server's prefix cache (``/flush_cache``) while generation is paused and before the
staged weights are swapped in, and a server that keeps refusing the flush gets the
version aborted instead (:class:`NotFlushed`).

Every call carries the server's admin key: the target's own (tests, benchmarks: the
launcher's), else the job's (:func:`rl.serving.server_api.job_keys`), which trainer
ranks and the controller derive from the job's secret, so the generic sender
(rl/ddma/sender.py) never handles keys.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from concurrent.futures import Future
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch

from rl.ddma import group, wire
from rl.ddma import sglang_receiver as rx
from rl.ddma import transport as transports
from rl.ddma.engine import TransferError, TransferStats
from rl.ddma.plan import Plan
from rl.ddma.relay import NO_RELAY, Fanout
from rl.generator.weight_payload import hand_back, serialize, use_file_system_sharing
from rl.serving import server_api as api
from rl.threads import thread_pool

# The weight version a server reports while its weights are being written in place
# (rollout.weight_sync.staging=none) and after such a version failed: it matches no real
# version, so clients route it nothing until a complete version is committed.
NOT_READY = -1
# How long a commit keeps asking a server to flush its prefix cache before it aborts the
# version there. SGLang answers a flush with HTTP 400 while a batch still holds KV (an
# in_place pause keeps its running batch); each refusal retracts generation again, which
# empties the batch within one scheduler step, so a refusal that outlasts this is no race.
FLUSH_DEADLINE_S = 10.0
FLUSH_WAIT_S = (0.05, 1.0)  # the wait after the first refusal, doubled up to the second


class SyncError(RuntimeError):
    """The server refused or lost a version; it keeps serving the previous one (with
    staging none and weights written in part: it stays paused, reporting NOT_READY)."""


class UpstreamLost(SyncError):
    """The server missed the version because a relaying server above it was lost."""


class NotFlushed(SyncError):
    """The server refused to flush its prefix cache until the deadline: the version was
    aborted there (as a failed commit is), so it never serves it over old KV."""


class SGLangTarget:
    """One SGLang server (``plan.dst.tp`` ranks) at ``url``, fed under ``plan`` over
    ``transport`` with buckets on ``device`` (its :meth:`~Transport.bucket_device`);
    ``keys``: the server's (None: the job's)."""

    def __init__(
        self,
        url: str,
        plan: Plan,
        dtype: torch.dtype,
        *,
        timeout: float = 120.0,
        staging: str = "device",
        keys: api.ServerKeys | None = None,
        transport: str = "ipc",
        overlap: bool = False,
        device: str = "cpu",
        flush_deadline: float = FLUSH_DEADLINE_S,
    ) -> None:
        self.url, self.plan, self.dtype, self.timeout = url.rstrip("/"), plan, dtype, timeout
        self.flush_deadline = flush_deadline
        self.transport = transports.get(transport)
        # Where the buckets lie: the group's backend, the slots and the server ranks'
        # receive buffers follow it.
        self.device = device
        # Servers that take a version in a request of their own, into a staging copy:
        # generation is paused only to open the version and to commit it, and goes on
        # while the buckets arrive (rollout.weight_sync.overlap).
        self.overlap = overlap and self.transport.overlaps and staging != "none"
        self._session = False  # SGLang's weight-update session is open (generation paused)
        self.keys = keys or api.job_keys()
        self.staging = staging  # rollout.weight_sync.staging: sent with every begin
        self._previous: int | None = None  # staging none: the version before begin
        # Each rank's receiver as its last commit or discard reported it: staging, the
        # bytes it holds for staging, and whether its weights are torn (staging none).
        self.receivers: list[dict] = []
        self.spec = rx.plan_spec(plan, dtype)
        use_file_system_sharing()  # else SGLang's scheduler dies unpickling any tensor
        self._pool = thread_pool("ddma-control", 2)
        # One trainer rank's sending half into this server alone (push), by its rank.
        self._senders: dict[int, transports.Sending] = {}
        self.server_seconds = 0.0  # staged: summed over the requests this target made
        self.requests = 0
        self.status_dir = rx.status_dir()  # the only place the server writes statuses

    # ------------------------------------------------------------------ one request
    def post(self, entries: list[transports.Entry]) -> list[dict]:
        """Send one control entry per server TP rank; return each rank's status."""
        request = uuid.uuid4().hex
        status = str(self.status_dir / f"{request}.rank{{rank}}.json")
        payload = [serialize([(json.dumps({**ctl, "status": status}), t)]) for ctl, t in entries]
        try:
            reply = self._call(api.update_weights_from_tensor(payload, api.DDMA_LOAD_FORMAT))
        except TransferError:  # the server is gone: no one will open what was pickled
            for ctl, t in entries:  # each pickling took a reference (hand_back)
                hand_back([(ctl.get("op", ""), t)])
            raise
        if (why := api.refusal(reply)) is not None:
            raise SyncError(f"{self.url}: {why}")
        out = []
        for rank in range(len(entries)):
            path = Path(status.format(rank=rank))
            if not path.exists():
                raise SyncError(
                    f"{self.url} rank {rank} wrote no status ({path}; a server writes them "
                    f"only in its {rx.STATUS_DIR_ENV}, and logs why it did not)"
                )
            out.append(json.loads(path.read_text()))
            path.unlink()
        return out

    def _call(self, call: api.Call) -> Any:  # a JSON value
        try:
            return api.call(self.url, call, self.keys, self.timeout)
        except api.CallError as e:
            raise self._error(e) from e

    def _error(self, e: api.CallError) -> SyncError | TransferError:
        if e.answered:
            return SyncError(str(e))
        return TransferError(f"generator {self.url} disconnected during {e.route}: {e.detail}")

    def _control(self, op: str, version: int, **extra: object) -> list[dict]:
        ctl = {"op": op, "plan": self.spec, "version": version, **extra}
        empty = torch.zeros(1, dtype=torch.uint8)
        statuses = self.post([(ctl, empty)] * self.plan.dst.tp)
        bad = [s for s in statuses if not s.get("ok")]
        if bad:
            why = f"{self.url} version {version} {op} failed: {bad[0]['error']}"
            raise UpstreamLost(why) if all(s.get("upstream_lost") for s in bad) else SyncError(why)
        return statuses

    # ------------------------------------------------------------------ trainer side
    def check(self, statuses: list[dict]) -> None:
        """Raise :class:`SyncError` if a rank refused what a request carried."""
        if os.environ.get("DDMA_DEBUG"):
            print("   server:", [round(s.get("seconds", -1), 3) for s in statuses])
        # What the server's ranks spent verifying and scattering (the rest of a request's
        # time is HTTP and SGLang's dispatch to its scheduler).
        self.requests += 1
        self.server_seconds += max((s.get("seconds", 0.0) for s in statuses), default=0.0)
        for s in statuses:
            if not s.get("ok"):
                raise SyncError(f"{self.url} refused a bucket: {s['error']}")

    def sender(self, src_rank: int) -> transports.Sending:
        """Trainer rank ``src_rank``'s sending half into this server alone (tests,
        benchmarks; the job's trainer ranks use rl/ddma/sender.py), kept across versions.
        A group transport's joins this server's group (see :meth:`open_group`) with
        ``join(address, [port], [[0]])``."""
        if src_rank not in self._senders:
            link = transports.Link(plan=self.plan, rank=src_rank, dtype=self.dtype,
                                   targets=[self], device=group.local(self.device),
                                   relaying=NO_RELAY, timeout=self.timeout)  # fmt: skip
            self._senders[src_rank] = self.transport.prepare(link)
        return self._senders[src_rank]

    def push(self, src_rank: int, shards: wire.SrcGetter, version: int) -> TransferStats:
        """Trainer rank ``src_rank``'s buckets of ``version`` into this server alone (the
        controller's part, :meth:`begin` to :meth:`commit`, is the caller's); raises
        :class:`TransferError` if the server is lost."""
        stats, lost = self.sender(src_rank).send(shards, version)
        if lost:
            raise TransferError(stats.error)
        return stats

    # ------------------------------------------------------------------ controller side
    def open_group(
        self, name: str, address: str, port: int, position: int = 0, servers: int = 1
    ) -> Future:
        """Ask every server rank to join the DDMA group ``name`` as the ``position``-th of
        its ``servers`` servers (trainer ranks join with :func:`rl.ddma.group.join` at
        the same time; the call returns once all did)."""
        n, tp = self.plan.src.world, self.plan.dst.tp
        call = api.init_weights_update_group(address, port, n + position * tp, n + servers * tp,
                                             name, group.backend(self.device))  # fmt: skip
        return self._pool.submit(self._call, call)

    def receive(
        self, version: int, name: str, route: Fanout | None = None, replica: int = 0
    ) -> Future:
        """Have every server rank receive its buckets of ``version`` over group ``name``
        into staging, as replica ``replica`` of ``route`` (None: the only server fed);
        resolves when they have (raises :class:`SyncError`, :class:`UpstreamLost` if a
        relaying server above this one was lost). With ``overlap`` it resolves once they
        have started, and generation resumes meanwhile: :meth:`commit` waits for them."""
        where = {} if route is None else {
            "relay": route.relay, "parents": list(route.parents),
            "positions": list(route.positions), "replica": replica,
        }  # fmt: skip
        return self._pool.submit(self._receive, version, name, where)

    def _receive(self, version: int, name: str, where: dict) -> list[dict]:
        statuses = self._control("receive", version, group=name, transport=self.transport.name,
                                 background=self.overlap, device=self.device, **where)  # fmt: skip
        if self.overlap:
            self._resume()
        return statuses

    def _pause(self) -> None:
        """Pause generation (requests go back to the queue) and open a weight update."""
        self._call(api.pause_generation("retract"))
        self._call(api.begin_weight_update())
        self._session = True

    def _resume(self) -> None:
        self._call(api.end_weight_update())
        self._session = False
        self._call(api.continue_generation())

    def begin(self, version: int) -> None:
        """Pause generation (requests go back to the queue; with ``overlap`` they stay, as
        generation resumes once the receive has started) and open a weight update. With
        staging none the server reports NOT_READY from here until a version commits."""
        self._call(api.pause_generation("in_place" if self.overlap else "retract"))
        if self.staging == "none":
            self._previous = api.weight_version(self._call(api.model_info()))
            self._call(api.update_weight_version(NOT_READY))
        self._call(api.begin_weight_update())
        self._session = True
        # Drops the leftovers of a version that never committed; sets this one's staging.
        self._control("discard", version, staging=self.staging)

    def commit(self, version: int) -> None:
        """Once every rank holds all of the staged version, drop the prefix cache, swap the
        version in on every rank, set the server's version and resume generation. Raises
        :class:`NotFlushed` (the version aborted here) if the cache was not dropped."""
        try:
            if not self._session:  # overlap: generation went on while the buckets came
                self._pause()
            self._control("prepare", version)
            # Before the swap: while generation is paused the scheduler computes no KV, so
            # from here to continue_generation the cache can only get the new weights'. A
            # flush after the swap could fail with the old weights already gone.
            self._flush(version)
            self.receivers = self._control("commit", version)
        except BaseException:
            self.abort(version)
            raise
        self._call(api.end_weight_update())
        self._session = False
        self._call(api.update_weight_version(version))
        self._call(api.continue_generation())

    def _flush(self, version: int) -> None:
        """Empty the server's prefix cache, retracting generation again after each refusal,
        until ``flush_deadline``; else say so in one line and raise :class:`NotFlushed`."""
        t0 = time.monotonic()
        wait, tries = FLUSH_WAIT_S[0], 0
        while True:
            tries += 1
            try:
                api.call(self.url, api.flush_cache(), self.keys, self.timeout)
                return
            except api.CallError as e:
                # SGLang 0.5.23 answers 400 when it did not flush (its scheduler not idle,
                # or another caller's flush waiting for idle); no other answer is a race
                # that a retry could win.
                if e.status != HTTPStatus.BAD_REQUEST:
                    raise self._error(e) from e
                last = e.detail.strip()
            if time.monotonic() - t0 + wait > self.flush_deadline:
                break
            # A batch still running (an in_place pause keeps it, a request may have slipped
            # in) goes back to the queue, its KV freed.
            self._call(api.pause_generation("retract"))
            time.sleep(wait)
            wait = min(2 * wait, FLUSH_WAIT_S[1])
        why = (
            f"[ddma] {self.url}: weight version {version} aborted on this server: it refused "
            f"to flush its prefix cache {tries} times in {time.monotonic() - t0:.1f}s "
            f"(HTTP 400: {last!r}), and a version is never served over older KV"
        )
        print(why, flush=True)
        raise NotFlushed(why)

    def abort(self, version: int) -> None:
        """Drop the staged version; the server resumes on its previous weights, unless they
        were written in part (staging none): then it stays paused and NOT_READY."""
        torn = self.staging == "none"  # unless every rank says otherwise
        try:
            if not self._session:
                self._pause()
            self.receivers = self._control("discard", version, staging=self.staging)
            torn = any(s.get("torn") for s in self.receivers)
        finally:
            self._call(api.end_weight_update())
            self._session = False
            if not torn:
                if self._previous is not None:
                    self._call(api.update_weight_version(self._previous))
                self._call(api.continue_generation())
