"""Linux Landlock from Python (ctypes): a process restricts itself, and every process it
starts, to reading and running files under a few directories, writing under one, no TCP
bind or connect, and no signals to processes outside its domain.

Landlock needs no privilege and no helper binary: Linux 5.13+ with the LSM enabled
(``abi()`` > 0). Each ABI adds what it can restrict: 2 file renames across directories,
3 truncation, 4 TCP, 5 device ioctls, 6 signals and abstract unix sockets. None up to 7
restricts connecting to a named unix socket: rl/envs/private_root.py keeps those out of
view. The rules are applied with ``restrict()`` in the sandboxed process itself
(rl/envs/sandbox_boot.py), so this module imports nothing outside the standard library.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Sequence

_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446  # the same numbers on every architecture
_VERSION = 1  # landlock_create_ruleset flag: return the ABI version
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_WRITE_DIR = sum(1 << b for b in range(4, 13))  # remove, make char/dir/reg/sock/fifo/block/sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | _TRUNCATE | _IOCTL_DEV
_NET_TCP = (1 << 0) | (1 << 1)  # bind, connect
_SCOPE = (1 << 0) | (1 << 1)  # abstract unix sockets, signals


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or this is not Linux)."""
    if platform.system() != "Linux":
        return 0
    n = _libc().syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    return max(int(n), 0)


def _fs_access(version: int) -> int:
    out = EXECUTE | WRITE_FILE | READ_FILE | READ_DIR | _WRITE_DIR
    return (
        out
        | (_REFER if version >= 2 else 0)
        | (_TRUNCATE if version >= 3 else 0)
        | (_IOCTL_DEV if version >= 5 else 0)
    )


def restrict(read: Sequence[str], write: Sequence[str], files_rw: Sequence[str] = ()) -> list[str]:
    """Restrict this process and its future children: read and execute under ``read``,
    everything under ``write``, read and write ``files_rw`` (say /dev/null); with ABI 4+
    no TCP, with ABI 6+ no signals or abstract sockets beyond the domain. Returns what was
    restricted, by name; raises OSError when the kernel refuses."""
    version = abi()
    if version < 1:
        raise OSError("Landlock is not available on this kernel")
    libc = _libc()
    fs = _fs_access(version)
    attr = _RulesetAttr(fs, _NET_TCP if version >= 4 else 0, _SCOPE if version >= 6 else 0)
    size = ctypes.sizeof(attr) if version >= 6 else (16 if version >= 4 else 8)
    ruleset = libc.syscall(_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        wanted: list[tuple[str, int]] = [(p, EXECUTE | READ_FILE | READ_DIR) for p in read]
        wanted += [(p, fs) for p in write] + [(p, READ_FILE | WRITE_FILE) for p in files_rw]
        for path, access in wanted:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a directory this system lacks (say /lib64) grants nothing
            try:
                if not os.path.isdir(path):
                    access &= _FILE_ONLY
                rule = _PathBeneath(access & fs, fd)
                if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), 0):
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path!r} failed")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_RESTRICT, ruleset, 0):
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    done = ["files"] + (["tcp"] if version >= 4 else [])
    return done + (["signals"] if version >= 6 else [])
