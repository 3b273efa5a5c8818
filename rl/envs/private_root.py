"""A run's own root directory (ctypes): a read-only tmpfs that holds, each at its own path,
read-only binds of what the sandboxed interpreter may read, ``/dev/null`` and the run's
directory, and nothing else: no ``/proc``, ``/tmp``, ``/run``, ``/dev/shm`` or home, so
no socket of the host is left for the code to connect to.

A named unix socket is reached by its path, and neither the network namespace (it hides
abstract sockets only) nor Landlock up to ABI 7 (it has no right for connecting to one)
stands in the way; the Landlock right that would, ``LANDLOCK_ACCESS_FS_RESOLVE_UNIX``,
comes in a later ABI. What is not in the run's mount tree cannot be named at all.

``enter()`` runs in rl/envs/sandbox_boot.py, inside ``unshare --user --mount`` (where the
process is root of its own user namespace and the mounts it changes are its own), before
Landlock; loaded by path, so it imports nothing outside the standard library. Paths stay
what they were, so Landlock's rules and the interpreter's own paths need no change.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Sequence

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 32, 4096
_MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # SYS_pivot_root differs by architecture
_OPEN_TREE, _MOVE_MOUNT, _MOUNT_SETATTR = 428, 429, 442  # the same on every architecture
_AT_FDCWD, _AT_EMPTY_PATH, _AT_RECURSIVE = -100, 0x1000, 0x8000
_OPEN_TREE_CLONE, _MOVE_MOUNT_F_EMPTY_PATH, _MOUNT_ATTR_RDONLY = 1, 4, 1
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _AMBIENT_CLEAR_ALL = 24, 38, 47, 4
_CAPABILITY_V3 = 0x20080522


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _place(path: str, links: dict[str, str], binds: set[str]) -> None:
    """Walk ``path`` as the host resolves it: each symlink on the way is noted, to be made
    again in the new root, and the real path at the end is what gets bound."""
    parts = path.strip("/").split("/")
    here = ""
    for i, name in enumerate(parts):
        here = f"{here}/{name}"
        if os.path.islink(here):
            links[here] = os.readlink(here)
            _place("/".join([os.path.realpath(here), *parts[i + 1 :]]), links, binds)
            return
    binds.add(here or "/")


def _beneath(path: str, others: set[str]) -> bool:
    return any(path != o and path.startswith(o.rstrip("/") + "/") for o in others)


def _bind(source: str, target: str, read_only: bool) -> None:
    """Bind ``source`` (with the mounts under it) on ``target``; read-only means every one of
    those mounts, which ``mount(MS_REMOUNT)`` of the top one alone would not give."""
    fd = _check(
        _libc.syscall(
            _OPEN_TREE,
            _AT_FDCWD,
            source.encode(),
            ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE),
        ),
        f"open_tree {source!r}",
    )
    try:
        if read_only:
            attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
            flags = ctypes.c_uint(_AT_EMPTY_PATH | _AT_RECURSIVE)
            size = ctypes.c_size_t(ctypes.sizeof(attr))
            _check(
                _libc.syscall(_MOUNT_SETATTR, fd, b"", flags, ctypes.byref(attr), size),
                f"mount_setattr {source!r}",
            )
        move = ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH)
        _check(
            _libc.syscall(_MOVE_MOUNT, fd, b"", _AT_FDCWD, target.encode(), move),
            f"move_mount {source!r}",
        )
    finally:
        os.close(fd)


def _drop_capabilities() -> None:
    """Give up every capability, for good (the bounding set too, so no program run later
    gets one back), and gain none by exec: mount, umount and pivot_root need
    CAP_SYS_ADMIN, which this root of the user namespace holds until here."""
    cap = 0
    while _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if ctypes.get_errno() != errno.EINVAL:  # EINVAL: past the last capability
        _check(-1, f"prctl(PR_CAPBSET_DROP, {cap})")
    _check(_libc.prctl(_PR_CAP_AMBIENT, _AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    header, data = _CapHeader(_CAPABILITY_V3, 0), (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def enter(new_root: str, read: Sequence[str], workdir: str, files_rw: Sequence[str]) -> None:
    """Make the empty directory ``new_root`` this process's root: ``read`` (those that
    exist) read-only, ``workdir`` and ``files_rw`` (say /dev/null) writable, each at its
    own path; then drop every capability and chdir to ``workdir``. Raises OSError."""
    syscall_pivot = _PIVOT_ROOT.get(platform.machine())
    if syscall_pivot is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown on {platform.machine()}")
    links: dict[str, str] = {}
    ro: set[str] = set()
    for path in read:
        if os.path.exists(path):  # a system without /lib64, or with a dangling link to it
            _place(os.path.abspath(path), links, ro)
    rw: set[str] = set()
    for path in [workdir, *files_rw]:
        _place(os.path.abspath(path), links, rw)
    if "/" in ro:  # the host's whole tree, every socket in it included
        raise OSError(errno.EINVAL, "a path to read resolves to /")
    ro = {p for p in ro if not _beneath(p, ro)}  # an enclosing bind already shows it
    links = {p: t for p, t in links.items() if not _beneath(p, ro)}
    flags = _MS_NOSUID | _MS_NODEV
    _check(
        _libc.mount(b"sandbox", new_root.encode(), b"tmpfs", flags, b"mode=0755,size=1m"),
        "mount tmpfs",
    )
    for path, target in links.items():
        os.makedirs(new_root + os.path.dirname(path), exist_ok=True)
        os.symlink(target, new_root + path)
    for path in ro | rw:
        if _beneath(path, ro):
            continue  # its mount point is in a bind, where it already is
        if os.path.isdir(path):
            os.makedirs(new_root + path, exist_ok=True)
        else:
            os.makedirs(new_root + os.path.dirname(path), exist_ok=True)
            os.close(os.open(new_root + path, os.O_CREAT | os.O_WRONLY, 0o644))
    remount = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags
    _check(_libc.mount(None, new_root.encode(), None, remount, None), "remount the root")
    for path in sorted(ro | rw, key=lambda p: p.count("/")):  # enclosing binds first
        _bind(path, new_root + path, read_only=path in ro)
    os.chdir(new_root)
    _check(_libc.syscall(syscall_pivot, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH), "detach the old root")
    _drop_capabilities()
    os.chdir(workdir)
