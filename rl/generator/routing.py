"""Routing replay (``algorithm.routing_replay``) on the generator's side: the experts an
SGLang server routed each token to, asked for with every rollout request, checked, and
kept with the rollout (``Rollout.routing``) for an MoE trainer to replay.

What SGLang 0.5.23 answers (a server started with ``--enable-return-routed-experts``, a
request with ``return_routed_experts`` and ``routed_experts_start_len``), measured on a
CPU server with a tiny Qwen3-MoE (tests/servers/test_ddma_sglang_families.py):
``meta_info["routed_experts"]`` is base64 of int32 ``[rows, num_hidden_layers,
num_experts_per_tok]``, one row per input position from ``routed_experts_start_len`` up
to the sequence's last but one: ``len(input) + len(output) - 1 - start`` rows (a prompt
of 4 and 5 new tokens: 8 rows from start 0, 4 from start 4), row ``k`` the experts of
position ``start + k`` in the router's own order (transformers' top-k, descending). A
position found in the radix cache keeps the rows of the forward that computed its KV. A
request aborted while running (``/abort_request``, a pause in ``abort`` mode) answers
with the rows of every token it has; one aborted while it waited in the queue answers
with no token and without the field; one not asking never has it; a start past the
input's length is refused (HTTP 400). One start serves a whole batched request: a batch
asks from the fewest rows any of its rollouts holds, and each rollout drops the rows it
holds already. SGLang's Qwen3-MoE routes in every layer whatever ``mlp_only_layers``
says, and this project's MoE families refuse dense layers, so every row is routing.

A reply without the field to a request that asked for it (and was not aborted) comes from
a server started without the flag: :class:`RoutingMissing`, which fails the job. A reply
with another number of rows, or values outside the model's experts, is
:class:`RoutingMismatch`: the client drops that segment and samples it again.

In a saved rollout state (rl/controller/rollout_state.py) the rows are their bytes, base64
in the JSON (:func:`to_json`), restored bit for bit (:func:`from_json`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from rl.generator.types import Rollout, RoutingShape
from rl.serving.server_api import ServerResponseError

FIELD = "routed_experts"
_DTYPES = {"int8": torch.int8, "int16": torch.int16}


class RoutingMissing(ServerResponseError):
    """A reply without routed experts, to a request that asked for them."""


class RoutingMismatch(ServerResponseError):
    """Routed experts that do not fit the request or the model."""


def request_start(rollouts: Iterable[Rollout]) -> int:
    """``routed_experts_start_len`` of one request for ``rollouts`` (SGLang takes one for a
    batch): the fewest rows any of them holds."""
    return min(r.routed for r in rollouts)


def new_rows(
    out: dict[str, Any], r: Rollout, n_new: int, start: int, shape: RoutingShape
) -> torch.Tensor:
    """The routing rows a ``/generate`` result adds to ``r`` (which it extends by ``n_new``
    tokens; asked from row ``start``): those of the input tokens ``r`` holds no row for,
    as ``shape.dtype``."""
    meta = out.get("meta_info")
    raw = meta.get(FIELD) if isinstance(meta, dict) else None
    if raw is None:
        raise RoutingMissing(f"rollout {r.rid}: no {FIELD} in the reply")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise RoutingMismatch(f"rollout {r.rid}: {FIELD} is not base64 ({e})") from None
    rows = len(r.prompt_ids) + len(r.output_ids) + n_new - 1 - start
    want = rows * shape.layers * shape.topk
    if len(data) != 4 * want:
        raise RoutingMismatch(
            f"rollout {r.rid}: {len(data) // 4} routed expert ids, expected {rows} rows x "
            f"{shape.layers} layers x top-{shape.topk} (asked from row {start})"
        )
    ids = np.frombuffer(data, dtype="<i4").reshape(rows, shape.layers, shape.topk)
    if ids.size and (ids.min() < 0 or ids.max() >= shape.experts):
        raise RoutingMismatch(
            f"rollout {r.rid}: routed expert ids span [{ids.min()}, {ids.max()}], the model "
            f"has {shape.experts} experts"
        )
    kept = ids[r.routed - start :].astype(shape.dtype)
    return torch.from_numpy(kept)


def to_json(t: torch.Tensor | None) -> dict[str, Any] | None:
    """A rollout's rows in a JSON file: dtype, shape and the little-endian bytes, base64
    (a JSON list of ints would take about four times the room)."""
    if t is None:
        return None
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"routing of dtype {t.dtype}: only {sorted(_DTYPES)} are kept")
    data = t.contiguous().numpy().astype(np.dtype(name).newbyteorder("<")).tobytes()
    return {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(data).decode()}


def from_json(d: dict[str, Any] | None) -> torch.Tensor | None:
    """:func:`to_json`'s tensor, bit for bit; ValueError for anything else."""
    if d is None:
        return None
    if d.get("dtype") not in _DTYPES:
        raise ValueError(f"routing dtype {d.get('dtype')!r} not in {sorted(_DTYPES)}")
    shape = [int(n) for n in d["shape"]]
    if len(shape) != 3 or min(shape) < 0:
        raise ValueError(f"routing shape {shape} is not [rows, layers, topk]")
    try:
        data = base64.b64decode(d["data"], validate=True)
    except binascii.Error as e:
        raise ValueError(f"routing data is not base64 ({e})") from None
    arr = np.frombuffer(data, dtype=np.dtype(d["dtype"]).newbyteorder("<"))
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"routing data holds {arr.size} ids, its shape {shape} needs more or less")
    return torch.from_numpy(arr.astype(d["dtype"]).reshape(shape))  # a copy: writable
