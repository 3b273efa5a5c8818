"""The DDMA receiver that runs inside every SGLang TP worker, as a custom weight loader.

SGLang calls ``load(model, named_tensors)`` for ``/update_weights_from_tensor`` requests
whose ``load_format`` is this function's import path (the server must list it in
``--custom-weight-loader``). Each TP rank gets only its own entry of the request, so a
trainer rank hands every SGLang rank exactly that rank's buckets, already in SGLang's
layout: no SGLang-side slicing, no full tensors.

Every bucket is verified (plan digest, version, checksum) before a byte of it is written.
Where it is written is the version's *staging* (``rollout.weight_sync.staging``, sent with
the ``discard`` that opens a weight update):

* ``device``: a copy of the parameters on their device; only when every bucket of the
  version has arrived on every rank (``prepare``) does ``commit`` copy it into the model.
  A corrupt bucket, a version or architecture mismatch, or a trainer that dies
  mid-transfer leaves the server serving the previous complete version. The price is a
  second copy of the weights on the GPU (kept between versions: re-allocating it would
  page-fault the whole model in again on every sync, measured 4x slower).
* ``host``: the same, with the copy in host memory (pinned when CUDA is there), so the
  GPU keeps that memory for the KV cache; ``commit`` copies host to device.
* ``none``: straight into the live parameters while generation is paused. No copy, but
  once a bucket is written the model is *torn* until a complete version is committed:
  every status reports ``torn``, and the DDMA target keeps such a server paused and out of
  routing rather than let it serve a half-updated model.

A ``receive`` fills the staging through the transport it names (``transport``;
rl/ddma/transport.py), whatever the transport: a staged one brings one bucket message in
a slot of the sender's that it locates (``ipc``: a shared-memory ring, mapped once and
kept; ``cuda_ipc``: the entry's tensor, a CUDA IPC handle); a group one receives all this
rank's buckets point to point from the trainer ranks over a group SGLang created with
``/init_weights_update_group`` (found by name; trainer ranks first), which works across
hosts and at any SGLang TP, each rank receiving only its own shards. A ``receive`` with
``background`` (staging device or host) returns at once and receives on a thread of its
own while SGLang's scheduler goes on generating with the live weights; every later op
first waits for it.

Protocol: each entry is ``(json control, tensor)``. ``op`` is ``receive``,
``prepare``, ``commit``, ``discard``, ``state`` or ``noop`` (a rank with nothing in this
request). The reply is a JSON status file per rank (``status``): SGLang's reply cannot
carry it, and an exception here would kill SGLang's scheduler, so nothing may escape
``load``. Status files are written only inside one directory, fixed when the server
starts (:func:`status_dir`); a request naming a path elsewhere is refused and logged.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from rl.config.dtypes import dtype_name, torch_dtype
from rl.config.sglang import WEIGHT_STAGINGS
from rl.ddma import engine, transport, wire
from rl.ddma.plan import DstLayout, Plan, SrcLayout, make_plan
from rl.weights import keymap as km
from rl.weights.keymap import Dims

# Parameters an FP8 server holds that are not weights: its KV cache's scales (SGLang's
# BaseKVCacheMethod, on every attention layer built with an FP8 quant config), which keep
# SGLang's defaults and are never sent.
KV_SCALES = (".attn.k_scale", ".attn.v_scale")
# The only directory status files go to; the DDMA target reads them from the same place.
STATUS_DIR_ENV = "MSRL_DDMA_STATUS_DIR"
log = logging.getLogger(__name__)


class StatusDirError(RuntimeError):
    """The status directory is not this user's own: one line saying why and what to do."""


