"""What every CPU rank imports before its work: loaded once, in multiprocessing's fork
server, from which :func:`rl.runtime.launch.spawn` forks the ranks.

Why: a rank started with ``spawn`` is a fresh interpreter that imports torch and, after
the CPU patches, Megatron-Core again: about 4.5 s of one core per rank. On 2 cores, 4 ranks
were ready after 10.6 s and took 2.0 GB (PSS); forked from the server, after 0.23 s and
0.4 GB, once the server is up (4.8 s for the first job of a process:
``tools/bench/rank_start.py``, ``tools/bench/results/rank_start.json``).

Importing this module *is* its work: the fork server imports it by name. The server
stays single-threaded and runs no torch kernel, so a rank forked from it owns a fresh
OpenMP pool. Only CPU ranks start this way: on CUDA no patch applies and ranks spawn.
"""

from __future__ import annotations

import megatron_patches
from rl.runtime.launch import quiet_known_warnings

quiet_known_warnings()
megatron_patches.apply_all("cpu")

import megatron.core  # noqa: E402,F401  after the patches, which must precede it
