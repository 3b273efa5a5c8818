"""The SGLang servers' keys without a server: derivation from the job's secret, the key
each route gets (checked against SGLang's own route table), the header on the wire, and
where the keys must never show (command line, repr, quoted logs). Milliseconds each."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import secrets
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import aiohttp
import pytest
import yaml

from rl.runtime import secret
from rl.serving import server_api as api
from rl.serving.launcher import Server, ServerConfig, ServerError, _write_private

# Every route this project calls, by the function that builds the call.
OUR_CALLS = [
    api.generate([[1]], [{}]),
    api.abort_request("r"),
    api.abort_all(),
    api.pause_generation("retract"),
    api.continue_generation(),
    api.flush_cache(),
    api.model_info(),
    api.health(),
    api.begin_weight_update(),
    api.end_weight_update(),
    api.update_weights_from_tensor([], None),
    api.update_weight_version(1),
    api.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "gloo"),
]


def _sglang_admin_routes() -> tuple[set[str], set[str]]:
    """(admin, other) routes of SGLang's HTTP server, read from its source: a route is
    admin when its endpoint is decorated ``@auth_level(AuthLevel.ADMIN_*)``."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed")
    src = Path(spec.origin).parent / "srt" / "entrypoints" / "http_server.py"
    admin: set[str] = set()
    other: set[str] = set()
    for node in ast.walk(ast.parse(src.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        routes, is_admin = [], False
        for d in node.decorator_list:
            if not isinstance(d, ast.Call):
                continue
            if isinstance(d.func, ast.Attribute) and d.args and isinstance(d.args[0], ast.Constant):
                routes.append(d.args[0].value)
            if isinstance(d.func, ast.Name) and d.func.id == "auth_level":
                is_admin = "ADMIN" in ast.unparse(d.args[0])
        (admin if is_admin else other).update(r for r in routes if isinstance(r, str))
    return admin, other


def test_each_route_gets_the_key_sglang_accepts_for_it():
    """With both keys set, SGLang's admin routes accept only the admin key and every other
    route only the API key: one wrong entry in ADMIN_ROUTES is a refused call."""
    admin, other = _sglang_admin_routes()
    assert {"/update_weights_from_disk", "/pause_generation"} <= admin and "/generate" in other
    keys = api.ServerKeys.random()
    for route in api.ADMIN_ROUTES | {c.route for c in OUR_CALLS}:
        assert route in admin | other, f"{route} is not an SGLang route"
        want = keys.admin if route in admin else keys.api
        assert keys.for_route(route) == want, route
        assert keys.headers(route) == {"Authorization": f"Bearer {want}"}


def test_job_keys_derive_from_the_job_secret(tmp_path, monkeypatch):
    monkeypatch.delenv(secret.ENV, raising=False)
    with pytest.raises(secret.SecretError, match="no job secret file there"):
        api.job_keys()
    path = secret.ensure(tmp_path / "run")  # exports MSRL_SECRET_FILE
    keys = api.job_keys()
    assert keys == api.job_keys()  # every rank derives the same keys
    key = secret.load(path)
    assert keys.api == secret.derive(key, "sglang-api")
    assert keys.admin == secret.derive(key, "sglang-admin")
    assert key.hex() not in (keys.api, keys.admin) and keys.api != keys.admin
    path.write_text(secrets.token_hex(32))  # another job: other keys
    assert api.job_keys() != keys


def test_keys_are_checked_and_never_printed():
    keys = api.ServerKeys.random()
    assert keys.api not in repr(keys) and keys.admin not in repr(keys)
    cfg = ServerConfig(model_path="m", keys=keys)
    assert keys.admin not in repr(cfg)
    with pytest.raises(ValueError, match="server key 'api' must be >= 16 letters or digits"):
        api.ServerKeys("short", keys.admin)
    with pytest.raises(ValueError, match="server key 'admin' must be"):
        api.ServerKeys(keys.api, "x" * 15 + "\n")
    with pytest.raises(ValueError, match="must differ"):
        api.ServerKeys(keys.api, keys.api)


def test_keys_reach_sglang_through_a_private_file_not_the_command_line(tmp_path):
    # Keys that unquoted YAML would read as numbers must still arrive as strings.
    keys = api.ServerKeys("1" * 16 + "e5", "0" * 20)
    cfg = ServerConfig(model_path="m", keys=keys)
    path = tmp_path / "server0.keys.yaml"
    _write_private(path, cfg.key_config())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {"api-key": keys.api, "admin-api-key": keys.admin}
    argv = cfg.argv(1234, path)
    assert argv[argv.index("--config") + 1] == str(path)
    assert not any(keys.api in a or keys.admin in a for a in argv)
    with pytest.raises(ServerError, match=r"server.keys=None: a server never starts without keys"):
        ServerConfig(model_path="m").key_config()


def test_quoted_server_logs_hide_the_keys(tmp_path):
    """SGLang logs its arguments, keys included; errors quote the log's end."""
    keys = api.ServerKeys.random()
    log = tmp_path / "server0.log"
    log.write_text(f"server_args={{'api_key': '{keys.api}', 'admin_api_key': '{keys.admin}'}}\n")
    s = Server(0, "http://127.0.0.1:1", 1, log, redact=(keys.api, keys.admin))
    msg = str(s.error("exited"))
    assert keys.api not in msg and keys.admin not in msg and "<redacted>" in msg


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def _answer(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        body = json.dumps({"weight_version": "0"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_calls_send_the_routes_key_as_a_bearer_token(recorder):
    keys = api.ServerKeys.random()
    api.call(recorder, api.model_info(), keys)
    api.call(recorder, api.pause_generation("retract"), keys)
    api.call(recorder, api.health(), None)  # the launcher's health check holds no key

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await api.acall(session, recorder, api.generate([[1]], [{}]), keys)
            await api.acall(session, recorder, api.flush_cache(), keys)

    asyncio.run(run())
    assert _Recorder.seen == [
        ("/model_info", f"Bearer {keys.api}"),
        ("/pause_generation", f"Bearer {keys.admin}"),
        ("/health", None),
        ("/generate", f"Bearer {keys.api}"),
        ("/flush_cache", f"Bearer {keys.admin}"),
    ]
