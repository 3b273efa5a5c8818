"""Network helpers shared by the rank spawner, the server launcher and DDMA groups.

Stdlib only: the server launcher must not pay for importing torch.distributed.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to outgoing connections (Linux; a default elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, for a listener that binds later.

    Chosen *below* the kernel's ephemeral range: every outgoing connection (gloo, the job
    store, HTTP clients) takes its local port from that range at any moment, so a port
    picked there can be gone by the time a server binds it (an SGLang server binds ~10 s
    after it is chosen; this failed a run with "address already in use").
    """
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    if lo > LOWEST + 100:
        for _ in range(200):
            port = rng.randrange(LOWEST, lo)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # let the OS pick
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(host: str, port: int) -> tuple[int, int]:
    """A socket listening at ``port`` (0: one the kernel picks) on the first address
    ``host`` resolves to, detached for a torch TCPStore to own (``master_listen_fd``):
    (its descriptor, its port). Why: given only a host, torch's TCPStore server listens
    on every interface. Raises OSError when the port is taken."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.create_server((addr[0], port), family=family, backlog=1024)
    port = sock.getsockname()[1]
    return sock.detach(), port


def host_address() -> str:
    """This host's address as other nodes reach it (MSRL_HOST_ADDRESS overrides it, e.g.
    for a node whose hostname resolves to the wrong interface)."""
    import os

    return os.environ.get("MSRL_HOST_ADDRESS") or socket.gethostbyname(socket.gethostname())
