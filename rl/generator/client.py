"""The generator client: token-in/token-out rollouts over N SGLang servers.

Why this shape: the controller must never wait for a whole batch. ``submit`` returns one
``concurrent.futures.Future`` per sample at once, and ``as_completed`` hands rollouts to
the controller in the order they finish, while one asyncio loop (on a background thread)
keeps up to ``max_in_flight`` requests per server in the air and routes each new request
to the least-loaded live server. Token ids go in and come out unchanged (the servers run
with ``--skip-tokenizer-init``), so the trainer scores exactly the tokens that were
sampled, with the log-prob and weight version SGLang reports for each.

Weight updates follow SGLang's protocol: pause (``retract`` keeps requests queued on the
server and resumes them under the new weights, with per-token version spans), begin, load
the buckets, end, flush the prefix cache (stale KV from old weights must not be reused),
check the server reports the new version, continue.

Routing replay (``limits.routing`` set): every request asks for the experts each token
was routed to, and a reply whose routing does not fit is dropped and sampled again
(rl/generator/routing.py).

Lost servers: a request whose server stops answering is re-queued on another live server
(the rollout keeps every token it had, with their versions; what the lost server was
generating is gone and sampled again), and that server gets nothing more until
:meth:`revive`. With ``wait_for_server`` > 0 a request that finds no server ready waits
that long for one (its generator rank restarts it) instead of failing at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import itertools
import time
from collections.abc import Collection, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import aiohttp
import torch

from rl.config.sampling import RequestError, SamplingParams
from rl.generator import routing
from rl.generator.types import (
    ModelLimits,
    Rollout,
    collapse_pads,
    new_rollouts,
    parse_result,
)
from rl.generator.weight_payload import (
    FlatBucket,
    buckets,
    hand_back,
    update_call,
    use_file_system_sharing,
)
from rl.models.vision.images import data_uri
from rl.serving import server_api as api
from rl.serving.launcher import ServerError, ServerLauncher
from rl.threads import start_thread

if TYPE_CHECKING:
    from rl.config.schema import RolloutConfig

_seq = itertools.count()
# An image file read once per group, not once per sample and segment.
_image = functools.lru_cache(maxsize=256)(data_uri)
_LOST = object()  # what _all records for a server that did not answer
T = TypeVar("T")


class RolloutFuture(cf.Future[Rollout]):
    """A rollout's future; it carries the rollout while it runs (to ``abort`` it)."""

    def __init__(self, rollout: Rollout) -> None:
        super().__init__()
        self.rollout = rollout


KEEPALIVE_S = 2.0


class ServerLost(ServerError):
    """A server that stopped answering: marked dead; its requests are re-queued."""

    def __init__(self, server: int, message: str) -> None:
        super().__init__(message)
        self.server = server


# The requests a lost server held fail together, within milliseconds: their re-queues are
# counted for this long, then reported in one line per lost server.
REQUEUE_REPORT_S = 0.5
# Replies in a row with routing that does not fit, for one rollout, before the server is
# taken to be misconfigured rather than unlucky (and the job fails).
ROUTING_RETRIES = 3
# A server marked unreachable by a failed request is asked this often whether it answers
# again (each ask waits this long for the answer).
PROBE_S = 5.0
PROBE_TIMEOUT_S = 5.0


