"""Patch: torch DCP reads a checkpoint's ``.metadata`` with a restricted unpickler.

Why: ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with ``pickle.load``, so a
checkpoint directory someone else wrote ran code in every rank that loaded it (a
``.metadata`` prefixed with a pickled ``exec`` call). Megatron-Core builds its own
readers inside ``dist_checkpointing`` (``strategies/torch.py``: ``FileSystemReader`` and
``CachedMetadataFileSystemReader``, which calls ``super().read_metadata()``), so no reader
of ours can stand in for them: the method itself is replaced, for every reader and
subclass in the process. rl/config/dcp_metadata.py decides what the index may name; a
refused index raises :class:`~rl.config.dcp_metadata.RefusedPickle`, one line naming the
file, with nothing it names imported or run.
Replaces: ``torch.distributed.checkpoint.filesystem.FileSystemReader.read_metadata`` (the
same body, with ``pickle.load`` replaced and the result checked to be a ``Metadata``).
Versions: torch 2.14.1, as used by Megatron-Core 0.16.1. On every device: this is not a
CPU shim, so it is not one of megatron_patches' (which do nothing on CUDA).

Applied by every reader of torch_dist checkpoints before it reads
(rl/weights/dist_ckpt.py: the trainer's load and the converters' checks;
rl/weights/megatron_io.py: the converters' reads); nothing is patched at import.
"""

from __future__ import annotations

import threading
from typing import BinaryIO, cast

from rl.config import dcp_metadata

NAME = "dcp_guard"
_lock = threading.Lock()
_applied = False


def apply() -> bool:
    """Replace ``FileSystemReader.read_metadata`` once; return whether this call did."""
    global _applied
    with _lock:
        if _applied:
            return False
        from torch.distributed.checkpoint import filesystem
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        reader = filesystem.FileSystemReader
        if not hasattr(reader, "_get_metadata_path"):  # the body below is torch 2.14.1's
            raise ImportError(
                "torch.distributed.checkpoint.FileSystemReader has no _get_metadata_path: "
                "this torch is not the one rl/weights/dcp_guard.py was written for; update it"
            )

        def read_metadata(
            self: filesystem.FileSystemReader, *args: object, **kwargs: object
        ) -> Metadata:
            rank = kwargs.get("rank")  # torch's own takes only this, and ignores the rest
            path = self._get_metadata_path(rank if isinstance(rank, int) else None)
            with self.fs.create_stream(path, "rb") as f:
                metadata = dcp_metadata.load(cast(BinaryIO, f), str(path))  # opened "rb"
            if not isinstance(metadata, Metadata):
                raise dcp_metadata.RefusedPickle(str(path), f"a {type(metadata).__name__}")
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        read_metadata._msrl_original = reader.read_metadata  # type: ignore[attr-defined]
        reader.read_metadata = read_metadata  # type: ignore[method-assign]
        _applied = True
        return True


def applied() -> bool:
    return _applied