@lru_cache(maxsize=1)
def status_dir() -> Path:
    """``$MSRL_DDMA_STATUS_DIR``, else a per-user directory under the temp dir; read once,
    so a server's directory is the one it started with (owner-only, created if missing;
    see :func:`own_dir`)."""
    where = os.environ.get(STATUS_DIR_ENV) or Path(tempfile.gettempdir(), f"ddma-{os.getuid()}")
    where = Path(where)
    # The parents resolved (a site's /scratch link is fine); the directory itself not.
    path = Path(os.path.realpath(where.parent), where.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    return own_dir(path)


def own_dir(path: Path) -> Path:
    """``path`` as a directory of this user's that no one else can enter: created 0700, or,
    if it exists, neither a symlink nor another user's (refused), its mode narrowed to 0700.

    Why: ``/tmp/ddma-<uid>`` is a name anyone can predict and create first. A directory
    another user made (0777) or a symlink to one let that user read every status and
    plant or swap the files a trainer reads back."""
    refuse = f"DDMA status directory {path}"
    fix = f"remove it, or set {STATUS_DIR_ENV} to a directory of your own"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise StatusDirError(f"{refuse} is a symlink: refused ({fix})")
    if not stat.S_ISDIR(st.st_mode):
        raise StatusDirError(f"{refuse} is not a directory: refused ({fix})")
    # Checked and narrowed through one descriptor: no swap between the check and the chmod.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise StatusDirError(
                f"{refuse} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                f"refused ({fix})"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:  # ours, but open to others: close it
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


class StatusPathError(ValueError):
    """A request asked for a status file outside :func:`status_dir`."""


def status_path(requested: str, rank: int) -> Path:
    """Where rank ``rank`` writes the status ``requested`` (``{rank}`` filled in): a file
    directly inside :func:`status_dir`, or :class:`StatusPathError`."""
    path = Path(requested.replace("{rank}", str(rank)))
    root = status_dir()
    if not path.name or path.name.startswith(".") or Path(os.path.realpath(path.parent)) != root:
        raise StatusPathError(
            f"DDMA status path {requested!r} is outside the server's status directory "
            f"{root} (set by {STATUS_DIR_ENV} at server start): refused"
        )
    return root / path.name


def plan_spec(plan: Plan, dtype: torch.dtype) -> str:
    """What a receiver needs to recompute the sender's plan (it checks the result against
    its own model, so a wrong spec cannot write anything)."""
    return json.dumps(
        {
            "dims": plan.dims.__dict__,
            "src": {**plan.src.__dict__},
            "dst": plan.dst.__dict__,
            "itemsize": plan.itemsize,
            "bucket_bytes": plan.bucket_bytes,
            "fp8_block": plan.fp8_block,
            "dtype": dtype_name(dtype),
        },
        sort_keys=True,
    )


@lru_cache(maxsize=4)
def plan_from_spec(spec: str) -> tuple[Plan, torch.dtype]:
    s = json.loads(spec)
    src = s["src"]
    if src.get("layers_per_stage") is not None:
        src["layers_per_stage"] = tuple(src["layers_per_stage"])
    plan = make_plan(
        Dims(**s["dims"]), SrcLayout(**src), DstLayout(**s["dst"]), s["itemsize"],
        s["bucket_bytes"], s["fp8_block"],
    )  # fmt: skip
    return plan, torch_dtype(s["dtype"])


@dataclass(kw_only=True)
class Stage:
    version: int
    digest: int
    staging: str
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    received: set[int] = field(default_factory=set)
    error: str | None = None
    failure: Exception | None = None  # what failed a background receive, re-raised later
    # Checks of the buckets staged from device memory, run before the version is prepared.
    deferred: wire.Deferred = field(default_factory=wire.Deferred)

    def destination(self) -> wire.DstGetter:
        """Where the version's buckets go: into a staging copy before they are verified."""
        get = self.staged.__getitem__
        return get if self.staging == "none" else engine.Staged(get)


def _tp_rank() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:  # outside a server (unit tests): a single rank
        return 0


def targets(model: torch.nn.Module, plan: Plan) -> dict[str, torch.Tensor]:
    """The tensors the plan writes, by name: the model's parameters, and for a fused expert
    parameter (``...experts.w13_weight``) the plan's ``name[e]`` slabs as views of it."""
    fused = {n.rsplit("[", 1)[0] for n in plan.dst_shapes if n.endswith("]")}
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name in fused:
            out.update({f"{name}[{e}]": p.data[e] for e in range(p.shape[0])})
        else:
            out[name] = p
    return out


def architecture_errors(plan: Plan, params: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """Differences between what the plan writes and the model this rank serves. A
    vision-language model's tower (SGLang's ``visual.*``) is not sent: it stays as the
    server loaded it (an RL job trains the decoder only)."""
    problems = []
    for name, shape in plan.dst_shapes.items():
        p = params.get(name)
        if p is None:
            problems.append(f"trainer sends {name} but the generator has no such parameter")
        elif tuple(p.shape) != shape:
            problems.append(f"{name}: trainer sends {list(shape)}, generator has {list(p.shape)}")
        elif p.dtype != wire.dst_dtype(plan, name, dtype):
            want = wire.dst_dtype(plan, name, dtype)
            problems.append(f"{name}: trainer sends {want}, generator holds {p.dtype}")
    held = km.TOWER if km.carried_prefix(plan.dims) is not None else None
    extra = sorted(
        n
        for n in set(params) - set(plan.dst_shapes)
        if not n.endswith(KV_SCALES) and not (held and n.startswith(held))
    )
    if extra:
        problems.append(f"generator parameters the trainer does not send: {extra[:3]}")
    return "; ".join(problems[:4])


class Receiver:
    """One generator rank's DDMA state (one per SGLang worker process: :data:`RECEIVER`)."""

    def __init__(self) -> None:
        self.stage: Stage | None = None
        self.staging = "device"  # for the next version (set by the discard that opens it)
        self.torn: int | None = None  # staging none: the version written in place, incomplete
        # Staging tensors outlive a version (see the module docstring), for one kind.
        self.buffers: dict[str, torch.Tensor] = {}
        self.buffers_kind: str | None = None
        self.receiving: threading.Thread | None = None  # a background ``recv``

    def state(self) -> dict:
        held = sum(t.numel() * t.element_size() for t in self.buffers.values())
        return {"staging": self.staging, "staging_bytes": held, "torn": self.torn is not None}

    def _open(self, model: torch.nn.Module, plan: Plan, dtype: torch.dtype, version: int) -> Stage:
        params = targets(model, plan)
        problem = architecture_errors(plan, params, dtype)
        if problem:
            raise ValueError(f"architecture mismatch: {problem}")
        st = Stage(version=version, digest=plan.digest, staging=self.staging)
        if st.staging == "none":  # the live parameters themselves (paused meanwhile)
            st.staged = {n: params[n].detach() for n in plan.dst_shapes}
            return st
        if self.buffers_kind != st.staging:
            self.release()  # a copy of the other kind frees its memory first
            self.buffers_kind = st.staging
        pin = torch.cuda.is_available()
        for n in plan.dst_shapes:
            p, t = params[n], self.buffers.get(n)
            if t is None or t.shape != p.shape or t.dtype != p.dtype:
                if st.staging == "host":
                    t = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                else:
                    t = torch.empty_like(p)
                self.buffers[n] = t
        st.staged = {n: self.buffers[n] for n in plan.dst_shapes}
        return st

    def handle(self, model: torch.nn.Module, ctl: dict, tensor: torch.Tensor, rank: int) -> dict:
        """Apply one control entry; returns the status to report (raises on bad input)."""
        op = ctl["op"]
        if op == "noop":
            return {"ok": True}
        if op == "state":
            return {"ok": True, **self.state()}
        self._settled()
        if op == "discard":  # opens a weight update: drops what a failed version left staged
            staging = ctl.get("staging", "device")
            if staging not in WEIGHT_STAGINGS:
                raise ValueError(f"staging {staging!r} is not one of {WEIGHT_STAGINGS}")
            self.stage, self.staging = None, staging
            if staging == "none":
                self.release()
            return {"ok": True, **self.state()}
        plan, dtype = plan_from_spec(ctl["plan"])
        version = int(ctl["version"])
        st = self.stage
        if st is None:  # the first bucket after begin (discard) opens the version
            st = self.stage = self._open(model, plan, dtype, version)
        elif (st.version, st.digest) != (version, plan.digest):
            # Trainers disagree (a stale rank, another plan): the staged version cannot be
            # complete and consistent any more, so it fails as a whole.
            st.error = (
                f"got {op} for version {version} (plan {plan.digest:#x}) while version "
                f"{st.version} (plan {st.digest:#x}) is being staged"
            )
            raise ValueError(st.error)
        if st.failure is not None:
            raise st.failure
        if st.error is not None:
            raise ValueError(f"version {version} already failed: {st.error}")
        if op == "receive":  # the buckets, by whatever transport the request names
            return self._receive(st, transport.Inbound(
                plan=plan, rank=rank, version=version, dtype=dtype, ctl=ctl, tensor=tensor,
                into=st.destination(), deferred=st.deferred, writing=lambda: self._writing(st),
            ))  # fmt: skip
        try:
            st.deferred.finish()
        except wire.BucketError as e:
            st.error = f"generator rank {rank}: {type(e).__name__}: {e}"
            raise
        expected = {b.index for b in plan.receives(rank)}
        missing = sorted(expected - st.received)
        if missing:
            raise ValueError(
                f"version {version}: {len(missing)} of {len(expected)} buckets never arrived "
                f"(first missing: {missing[0]})"
            )
        wire.zero_fill(plan, rank, st.staged.__getitem__)  # padding rows: never sent
        if op == "prepare":
            return {"ok": True, "received": len(st.received), **self.state()}
        if op == "commit":
            if st.staging != "none":
                params = targets(model, plan)
                with torch.no_grad():
                    for name, t in st.staged.items():
                        params[name].copy_(t)
            self.stage, self.torn = None, None  # whole again, whatever was torn before
            return {"ok": True, "committed": version, **self.state()}
        raise ValueError(f"unknown op {op!r}")

    def _receive(self, st: Stage, inbound: transport.Inbound) -> dict:
        moves = transport.get(str(inbound.ctl["transport"]))
        if inbound.ctl.get("background"):  # generation goes on; prepare waits for the bytes
            if st.staging == "none":
                raise ValueError("a background receive needs staging device or host")
            self.receiving = threading.Thread(target=_background, args=(moves, inbound, st),
                                              daemon=True, name="ddma-receive")  # fmt: skip
            self.receiving.start()
            return {"ok": True, "background": True}
        try:
            st.received.update(moves.receive(inbound))
        except transport.SlotsGone as e:  # the sender makes others and sends again
            return {"ok": False, "ring_missing": True, "error": str(e)}
        return {"ok": True, "received": len(st.received)}

    def release(self) -> None:
        """Drop the staging copy and hand its memory back: the caching allocators (CUDA's,
        pinned host memory's) and glibc's heap would otherwise keep it from everyone else."""
        if not self.buffers:
            return
        self.buffers.clear()
        self.buffers_kind = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()
        else:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):  # not glibc: the memory stays reusable here
                pass

    def _settled(self) -> None:
        """Wait for a background receive to end (it writes into the staging every other
        op reads or drops); how it ended is in the stage it wrote."""
        if self.receiving is not None:
            self.receiving.join()
            self.receiving = None

    def _writing(self, st: Stage) -> None:
        if st.staging == "none":
            self.torn = st.version  # from the first byte written until a commit

    def failed(self, op: str | None, error: str) -> None:
        """Poison the version being staged (a bucket or a request failed)."""
        if self.stage is not None and op == "receive":
            self.stage.error = error


RECEIVER = Receiver()


def _background(moves: transport.Transport, inbound: transport.Inbound, st: Stage) -> None:
    """A background ``receive`` (its own thread, beside SGLang's scheduler, which keeps
    generating on the live weights while the buckets land in the staging copy)."""
    try:
        st.received.update(moves.receive(inbound))
    except Exception as e:
        st.error, st.failure = f"generator rank {inbound.rank}: {type(e).__name__}: {e}", e
        log.error("DDMA generator rank %d: background receive failed: %s", inbound.rank,
                  st.error)  # fmt: skip


def load(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's entry point. Never raises: errors go to the status file and poison the
    staged version, so it can never be committed."""
    rank = _tp_rank()
    for name, tensor in named_tensors:
        status: dict = {"ok": False}
        ctl: dict = {}
        t0 = time.perf_counter()
        try:
            ctl = json.loads(name)
            path = status_path(str(ctl["status"]), rank) if ctl.get("status") else None
        except Exception as e:  # nowhere to report but the server's log
            log.error("DDMA generator rank %d: %s: %s", rank, type(e).__name__, e)
            RECEIVER.failed("receive", f"a request was refused: {e}")
            continue
        try:
            status = RECEIVER.handle(model, ctl, tensor, rank)
            status["seconds"] = time.perf_counter() - t0
        except Exception as e:
            status = {"ok": False, "error": f"generator rank {rank}: {type(e).__name__}: {e}"}
            # Missed through no fault of this server: a relaying server above it was lost.
            status["upstream_lost"] = isinstance(e, engine.UpstreamLost)
            status["torn"] = RECEIVER.torn is not None
            RECEIVER.failed(ctl.get("op"), status["error"])
        if path is not None:
            _write_status(path, status)


def _write_status(path: Path, status: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:  # no symlink followed: the directory is the server's, the names the caller's
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(status, f)
        os.replace(tmp, path)
    except OSError as e:  # the sender then reports a missing status, naming this path
        log.error("DDMA status %s not written: %s", path, e)
