"""Patch: torch DCP reads a checkpoint's ``.metadata`` with a restricted unpickler, and
its non-tensor items with ``weights_only`` unpickling.

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

The same holds for the data files: an item the index calls bytes (a non-tensor value) is
read by ``DefaultLoadPlanner.load_bytes`` with ``torch.load(weights_only=False)``, so an
index that called a tensor of the loader's bytes, and a ``.distcp`` holding a pickled
``exec`` there, ran code too. Replaces ``DefaultLoadPlanner.load_bytes`` (Megatron's
planner inherits it): the same body with ``weights_only=True`` (plain containers, numbers,
strings and tensors, what our checkpoints' non-tensor items are), and a refusal raised as
:class:`~rl.config.dcp_metadata.RefusedPickle` naming the item.
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
        _guard_load_bytes()
        _applied = True
        return True


def _guard_load_bytes() -> None:
    import io
    import pickle
    import re

    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    def load_bytes(self: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # torch names the global it refused
            found = re.search(r"GLOBAL (\S+)", str(e))
            what = found.group(1) if found else "an object weights_only refuses"
            raise dcp_metadata.RefusedPickle(
                f"checkpoint item {fqn!r}", what, "plain data"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    DefaultLoadPlanner.load_bytes = load_bytes  # type: ignore[method-assign]


def applied() -> bool:
    return _applied