class GeneratorClient:
    def __init__(
        self,
        urls: list[str],
        limits: ModelLimits,
        *,
        keys: api.ServerKeys,  # the servers' keys (launcher.keys, or api.job_keys())
        max_in_flight: int = 64,
        request_timeout: float = 600.0,
        launcher: ServerLauncher | None = None,
        tp: int = 1,
        wait_for_server: float = 0.0,
    ):
        if not urls:
            raise ServerError("generator client needs at least one server URL")
        if max_in_flight < 1:
            raise ValueError(f"generator.max_in_flight={max_in_flight} must be >= 1")
        use_file_system_sharing()
        self.urls = list(urls)
        self.limits = limits
        self.keys = keys
        self.launcher = launcher
        self.tp = tp  # TP ranks per server: weight payloads carry one entry per rank
        self._timeout = aiohttp.ClientTimeout(total=request_timeout)
        self._max_in_flight = max_in_flight
        self._in_flight = [0] * len(urls)
        self._dead: set[int] = set()
        # Dead on the word of the server's generator rank (being restarted): only revive()
        # routes to it again. The others in _dead are probed (_probe_lost).
        self._held: set[int] = set()
        self._probe: asyncio.Future | None = None
        self._dead_at: dict[int, int] = {}  # the client's version when a request failed
        self._updating = False  # update_weights is under way: no server comes back now
        self.revived = 0  # unreachable servers that answered again
        # Live but behind: restarted with its checkpoint's weights. Not given rollouts until
        # update_weights brings it to the client's version.
        self._stale: set[int] = set()
        self._active: dict[str, tuple[int, str]] = {}  # rollout rid -> (server, SGLang rid)
        self._user_aborted: set[str] = set()
        self.wait_for_server = wait_for_server
        self.requeued = 0  # rollouts re-sent after their server was lost
        self.requeued_rids: list[str] = []  # their ids, for the run's rollout ledger
        self.routing_dropped = 0  # segments sampled again: their routing did not fit
        self._unreported: dict[int, int] = {}  # lost server -> rollouts re-queued, not yet said
        self.no_server_s = 0.0  # seconds with requests waiting and no server ready
        self._no_server_since: float | None = None
        self._failure_error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = start_thread("generator-client", self._loop.run_forever)
        self._session: aiohttp.ClientSession = self._call(self._make_session())
        self._slots = [self._call(self._make_slots()) for _ in urls]
        self._ready_event: asyncio.Event = self._call(self._make_event())
        versions = self.weight_versions()
        if not versions:
            self.close()
            raise ServerError(f"no generator server answers at {urls}")
        if len(set(versions)) != 1:
            self.close()
            raise ServerError(f"generator servers serve different weight versions: {versions}")
        self.version = versions[0]

    @classmethod
    def for_launcher(
        cls, launcher: ServerLauncher, *, max_in_flight: int = 64, request_timeout: float = 600.0
    ) -> GeneratorClient:
        cfg = launcher.config
        limits = ModelLimits.from_model_dir(
            Path(cfg.model_path), cfg.context_length, routing=cfg.return_routed_experts
        )
        return cls(launcher.urls, limits, keys=launcher.keys, max_in_flight=max_in_flight,
                   request_timeout=request_timeout, launcher=launcher, tp=cfg.tp)  # fmt: skip

    @classmethod
    def for_urls(
        cls,
        urls: list[str],
        model_path: str,
        rollout: RolloutConfig,
        keys: api.ServerKeys,
        *,
        routing: bool = False,
    ) -> GeneratorClient:
        """A client for servers started elsewhere (the generator ranks of an RL job) from
        ``model_path`` and requiring ``keys``, with a ``rollout`` config's limits. A request
        that finds no server ready waits for a restart (the server's start-up deadline and
        a weight sync). ``routing``: ``algorithm.routing_replay`` (servers started with
        ``ServerConfig.return_routed_experts``)."""
        limits = ModelLimits.from_model_dir(Path(model_path), rollout.context_length, routing)
        wait = rollout.startup_timeout + rollout.weight_sync.timeout
        return cls(urls, limits, keys=keys, max_in_flight=rollout.max_in_flight,
                   request_timeout=rollout.request_timeout, tp=rollout.tp,
                   wait_for_server=wait)  # fmt: skip

    async def _make_session(self) -> aiohttp.ClientSession:
        # Idle connections are dropped before SGLang's uvicorn drops them (after 5 s), so a
        # request rarely goes out on a connection the server has closed (server_api.acall
        # retries the one that does).
        conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        return aiohttp.ClientSession(connector=conn, timeout=self._timeout)

    async def _make_slots(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self._max_in_flight)

    async def _make_event(self) -> asyncio.Event:
        return asyncio.Event()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the client's loop and wait for it (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ---- rollouts ---------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        group: int | None = None,
        segment_tokens: int | None = None,
        rid: str | None = None,
        images: tuple[str, ...] = (),
    ) -> list[RolloutFuture]:
        """Start ``sampling.n`` rollouts of one prompt, sent as one request (see
        ``resume_many``). Validation happens here, so a bad request raises before anything
        is sent. With ``segment_tokens``, each future resolves after at most that many new
        tokens; resume it with ``resume``. ``rid``: the stem of the rollouts' ids
        (``<rid>.<sample>``), unique among the client's rollouts; None: made up here.
        ``images``: a vision-language prompt's images (``prompt_ids`` holds their tokens
        expanded; every reply's prompt token count is checked against it)."""
        self.limits.check(prompt_ids, sampling)
        if segment_tokens is not None and segment_tokens < 1:
            raise RequestError(f"segment_tokens={segment_tokens} must be >= 1")
        rollouts = new_rollouts(prompt_ids, sampling, group, rid, tuple(images))
        return self.resume_many(rollouts, segment_tokens)

    def resume(self, rollout: Rollout, segment_tokens: int | None = None) -> RolloutFuture:
        """Continue an unfinished rollout (prompt + tokens so far go back in). The future
        carries the rollout as ``future.rollout`` (to ``abort`` it while it runs)."""
        return self.resume_many([rollout], segment_tokens)[0]

    def resume_many(
        self, rollouts: list[Rollout], segment_tokens: int | None = None
    ) -> list[RolloutFuture]:
        """Continue several rollouts in one request to one server: SGLang batches them and
        prefills a shared prompt once, and the HTTP cost is paid once (for a GRPO group of
        n samples, n times less of it). Each rollout keeps its own seed, request id (so
        ``abort`` works per rollout) and future; the futures resolve together."""
        for r in rollouts:
            r.next_request(segment_tokens)  # raises on a finished rollout
        futures = [RolloutFuture(r) for r in rollouts]
        asyncio.run_coroutine_threadsafe(
            self._segments(rollouts, segment_tokens, futures), self._loop
        )
        return futures

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        segment_tokens: int | None = None,
        images: list[tuple[str, ...]] | None = None,
    ) -> list[Rollout]:
        """Blocking convenience: every sample of every prompt, run to the end, in
        submission order. A rollout that comes back unfinished (segment boundary, pause)
        is resumed at once, while the others keep running. ``images``: each prompt's."""
        per = images or [()] * len(prompts)
        futures = [
            f
            for p, im in zip(prompts, per, strict=True)
            for f in self.submit(p, sampling, segment_tokens=segment_tokens, images=im)
        ]
        pending: dict[cf.Future[Rollout], int] = {f: i for i, f in enumerate(futures)}
        out: list[Rollout] = [None] * len(futures)  # type: ignore[list-item]
        while pending:
            done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for f in done:
                i, r = pending.pop(f), f.result()
                if r.finished:
                    out[i] = r
                else:
                    pending[self.resume(r, segment_tokens)] = i
        return out

    @staticmethod
    def as_completed(
        futures: Iterable[cf.Future[Rollout]], timeout: float | None = None
    ) -> Iterable[Rollout]:
        """Rollouts in the order they finish (re-raises a request's error)."""
        for f in cf.as_completed(list(futures), timeout=timeout):
            yield f.result()

    async def _segments(
        self, rollouts: list[Rollout], segment_tokens: int | None, futures: list[RolloutFuture]
    ) -> None:
        try:
            todo, dropped = rollouts, dict.fromkeys((r.rid for r in rollouts), 0)
            while todo:  # only a reply whose routing did not fit is asked again
                outs, start = await self._request(todo, segment_tokens)
                again = []
                for r, out in zip(todo, outs, strict=True):
                    if out is not None and not self._take(r, out, start):
                        dropped[r.rid] += 1
                        if dropped[r.rid] == ROUTING_RETRIES:
                            raise ServerError(
                                f"generator server {r.server} ({self.urls[r.server or 0]}) "
                                f"answered {ROUTING_RETRIES} times in a row with routing that "
                                f"does not fit rollout {r.rid} (see above)"
                            )
                        if r.rid not in self._user_aborted:
                            again.append(r)
                            continue
                    if r.rid in self._user_aborted:  # aborted while queued or running
                        self._user_aborted.discard(r.rid)
                        if not r.finished:
                            r.finish("abort")
                todo = again
        except BaseException as e:
            for f in futures:
                f.set_exception(e)
            return
        for f, r in zip(futures, rollouts, strict=True):
            f.set_result(r)

    def _take(self, r: Rollout, out: dict[str, Any], start: int) -> bool:
        """Add one result to its rollout; False when its routing did not fit (nothing is
        added: the segment is sampled again, up to ``ROUTING_RETRIES`` times in a row). A
        reply aborted in the server's queue carries no routing: its tokens are dropped,
        and the rollout resumes from where it was."""
        if r.images:
            self._check_prompt_tokens(r, out)
        ids, lps, versions, reason = parse_result(out)
        shape = self.limits.routing
        if shape is None:
            r.append(ids, lps, versions, reason)
            return True
        where = f"generator server {r.server} ({self.urls[r.server or 0]})"
        try:
            rows = routing.new_rows(out, r, len(ids), start, shape)
        except routing.RoutingMissing as e:
            if reason == "abort":  # aborted in the server's queue: resumable as it was
                return True
            err = ServerError(
                f"{where} returns no routed experts ({e}): routing replay needs servers "
                "started with --enable-return-routed-experts"
            )
            self.fail(err)
            raise err from None
        except routing.RoutingMismatch as e:
            self.routing_dropped += 1
            print(f"[generator] {where}: {e}; the segment is sampled again", flush=True)
            return False
        r.append(ids, lps, versions, reason, rows)
        return True

    def _check_prompt_tokens(self, r: Rollout, out: dict[str, Any]) -> None:
        """A reply to a prompt with images counts the input tokens the server expanded
        them to: ours must be the same (the trainer places the images by them)."""
        sent = len(r.prompt_ids) + len(r.output_ids)
        got = (out.get("meta_info") or {}).get("prompt_tokens")
        if got is not None and int(got) != sent:
            err = ServerError(
                f"generator server {r.server}: rollout {r.rid}'s {len(r.images)} image(s) "
                f"make {got} prompt tokens on the server, {sent} with the checkpoint's "
                "processor on the controller: the server's processor disagrees"
            )
            self.fail(err)
            raise err

    async def _request(
        self, rollouts: list[Rollout], segment_tokens: int | None
    ) -> tuple[list, int]:
        """One /generate request for the rollouts still wanted; their results (None for a
        rollout aborted before it was sent), and the routing row it asked from. Re-sent
        elsewhere if its server is lost."""
        while True:
            server = await self._ready_server()
            try:
                return await self._request_on(server, rollouts, segment_tokens)
            except ServerLost as e:
                self.requeued += len(rollouts)
                self.requeued_rids.extend(r.rid for r in rollouts)
                self._requeued_from(e, len(rollouts))

    def _requeued_from(self, lost: ServerLost, n: int) -> None:
        """Count ``n`` rollouts re-queued from ``lost.server``; the first of a loss schedules
        the one line that reports them all."""
        first = lost.server not in self._unreported
        self._unreported[lost.server] = self._unreported.get(lost.server, 0) + n
        if first:
            why = str(lost).splitlines()[0]
            self._loop.call_later(REQUEUE_REPORT_S, self._report_requeued, lost.server, why)

    def _report_requeued(self, server: int, why: str) -> None:
        n = self._unreported.pop(server)
        print(f"[generator] {why}; re-queued {n} rollout(s)", flush=True)

    async def _request_on(
        self, server: int, rollouts: list[Rollout], segment_tokens: int | None
    ) -> tuple[list, int]:
        self._in_flight[server] += len(rollouts)  # queued requests count: routing sees them
        start = 0
        try:
            async with self._slots[server]:
                live = [r for r in rollouts if r.rid not in self._user_aborted]
                if not live:
                    return [None] * len(rollouts), start
                ids, sps, rids = [], [], []
                pad = self.limits.image_token_id
                for r in live:
                    prompt, budget, seed = r.next_request(segment_tokens)
                    ids.append(collapse_pads(prompt, pad) if r.images and pad is not None
                               else prompt)  # fmt: skip
                    sps.append(r.sampling.to_sglang(budget, seed))
                    rids.append(f"{r.rid}.{r.segments}.{next(_seq)}")
                    self._active[r.rid] = (server, rids[-1])
                    r.server = server
                if self.limits.routing is not None:
                    start = routing.request_start(live)
                images = [[_image(x) for x in r.images] for r in live]
                routed = None if self.limits.routing is None else start
                call = api.generate(ids, sps, rids, routed, images)
                out = await self._post(server, call)
        finally:
            self._in_flight[server] -= len(rollouts)
            for r in rollouts:
                self._active.pop(r.rid, None)
        results = iter(api.generate_results(out, len(live)))
        sent = {id(r) for r in live}
        return [next(results) if id(r) in sent else None for r in rollouts], start

    def in_flight(self) -> set[str]:
        """Ids of the rollouts whose request is on a server right now."""
        return set(self._active)

    async def _ready_server(self) -> int:
        """The least-loaded server that is alive and serves the current version; if there
        is none, wait up to ``wait_for_server`` for one (then fail)."""
        deadline = time.monotonic() + self.wait_for_server
        while True:
            if self._failure_error is not None:
                raise self._failure_error
            ready = [i for i in self._live() if i not in self._stale]
            if ready:
                return min(ready, key=lambda i: self._in_flight[i])
            why = (
                f"no generator server is alive at weight version {self.version} "
                f"(dead: {sorted(self._dead)}, behind: {sorted(self._stale - self._dead)})"
            )
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerError(why)
            if self._no_server_since is None:
                self._no_server_since = time.monotonic()
                print(f"[generator] {why}: rollouts wait for a restart", flush=True)
            self._ready_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready_event.wait(), timeout=min(left, 1.0))

    def _routable(self) -> None:
        """Routing changed (a server revived, a version adopted): wake waiting requests."""
        ready = any(i not in self._stale for i in self._live())  # _stale may hold dead ones
        if self._no_server_since is not None and ready:
            self.no_server_s += time.monotonic() - self._no_server_since
            self._no_server_since = None
        self._loop.call_soon_threadsafe(self._ready_event.set)

    def fail(self, error: BaseException) -> None:
        """Fail every request that waits for a server, and every later one, with ``error``
        (e.g. the generator rank that restarts servers gave up)."""
        self._failure_error = error
        self._loop.call_soon_threadsafe(self._ready_event.set)

    def dead(self) -> set[int]:
        """Servers that stopped answering or are being restarted."""
        return set(self._dead)

    def mark_dead(self, server: int) -> None:
        """Route nothing to ``server`` until :meth:`revive` (its rank reported it lost or
        restarted: its weights are old)."""
        self._held.add(server)
        self._dead.add(server)

    def revive(self, server: int) -> None:
        """Route to ``server`` again once it reports the current version (a restarted
        server that was given the current weights)."""
        got = self._call(self._version_of(server))
        self._held.discard(server)
        self._dead.discard(server)
        self._dead_at.pop(server, None)
        if got == self.version:
            self._stale.discard(server)
        else:
            self._stale.add(server)
        self._routable()

    def take_requeued(self) -> list[str]:
        """Ids of the rollouts re-queued since the last call."""
        ids = self.requeued_rids  # the client's thread appends: take, then cut
        taken = ids[: len(ids)]
        del ids[: len(taken)]
        return taken

    def stats(self) -> dict[str, float]:
        """Fault counters since the client started (``routing_dropped``: segments sampled
        again because their routing did not fit; with routing replay only)."""
        waiting = time.monotonic() - self._no_server_since if self._no_server_since else 0.0
        out = {"requeued_rollouts": float(self.requeued),
               "no_server_s": self.no_server_s + waiting,
               "revived_servers": float(self.revived)}  # fmt: skip
        if self.limits.routing is not None:
            out["routing_dropped"] = float(self.routing_dropped)
        return out

    def _live(self) -> list[int]:
        return [i for i in range(len(self.urls)) if i not in self._dead]

    async def _post(self, server: int, call: api.Call) -> Any:  # a JSON value
        """Make ``call`` on ``server``; a server that does not answer is marked dead."""
        try:
            return await api.acall(self._session, self.urls[server], call, self.keys)
        except api.CallError as e:
            if e.answered:
                raise ServerError(str(e)) from e
            self._dead.add(server)
            self._dead_at.setdefault(server, self.version)
            if self._probe is None or self._probe.done():
                self._probe = asyncio.ensure_future(self._probe_lost())
            raise self._failure(server, e) from e

    async def _probe_lost(self) -> None:
        """Every :data:`PROBE_S`, ask each server a failed request marked dead (not one its
        rank is restarting) for its version; one that answers gets rollouts again once a
        weight update reaches it (it is behind until then, whatever it reports: the
        version may move while it answers). Why: a request fails without its server being
        down (its ``request_timeout`` under load, a reset connection), and the server's
        watchdog restarts only a server that fails its health checks; such a server was
        left out for the rest of the run. One that reports an older version than the
        client had when it failed was restarted: its rank reports that, and the recovery
        brings it back."""
        while self._dead - self._held:
            await asyncio.sleep(PROBE_S)
            for i in sorted(self._dead - self._held):
                call = api.acall(self._session, self.urls[i], api.model_info(), self.keys)
                try:
                    got = api.weight_version(await asyncio.wait_for(call, PROBE_TIMEOUT_S))
                except (api.CallError, TimeoutError, ValueError, KeyError):
                    continue
                if self._updating or i in self._held or i not in self._dead:
                    continue
                if got < self._dead_at.get(i, got):
                    continue
                self._stale.add(i)  # first: never neither dead nor behind
                self._dead.discard(i)
                self._dead_at.pop(i, None)
                self.revived += 1
                print(f"[generator] generator server {i} ({self.urls[i]}) answers again at "
                      f"weight version {got}: rollouts once the next weight update reaches "
                      f"it", flush=True)  # fmt: skip

    def _failure(self, server: int, err: api.CallError) -> ServerLost:
        if self.launcher is not None:
            s = self.launcher.servers[server]
            if not s.alive():
                return ServerLost(server, str(s.error(f"died (exit code {s.exit_code})")))
        where = f"generator server {server} ({self.urls[server]})"
        return ServerLost(server, f"{where} unreachable: {err.detail}")

    def restart_server(self, server: int) -> int:
        """Restart a server through the launcher; return the weight version it came back
        with. A server restarted from its checkpoint is behind the others after any
        update: it gets no rollouts until the next ``update_weights`` reaches it."""
        if self.launcher is None:
            raise ServerError("restart_server needs the client to own a ServerLauncher")
        self.launcher.restart(server)
        version = self._call(self._version_of(server))
        self.revive(server)
        return version

    # ---- control ----------------------------------------------------------------------

    def _all(self, call: api.Call) -> list[Any]:
        """``call`` on every live server; the answers of those that answered (a lost
        server is marked dead and left out)."""

        async def one(i: int) -> Any:
            try:
                return await self._post(i, call)
            except ServerLost:
                return _LOST

        async def run() -> list[Any]:
            got = await asyncio.gather(*(one(i) for i in self._live()))
            return [x for x in got if x is not _LOST]

        return self._call(run())

    def abort(self, rollout: Rollout) -> None:
        """Stop one rollout; its future resolves with the tokens generated so far and
        ``finish_reason == "abort"``."""
        self._user_aborted.add(rollout.rid)
        where = self._active.get(rollout.rid)
        if where is not None:
            self._call(self._post(where[0], api.abort_request(where[1])))

    def abort_all(self) -> None:
        self._user_aborted.update(self._active)
        self._all(api.abort_all())

    def pause(self, mode: str = "retract") -> None:
        """``retract``: running requests go back to the server's queue (KV freed) and
        resume after ``continue_generation``; ``abort``: they return now, unfinished
        and resumable; ``in_place``: they stay put (KV kept)."""
        if mode not in ("retract", "abort", "in_place"):
            raise ValueError(f"pause mode={mode!r} must be retract, abort or in_place")
        self._all(api.pause_generation(mode))

    def continue_generation(self) -> None:
        self._all(api.continue_generation())

    def flush_cache(self) -> None:
        self._all(api.flush_cache())

    async def _version_of(self, server: int) -> int:
        return api.weight_version(await self._post(server, api.model_info()))

    def weight_versions(self) -> list[int]:
        """The weight version every live server reports (in server order)."""
        return list(self._versions().values())

    def _versions(self) -> dict[int, int]:
        """{server: the version it reports}, for the live servers that answer."""
        live = self._live()
        got = self._all(api.model_info()) if live else []
        answered = [i for i in live if i not in self._dead]
        return dict(zip(answered, map(api.weight_version, got), strict=True))

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | Iterable[FlatBucket],
        version: int,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        """Load new weights (HF names, SGLang's loader fuses them) into every server and
        set its version. ``weights`` is either (name, tensor) pairs, bucketed here, or
        ready ``FlatBucket``s. Generation is paused (retract) for the duration."""
        items = iter(weights)
        first = next(items, None)
        if first is None:
            raise ValueError("update_weights got no weights")
        packs: Iterator[FlatBucket]
        if isinstance(first, FlatBucket):
            packs = itertools.chain([first], cast("Iterator[FlatBucket]", items))
        else:
            pair = cast("tuple[str, torch.Tensor]", first)
            pairs = itertools.chain([pair], cast("Iterator[tuple[str, torch.Tensor]]", items))
            packs = map(FlatBucket.pack, buckets(pairs, bucket_bytes))
        del first  # packs holds it until it is sent; a kept error must not (see _update)
        self._updating = True  # the servers it starts with are the ones it checks at the end
        try:
            self._update(packs, version)
        finally:
            self._updating = False

    def _update(self, packs: Iterator[FlatBucket], version: int) -> None:
        self.pause("retract")
        ok = False
        try:
            self._all(api.begin_weight_update())
            try:
                for bucket in packs:
                    try:
                        self._send_bucket(bucket)
                    finally:
                        # A caller that keeps the error keeps this frame: not the bucket.
                        del bucket
            finally:
                self._all(api.end_weight_update())
            self._check_all(self._all(api.update_weight_version(version)), "set version")
            self.flush_cache()
            got = self.weight_versions()
            if any(v != version for v in got):
                raise ServerError(f"after update to version {version} servers report {got}")
            self.version = version
            self._stale.clear()
            ok = True
        finally:
            if not ok:
                # A server may now hold a mix of old and new weights: hand its queued
                # requests back (resumable, their tokens so far are valid) and route no
                # rollouts to any server until an update succeeds.
                self._stale.update(self._live())
                with contextlib.suppress(ServerError):
                    self._all(api.abort_all())
            self.continue_generation()

    def _send_bucket(self, bucket: FlatBucket) -> None:
        """One bucket to every live server. The reference its pickling took for the
        servers is handed back unless one loaded it (see ``hand_back``): one that is lost
        or refuses before opening the payload leaves its file to nobody otherwise."""
        call, keep = update_call(bucket, self.tp)
        loaded = False
        try:
            results = self._all(call)
            loaded = any(api.refusal(r) is None for r in results)
            self._check_all(results, "update")
        finally:
            if not loaded:
                hand_back(keep)
            # A caller that keeps the error keeps this frame: not the bucket with it.
            del bucket, keep

    def adopt_version(self, version: int, serving: Collection[int] | None = None) -> None:
        """Route by ``version`` once weights reached the servers another way (DDMA: trainer
        ranks push and :class:`rl.generator.ddma_target.SGLangTarget` commits on each server).
        A server that does not report ``version`` gets no rollouts until it does.
        ``serving``: the servers the caller knows serve ``version`` (a commit each of them
        confirmed); the others are behind. Saves asking every server on the step's
        critical path."""
        # Every server not known to serve ``version`` is behind, dead ones included: one
        # that comes back meanwhile (_probe_lost) must not become routable here.
        if serving is None:
            got = self._versions()
            serving = [i for i, v in got.items() if v == version]
        behind = {i for i in range(len(self.urls)) if i not in serving}
        self.version = version
        self._stale = behind
        self._routable()

    @staticmethod
    def _check_all(results: list[dict[str, Any]], what: str) -> None:
        for r in results:
            if (why := api.refusal(r)) is not None:
                raise ServerError(f"weight {what} failed on a server: {why}")

    def close(self) -> None:
        """Stop: requests still running are cancelled (their futures raise), so no task
        outlives the loop."""
        if self._loop.is_running():
            self._call(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._session.close()

    def __enter__(self) -> GeneratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
