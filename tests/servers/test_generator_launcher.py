"""The server launcher's failure paths, each with servers of its own: a process that owns
servers and is interrupted or killed, a server that exits during startup, and one that
never becomes healthy. No SGLang process may outlive any of them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.serving.launcher import ServerConfig, ServerError, ServerLauncher
from tests.helpers.hf_models import make_model
from tests.helpers.procs import assert_group_gone, group_listeners


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("gen") / "tiny")


# The owner takes Ctrl-C as an interactive Python does, even when the suite runs as a
# background job (whose children start with SIGINT ignored).
_OWNER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from rl.serving.launcher import ServerConfig, ServerLauncher
cfg = ServerConfig(model_path=sys.argv[1], threads=1)
launcher = ServerLauncher(cfg, n=1, log_dir=sys.argv[2]).start()
print(launcher.servers[0].proc.pid, flush=True)
time.sleep(600)
"""


def _shm_loads() -> set[str]:
    """SGLang's load-snapshot files (one per server start) in /dev/shm."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("sglang_loads_")}


def test_no_orphans_after_ctrl_c_or_a_killed_parent(model_dir, tmp_path):
    """A process that owns a server is interrupted (Ctrl-C: atexit stops the server) or
    SIGKILLed (no Python runs: the guard's parent-death signal stops the server); either
    way no SGLang process survives it, nor the /dev/shm files the servers made."""
    before = _shm_loads()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    owners = {
        how: subprocess.Popen(
            [sys.executable, "-c", _OWNER, str(model_dir), str(tmp_path / how)],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        for how in ("sigint", "sigkill")
    }  # fmt: skip
    try:
        servers = {how: int(p.stdout.readline()) for how, p in owners.items()}
        assert len(_shm_loads() - before) == 2  # one per server, made by its scheduler
        owners["sigint"].send_signal(signal.SIGINT)
        owners["sigkill"].kill()
        for p in owners.values():
            p.wait(timeout=60)
        for pid in servers.values():  # SGLang drains for a few seconds on SIGTERM
            assert_group_gone(pid, timeout=90)
        assert _shm_loads() - before == set()  # each guard removed its server's
    finally:
        for p in owners.values():
            p.kill()


def test_server_that_exits_during_startup_reports_its_log(model_dir, tmp_path):
    cfg = ServerConfig(model_path=str(model_dir), extra_args=("--no-such-flag",))
    with pytest.raises(ServerError) as e:
        ServerLauncher(cfg, n=1, log_dir=tmp_path).start()
    msg = str(e.value)
    assert "exited with code 2 during startup" in msg and "--no-such-flag" in msg


def test_server_that_never_gets_healthy_times_out_and_is_killed(model_dir, tmp_path):
    cfg = ServerConfig(model_path=str(model_dir), startup_timeout=2.0)
    launcher = ServerLauncher(cfg, n=1, log_dir=tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"not healthy after server.startup_timeout=2.0s"):
        launcher.start()
    assert time.monotonic() - t0 < 30
    assert_group_gone(launcher.servers[0].proc.pid)


def test_server_whose_port_was_taken_starts_on_another(model_dir, tmp_path, capsys):
    """The port is picked before the server starts, and another process can take it
    meanwhile. The guard refuses it before SGLang loads anything (its own bind comes only
    after the model is loaded), and the launcher moves the server to a new port: the path
    it takes when SGLang itself reports the clash, from the same words in the log."""
    launcher = ServerLauncher(ServerConfig(model_path=str(model_dir)), n=1, log_dir=tmp_path)
    taken, before = launcher.servers[0].port, _shm_loads()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with launcher:
            s = launcher.servers[0]
            assert s.port != taken and s.url.endswith(f":{s.port}") and s.healthy()
            listening = group_listeners(os.getpgid(s.proc.pid))
            assert [ip for ip, port, _ in listening if port == s.port] == ["127.0.0.1"]
            launcher.stop(grace=0)  # nothing in flight: no drain
    # SIGKILLed with its guard, the server's load snapshot is unlinked by the launcher: a
    # stop at the end of every run left one in /dev/shm.
    assert _shm_loads() - before == set()
    log = (tmp_path / "server0.log").read_text()
    assert f"server_guard: cannot bind 127.0.0.1:{taken}: address already in use" in log
    said = [x for x in capsys.readouterr().out.splitlines() if "was taken" in x]
    assert said == [f"SGLang server 0: port {taken} was taken by another process; starting "
                    f"it again on port {s.port}"]  # fmt: skip
