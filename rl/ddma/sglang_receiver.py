"""The DDMA receiver that runs inside every SGLang TP worker, as a custom weight loader.

SGLang calls ``load(model, named_tensors)`` for ``/update_weights_from_tensor`` requests
whose ``load_format`` is this function's import path (the server must list it in
``--custom-weight-loader``). Each TP rank gets only its own entry of the request, so a
trainer rank hands every SGLang rank exactly that rank's buckets, already in SGLang's
layout: no SGLang-side slicing, no full tensors.

Why staging: a bucket is verified (plan digest, version, checksum) and scattered into a
*staging copy* of the parameters, never into the live ones. Only when every bucket of the
version has arrived on every rank (``prepare``) does ``commit`` copy the staging tensors
into the model. A corrupt bucket, a version or architecture mismatch, or a trainer that
dies mid-transfer therefore leaves the server serving the previous complete version.
The price is one extra copy of the weights on the server (kept between versions).

Two transports fill the staging copy. ``stage``: the entry's tensor is one bucket message
(shared memory on one host; CUDA IPC on GPU). ``recv``: this rank receives all its buckets
point to point from the trainer ranks over a group SGLang created with
``/init_weights_update_group`` (found by name; trainer ranks first), which works across
hosts and at any SGLang TP, each rank receiving only its own shards.

Protocol: each entry is ``(json control, tensor)``. ``op`` is ``stage``, ``recv``,
``prepare``, ``commit``, ``discard`` or ``noop`` (a rank with nothing in this request).
The reply is a JSON status file per rank (``status`` path): SGLang's reply cannot carry
it, and an exception here would kill SGLang's scheduler, so nothing may escape ``load``.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from rl.config.dtypes import dtype_name, torch_dtype
from rl.ddma import engine, group, wire
from rl.ddma.plan import DstLayout, Plan, SrcLayout, make_plan
from rl.weights.keymap import Dims


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


@dataclass
class Stage:
    version: int
    digest: int
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    received: set[int] = field(default_factory=set)
    error: str | None = None


_STATE: dict[str, Stage | None] = {"stage": None}
# Staging tensors outlive a version: re-allocating them would page-fault the whole model
# in again on every sync (measured: 4x slower scatter). One copy of the weights, kept.
_STAGING: dict[str, torch.Tensor] = {}
# The last messages received: holding them keeps their shared-memory mappings cached, so a
# sender reusing its buffers costs no new mmap and page faults per bucket.
_RECENT: deque[torch.Tensor] = deque(maxlen=16)


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
    """Differences between what the plan writes and the model this rank serves."""
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
    extra = sorted(set(params) - set(plan.dst_shapes))
    if extra:
        problems.append(f"generator parameters the trainer does not send: {extra[:3]}")
    return "; ".join(problems[:4])


def handle(model: torch.nn.Module, ctl: dict, tensor: torch.Tensor, rank: int) -> dict:
    """Apply one control entry; returns the status to report (raises on bad input)."""
    op = ctl["op"]
    st = _STATE["stage"]
    if op == "noop":
        return {"ok": True}
    if op == "discard":
        _STATE["stage"] = None
        return {"ok": True}
    plan, dtype = plan_from_spec(ctl["plan"])
    version = int(ctl["version"])
    if st is None:  # the first bucket after begin (discard) opens the version
        params = targets(model, plan)
        problem = architecture_errors(plan, params, dtype)
        if problem:
            raise ValueError(f"architecture mismatch: {problem}")
        st = Stage(version, plan.digest)
        for n in plan.dst_shapes:
            p = params[n]
            if n not in _STAGING or _STAGING[n].shape != p.shape or _STAGING[n].dtype != p.dtype:
                _STAGING[n] = torch.empty_like(p)
        st.staged = {n: _STAGING[n] for n in plan.dst_shapes}
        _STATE["stage"] = st
    elif (st.version, st.digest) != (version, plan.digest):
        # Trainers disagree (a stale rank, another plan): the staged version cannot be
        # complete and consistent any more, so it fails as a whole.
        st.error = (
            f"got {op} for version {version} (plan {plan.digest:#x}) while version "
            f"{st.version} (plan {st.digest:#x}) is being staged"
        )
        raise ValueError(st.error)
    if st.error is not None:
        raise ValueError(f"version {version} already failed: {st.error}")
    expected = {b.index: b for b in plan.receives(rank)}
    if op == "recv":  # point-to-point from the trainer ranks over a DDMA group
        src_ranks = list(range(plan.src.world))  # trainer ranks come first in the group
        pg = group.find(ctl["group"])
        engine.receive(plan, rank, st.staged.__getitem__, version, dtype, pg, src_ranks)
        st.received.update(expected)
        return {"ok": True, "received": len(st.received)}
    if op == "stage":
        head = wire.read_header(tensor)
        b = expected.get(head["index"])
        if b is None or head["dst"] != rank:
            raise ValueError(f"bucket {head['index']} is not addressed to generator rank {rank}")
        _RECENT.append(tensor)
        wire.verify(tensor, plan, b, version)
        wire.unpack(tensor, plan, b, st.staged.__getitem__, dtype)
        st.received.add(b.index)
        return {"ok": True, "received": len(st.received)}
    missing = sorted(set(expected) - st.received)
    if missing:
        raise ValueError(
            f"version {version}: {len(missing)} of {len(expected)} buckets never arrived "
            f"(first missing: {missing[0]})"
        )
    wire.zero_fill(plan, rank, st.staged.__getitem__)  # padding rows: never sent
    if op == "prepare":
        return {"ok": True, "received": len(st.received)}
    if op == "commit":
        params = targets(model, plan)
        with torch.no_grad():
            for name, t in st.staged.items():
                params[name].copy_(t)
        _STATE["stage"] = None
        return {"ok": True, "committed": version}
    raise ValueError(f"unknown op {op!r}")


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
            status = handle(model, ctl, tensor, rank)
            status["seconds"] = time.perf_counter() - t0
        except Exception as e:
            status = {"ok": False, "error": f"generator rank {rank}: {type(e).__name__}: {e}"}
            st = _STATE["stage"]
            if st is not None and ctl.get("op") in ("stage", "recv"):
                st.error = status["error"]
        if ctl.get("status"):
            _write_status(ctl["status"].format(rank=rank), status)


def _write_status(path: str, status: dict) -> None:
    try:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(status, f)
        os.replace(tmp, path)
    except OSError:
        pass  # the sender then reports a missing status, naming this path
