"""The footprint patch of CPU servers (rl/serving/server_footprint.py), without a server:
tqdm makes no multiprocessing lock, and the patch goes in once. A run leaving no
semaphore: tests/servers/test_rl_job.py."""

from __future__ import annotations

import types

from rl.serving import server_footprint as ls


def test_tqdm_makes_no_semaphore():
    """tqdm makes its lock only if the class has none: with ``mp_lock`` set to None, no
    named semaphore (``/dev/shm/sem.mp-*``, left behind by a killed process tree)."""

    class Lock:  # tqdm.std.TqdmDefaultWriteLock's logic
        @classmethod
        def create_mp_lock(cls):
            if not hasattr(cls, "mp_lock"):
                cls.mp_lock = "a multiprocessing RLock"

    module = types.ModuleType(ls.TQDM)
    module.TqdmDefaultWriteLock = Lock
    ls.patch_tqdm(module)
    ls.patch_tqdm(module)
    Lock.create_mp_lock()
    assert Lock.mp_lock is None
