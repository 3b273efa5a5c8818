"""The job's secret: one random key per run directory, which authenticates the control plane.

Why a file: every rank of a job (and every node of a SLURM job, through the shared run
directory) must hold the same key, and the key must never appear on a command line that
``ps`` shows or travel through the job's store, which any local process can reach. The
first process to need it creates ``<run.output_dir>/.msrl_secret`` with mode 0600 (atomic:
written to a private temporary file, then linked into place, so concurrent ranks agree on
one key); every other process reads it. A launcher that already made one hands its path
on in ``MSRL_SECRET_FILE``, which wins.

From the key come the channel messages' HMAC (:func:`sign`/:func:`verify`) and the SGLang
servers' API keys (:func:`derive`), each under its own purpose label.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

ENV = "MSRL_SECRET_FILE"
NAME = ".msrl_secret"
KEY_BYTES = 32
TAG_BYTES = 32  # HMAC-SHA256


class SecretError(RuntimeError):
    """A secret file that is missing, unreadable, malformed or readable by others."""


def path_for(output_dir: str | os.PathLike[str]) -> Path:
    """The secret file this process uses: ``$MSRL_SECRET_FILE``, else the run dir's."""
    return Path(os.environ.get(ENV) or Path(output_dir) / NAME)


def ensure(output_dir: str | os.PathLike[str]) -> Path:
    """Create the run's secret file if there is none (0600, atomically), and export its
    path in ``MSRL_SECRET_FILE`` so that processes this one starts use it too."""
    path = path_for(output_dir)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".msrl_secret.", dir=path.parent)  # 0600
        try:
            os.write(fd, secrets.token_hex(KEY_BYTES).encode())
            os.close(fd)
            with contextlib.suppress(FileExistsError):  # another rank won: use its key
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    load(path)  # checks the mode and the contents
    os.environ[ENV] = str(path)
    return path


def load(path: str | os.PathLike[str] | None = None) -> bytes:
    """The key in ``path`` (default ``$MSRL_SECRET_FILE``)."""
    path = Path(path or os.environ.get(ENV) or "")
    if not str(path) or not path.is_file():
        raise SecretError(f"{ENV}={str(path) or '(unset)'}: no job secret file there")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise SecretError(f"job secret {path} has mode {mode:o}: others may read it (need 600)")
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise SecretError(f"job secret {path} does not hold a hex key of >= 16 bytes")
    return key


def derive(key: bytes, purpose: str) -> str:
    """A hex sub-key for one purpose (e.g. ``sglang-api``), so no user of the job's key
    learns the key itself."""
    return hmac.new(key, b"msrl/" + purpose.encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def verify(key: bytes, data: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(sign(key, data), tag)
