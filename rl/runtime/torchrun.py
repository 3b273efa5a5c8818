"""torchrun, with the stores it hosts listening on one address instead of every interface.

    python -m rl.runtime.torchrun [torchrun's arguments]    # launch/local.sh, train.sbatch

Why: torchrun hosts two torch TCPStores, the c10d rendezvous store (on the node named by
``--rdzv-endpoint``) and the agent store it shares with the ranks (on the first node: the
job's store, whose channels carry the job's messages, rl/runtime/job.py). Given a host
name, a TCPStore server listens on every interface (``ss -ltn`` showed both on ``*``), so
anyone who reaches a node could connect to them. Our spawner binds its store itself
(``job.job_store``); this does the same inside torchrun's agent.

What it replaces, in this process only (the agent; the ranks it starts are untouched):
the ``TCPStore`` that ``c10d_rendezvous_backend`` and ``static_tcp_rendezvous`` call, and
``DynamicRendezvousHandler._create_tcp_store_server``, with :func:`bound_store`: a
server binds a socket to the address its host name resolves to (or ``MSRL_HOST_ADDRESS``,
for a node whose name resolves to the wrong interface) and hands it to the TCPStore
(``master_listen_fd``). Clients, and a port already taken (torch's own error, so its
fallback to being a client still works), go to torch unchanged. Versions: torch 2.14.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from rl.runtime.net import listening_socket

if TYPE_CHECKING:
    from torch.distributed import TCPStore

HOST_ENV = "MSRL_HOST_ADDRESS"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_job = {"nodes": 1}  # --nnodes' maximum, from main()
_warned: set[str] = set()


def bind_address(host: str) -> str:
    """Where a store named by ``host`` listens: ``MSRL_HOST_ADDRESS`` for this node's own
    name, else the first address ``host`` resolves to."""
    override = os.environ.get(HOST_ENV)
    if override and host not in LOOPBACK_NAMES:
        host = override
    return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


def bound_store(
    host_name: str,
    port: int,
    world_size: int | None = None,
    is_master: bool = False,
    timeout: timedelta = timedelta(seconds=300),
    wait_for_workers: bool = True,
    multi_tenant: bool = False,
    master_listen_fd: int | None = None,
    use_libuv: bool = True,
) -> TCPStore:
    """A TCPStore whose server listens on :func:`bind_address`, not on every interface
    (torch's TCPStore's own arguments)."""
    import torch.distributed as dist

    if is_master and master_listen_fd is None:
        addr = bind_address(host_name)
        try:
            master_listen_fd, port = listening_socket(addr, port)
        except OSError:
            pass  # taken: torch says so in its own words, which its callers expect
        else:
            _warn_if_unreachable(host_name, addr)
    return dist.TCPStore(host_name, port, world_size, is_master, timeout,
                         wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                         master_listen_fd=master_listen_fd, use_libuv=use_libuv)  # fmt: skip


def _warn_if_unreachable(host: str, addr: str) -> None:
    """One line when a store of a job that spans nodes listens where only this node can
    reach it: a name that resolves to loopback here (a Debian /etc/hosts line)."""
    if host in LOOPBACK_NAMES or not ipaddress.ip_address(addr).is_loopback:
        return
    if _job["nodes"] == 1 or host in _warned:
        return
    _warned.add(host)
    print(
        f"torchrun: {host} resolves to {addr} here, so agents on other hosts cannot reach "
        f"the store it hosts; set {HOST_ENV} to this node's address",
        file=sys.stderr,
        flush=True,
    )


def install() -> None:
    """Route torchrun's store servers through :func:`bound_store` (idempotent)."""
    from torch.distributed.elastic.rendezvous import (
        c10d_rendezvous_backend,
        dynamic_rendezvous,
        static_tcp_rendezvous,
    )

    c10d_rendezvous_backend.TCPStore = bound_store  # type: ignore[misc,assignment]
    static_tcp_rendezvous.TCPStore = bound_store  # type: ignore[misc,assignment]

    def _create_tcp_store_server(self: object, master_addr: str, master_port: int) -> TCPStore:
        return bound_store(master_addr, master_port, is_master=True, multi_tenant=True)

    handler = dynamic_rendezvous.DynamicRendezvousHandler
    handler._create_tcp_store_server = _create_tcp_store_server  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    """torchrun's own entry point, after :func:`install`."""
    from torch.distributed import run

    args = run.parse_args(argv if argv is not None else sys.argv[1:])
    _job["nodes"] = run.parse_min_max_nnodes(args.nnodes)[1]
    install()
    run.main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
