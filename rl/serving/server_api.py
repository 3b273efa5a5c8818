"""The SGLang server's HTTP API as this project speaks it: every route, its body, its errors.

Why one module: the generator client (asyncio, many requests in flight), the DDMA target
(blocking, from trainer ranks and the controller), the launcher's health check and the
benchmarks all talk to the same servers. Each route below is a function that returns the
:class:`Call` to make (route and JSON body); :func:`call` makes one and waits,
:func:`acall` makes one on an asyncio loop. Both raise :class:`CallError`, which names the
server and the route and tells a refusal (the server answered with an error status) from
a server that never answered.

Every server requires keys (:class:`ServerKeys`): SGLang's admin routes (weight updates,
pause/abort, flush; :data:`ADMIN_ROUTES`) take only the admin key, every other route but
``/health`` only the API key, each as ``Authorization: Bearer <key>``. In an RL job both
derive from the job's secret (:func:`job_keys`); a launcher started on its own makes
random ones.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# The DDMA receiver, imported by every server process from this checkout: the servers
# start with it as their custom weight loader, and DDMA buckets name it as load format.
DDMA_LOAD_FORMAT = "rl.ddma.sglang_receiver.load"
# How much of a refusal's body goes into the error.
DETAIL_CHARS = 500
# The routes SGLang 0.5.23 marks ``AuthLevel.ADMIN_OPTIONAL`` that this project calls (or
# tests): with an admin key configured they accept it alone, and refuse the API key.
ADMIN_ROUTES = frozenset(
    {
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/update_weight_version",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/get_weights_by_name",
    }
)


@dataclass(frozen=True)
class ServerKeys:
    """The two keys every server starts with: ``api`` for rollouts and state, ``admin``
    for what changes the served weights or stops requests. Never printed (``repr``)."""

    api: str = field(repr=False)
    admin: str = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("api", "admin"):
            value = getattr(self, name)
            # Sent in a header and written to a YAML file: no spaces, quotes or newlines.
            ok = isinstance(value, str) and value.isascii() and value.isalnum()
            if not ok or len(value) < 16:
                raise ValueError(f"server key {name!r} must be >= 16 letters or digits")
        if self.api == self.admin:
            raise ValueError("server keys 'api' and 'admin' must differ")

    @classmethod
    def random(cls) -> ServerKeys:
        return cls(secrets.token_hex(32), secrets.token_hex(32))

    def for_route(self, route: str) -> str:
        return self.admin if route in ADMIN_ROUTES else self.api

    def headers(self, route: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.for_route(route)}"}


def job_keys() -> ServerKeys:
    """The servers' keys in this RL job, derived from the job's secret
    (``MSRL_SECRET_FILE``, set for every rank), the same on every rank."""
    from rl.runtime import secret

    key = secret.load()
    return ServerKeys(secret.derive(key, "sglang-api"), secret.derive(key, "sglang-admin"))


class ServerResponseError(RuntimeError):
    """A server answered with something that is not a well-formed generation result."""


def parse_version(v: Any) -> int:  # a JSON value
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ServerResponseError(
            f"server reports weight version {v!r}; servers started by rl.serving.launcher "
            "use integer versions"
        ) from None


class CallError(RuntimeError):
    """A call to ``url`` + ``route`` the server refused (``status``: the HTTP status it
    answered) or never answered (``status`` None: refused connection, reset, timeout)."""

    def __init__(self, url: str, route: str, status: int | None, detail: str) -> None:
        self.url, self.route, self.status, self.detail = url, route, status, detail
        what = "unreachable" if status is None else f"answered HTTP {status}"
        super().__init__(f"{url}{route} {what}: {detail}")

    @property
    def answered(self) -> bool:
        return self.status is not None


@dataclass(frozen=True)
class Call:
    """One request: POST ``body`` as JSON to ``route``, or GET it (``method="GET"``)."""

    route: str
    body: dict[str, Any] = field(default_factory=dict)
    method: str = "POST"


# ---------------------------------------------------------------------- rollouts
def generate(
    input_ids: list[list[int]],
    sampling: list[dict[str, Any]],
    rids: list[str] | None = None,
    routed_from: int | None = None,
    images: list[list[str]] | None = None,
) -> Call:
    """One ``/generate`` for one or several prompts (SGLang batches them and prefills a
    shared prefix once). Token ids in and out (servers run ``--skip-tokenizer-init``),
    with the log-prob and weight version of every new token. ``routed_from``: also the
    experts each input position from there on was routed to (a server started with
    ``--enable-return-routed-experts``; one start for the whole batch, at most the
    shortest input's length: rl/generator/routing.py). ``images``: each prompt's images
    (data URIs or paths the server reads), whose pads ``input_ids`` holds expanded."""
    one = len(input_ids) == 1
    body: dict[str, Any] = {
        "input_ids": input_ids[0] if one else input_ids,
        "sampling_params": sampling[0] if one else sampling,
        "return_logprob": True,
    }
    if rids is not None:  # our own request ids, so one request can be aborted
        body["rid"] = rids[0] if one else rids
    if images is not None and any(images):
        body["image_data"] = images[0] if one else images
    if routed_from is not None:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = routed_from
    return Call("/generate", body)


def generate_results(reply: Any, n: int) -> list[dict[str, Any]]:  # a JSON value
    """The ``n`` results of a :func:`generate` reply, in request order (a one-prompt
    request answers with the result itself, not a list)."""
    return [reply] if n == 1 else list(reply)


def abort_request(rid: str) -> Call:
    """End request ``rid`` now; it returns what it generated so far."""
    return Call("/abort_request", {"rid": rid})


def abort_all() -> Call:
    return Call("/abort_request", {"abort_all": True})


def pause_generation(mode: str) -> Call:
    """``retract``: running requests go back to the queue (KV freed) and resume after
    :func:`continue_generation`; ``abort``: they return now; ``in_place``: they stay."""
    return Call("/pause_generation", {"mode": mode})


def continue_generation() -> Call:
    return Call("/continue_generation")


def flush_cache() -> Call:
    """Drop the prefix cache (after new weights, stale KV must not be reused)."""
    return Call("/flush_cache")


# ---------------------------------------------------------------------- state
def model_info() -> Call:
    return Call("/model_info", method="GET")


def weight_version(reply: dict[str, Any]) -> int:
    """The weight version in a :func:`model_info` reply."""
    return parse_version(reply["weight_version"])


def health() -> Call:
    return Call("/health", method="GET")


# ---------------------------------------------------------------------- weight updates
def begin_weight_update() -> Call:
    return Call("/begin_weight_update")


def end_weight_update() -> Call:
    return Call("/end_weight_update")


def update_weights_from_tensor(serialized: list[str], load_format: str | None) -> Call:
    """Load one payload: ``serialized`` holds one entry per server TP rank (see
    rl/generator/weight_payload.py); ``load_format`` None is SGLang's named tensors. The
    cache is flushed once after the last payload of a version, not per payload."""
    body = {"serialized_named_tensors": serialized, "load_format": load_format}
    return Call("/update_weights_from_tensor", {**body, "flush_cache": False})


def update_weight_version(version: int) -> Call:
    """Set the version the server reports (and stamps on every new token)."""
    return Call(
        "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
    )


def init_weights_update_group(
    address: str, port: int, rank_offset: int, world_size: int, name: str, backend: str
) -> Call:
    """Have every server rank join the process group ``name`` at ``address``:``port`` as
    ranks ``rank_offset`` on; the call returns once all ``world_size`` ranks joined."""
    body = {
        "master_address": address,
        "master_port": port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": name,
        "backend": backend,
    }
    return Call("/init_weights_update_group", body)


def refusal(reply: dict[str, Any]) -> str | None:
    """Why the server refused a weight-update call it answered with HTTP 200 (SGLang says
    ``success: false`` and a message), or None if it did not."""
    return str(reply.get("message")) if reply.get("success") is False else None


# ---------------------------------------------------------------------- transport
def _decode(text: str) -> Any:  # a JSON value
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError:  # /flush_cache answers in plain text
        return {"text": text}


def call(url: str, c: Call, keys: ServerKeys | None, timeout: float = 30.0) -> Any:  # JSON
    """Make ``c`` on the server at ``url`` with the key its route needs (``keys`` None:
    none, which only ``/health`` accepts) and return its decoded JSON reply."""
    data = json.dumps(c.body).encode() if c.method == "POST" else None
    headers = {"Content-Type": "application/json"}
    if keys is not None:
        headers.update(keys.headers(c.route))
    req = urllib.request.Request(url + c.route, data=data, headers=headers, method=c.method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:DETAIL_CHARS].decode(errors="replace")
        raise CallError(url, c.route, e.code, detail) from e
    except OSError as e:
        raise CallError(url, c.route, None, f"{type(e).__name__}: {e}") from e
    return _decode(raw.decode(errors="replace"))


async def acall(
    session: aiohttp.ClientSession, url: str, c: Call, keys: ServerKeys | None
) -> Any:  # a JSON value
    """:func:`call` on an asyncio loop (``session`` sets the timeout)."""
    body = c.body if c.method == "POST" else None
    headers = keys.headers(c.route) if keys is not None else None
    for attempt in range(2):
        try:
            async with session.request(c.method, url + c.route, json=body,
                                       headers=headers) as resp:  # fmt: skip
                text = await resp.text()
            break
        except aiohttp.ServerDisconnectedError as e:
            # The server closed the connection before answering: most often a kept-alive
            # connection it had just timed out (uvicorn closes idle ones after 5 s), which
            # says nothing of the server. Once more, on another connection; a server that
            # is really gone then refuses it.
            if attempt:
                raise CallError(url, c.route, None, f"{type(e).__name__}: {e}") from e
        except (TimeoutError, aiohttp.ClientConnectionError) as e:
            raise CallError(url, c.route, None, f"{type(e).__name__}: {e}") from e
    if resp.status != 200:
        raise CallError(url, c.route, resp.status, text[:DETAIL_CHARS])
    return _decode(text)


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Does the server at ``url`` answer ``/health``? (SGLang asks no key for it.)"""
    try:
        call(url, health(), None, timeout)
    except CallError:
        return False
    return True
