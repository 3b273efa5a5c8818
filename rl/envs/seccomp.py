"""A seccomp-BPF filter from Python (ctypes): the system calls a sandboxed run has no use
for, and that widen what a kernel bug can be reached through, fail with ``EPERM``.

Denied (``DENIED``): ``ptrace`` and what shares its access check (``process_vm_readv``,
``process_vm_writev``, ``pidfd_getfd``, ``process_madvise``); ``bpf``,
``perf_event_open``, ``userfaultfd``; the key store (``add_key``, ``request_key``,
``keyctl``); ``kexec_load``, ``kexec_file_load``; ``init_module``, ``finit_module``,
``delete_module``; ``io_uring_setup``, ``io_uring_enter``, ``io_uring_register``; every
mount call, old (``mount``, ``umount2``, ``pivot_root``) and new (``open_tree``,
``move_mount``, ``fsopen``, ``fsconfig``, ``fsmount``, ``fspick``, ``mount_setattr``);
``unshare``, ``setns``; and ``clone`` with any ``CLONE_NEW*`` flag. ``clone3`` answers
``ENOSYS``: its flags sit in memory a filter cannot read, and glibc then falls back to
``clone`` (threads, ``posix_spawn``), whose flags it can. Every other call is allowed.

``EPERM`` rather than a kill, so a library that probes for one of them (say io_uring)
takes its fallback. A call of another architecture than the interpreter's (i386 through
``int 0x80`` on x86-64, arm32 on aarch64) and an x32 call on x86-64 get ``EPERM`` too, so
no second syscall table goes around the list. On an architecture without a table here,
``install()`` refuses (``OSError``) rather than guess numbers.

``install()`` runs in rl/envs/sandbox_boot.py after the private root and Landlock (whose
own mounts and pivot come first), in the boot's one thread; loaded by path, so it imports
nothing outside the standard library.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import sys
from collections.abc import Iterable

_PR_SET_NO_NEW_PRIVS, _PR_GET_SECCOMP, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 21, 22, 2
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # classic BPF, constant k
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data; _ARG0: its low half (LE)
_X32_BIT = 0x40000000
NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET

# The audit architecture a call must carry, and the numbers of the calls below.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_COMMON = {  # the same number on every architecture (added after 5.1)
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "clone3": 435,
}
_NUMBERS = {
    "x86_64": {
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "kexec_load": 246,
        "kexec_file_load": 320,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "unshare": 272,
        "setns": 308,
        "clone": 56,
        **_COMMON,
    },
    "aarch64": {  # asm-generic/unistd.h
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "bpf": 280,
        "perf_event_open": 241,
        "userfaultfd": 282,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "kexec_load": 104,
        "kexec_file_load": 294,
        "init_module": 105,
        "finit_module": 273,
        "delete_module": 106,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "unshare": 97,
        "setns": 268,
        "clone": 220,
        **_COMMON,
    },
}
DENIED = tuple(n for n in _NUMBERS["x86_64"] if n not in ("clone", "clone3"))


class _Instruction(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Instruction))]


Instruction = tuple[int, int, int, int]  # code, jump if true, jump if false, k


def _deny(nr: int, answer: int) -> Iterable[Instruction]:
    """``nr`` returns ``-answer``; any other number goes on to the next test."""
    yield (_JEQ, 0, 1, nr)
    yield (_RET, 0, 0, _RET_ERRNO | answer)


def program(machine: str, denied_errno: int = errno.EPERM) -> list[Instruction]:
    """The filter for ``machine`` (``platform.machine()``), each denied call answering
    ``denied_errno``; raises OSError for a machine without a table here."""
    numbers = _NUMBERS.get(machine)
    if numbers is None or sys.byteorder != "little":
        raise OSError(errno.ENOSYS, f"seccomp: no syscall table for {machine!r}")
    deny = (_RET, 0, 0, _RET_ERRNO | denied_errno)
    out: list[Instruction] = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ, 1, 0, _AUDIT_ARCH[machine]), deny]
    out.append((_LD_W_ABS, 0, 0, _NR))
    if machine == "x86_64":  # x32 calls carry the x86-64 arch and this bit in their number
        out += [(_JGE, 0, 1, _X32_BIT), deny]
    for name in DENIED:
        out += _deny(numbers[name], denied_errno)
    out += _deny(numbers["clone3"], errno.ENOSYS)
    out += [
        (_JEQ, 0, 3, numbers["clone"]),
        (_LD_W_ABS, 0, 0, _ARG0),  # clone's flags: every CLONE_NEW* is in the low half
        (_JSET, 0, 1, NAMESPACE_FLAGS),
        deny,
        (_RET, 0, 0, _RET_ALLOW),
    ]
    return out


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mode() -> int:
    """This process's seccomp mode: 0 none, 2 a filter; -1 without seccomp in the kernel."""
    return int(_libc().prctl(_PR_GET_SECCOMP, 0, 0, 0, 0))


def install(denied_errno: int = errno.EPERM) -> None:
    """Filter this process's calls, and its future children's, for good (no-new-privs is
    set first, as the kernel requires of a process without CAP_SYS_ADMIN). Only this
    thread is filtered: call it before any other thread starts. Raises OSError."""
    rules = program(platform.machine(), denied_errno)
    code = (_Instruction * len(rules))(*(_Instruction(*r) for r in rules))
    prog = _Program(len(rules), code)
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0):
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp filter refused: {errno.errorcode.get(err, err)}")
