"""The tensor index of a torch_dist checkpoint (``.metadata``), unpickled without running code.

Why: torch.distributed.checkpoint's ``FileSystemReader.read_metadata`` calls
``pickle.load`` on it, and a pickle may call any function it can name while it loads: a
``.metadata`` prefixed with a pickled ``exec`` call ran its payload in every trainer rank.
Whoever can write a checkpoint directory (a shared scratch, a downloaded
checkpoint) could run code in the job.

A pickle reaches a class or function only through a global it names (the GLOBAL,
STACK_GLOBAL, INST, OBJ and EXT opcodes), and every one of those goes through
``Unpickler.find_class``. Here that allows only the names torch writes into the index
(:data:`ALLOWED`, plus the dtypes) and refuses anything else *before* it is imported, with
one line naming the file and the global. Persistent ids (torch.load's storages) are
refused too. The list is what torch 2.14.1 and Megatron-Core 0.16.1 wrote for every
checkpoint our tests produce (dense and MoE, weights only and with optimizer state, from
Megatron's save and from ``dcp.save``), plus the names older torch releases used for the
same classes; an allowed name can only build index data, never run a command.

Stdlib only: the launcher's check (rl/config/ckpt_check.py) uses :func:`allowed` without
torch; :class:`MetadataUnpickler` imports the allowed torch modules only when it loads one
(the trainer's and the converters' reads, through rl/weights/dcp_guard.py).
"""

from __future__ import annotations

import pickle
from typing import Any, BinaryIO, NoReturn

_MD = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_LEGACY = "torch.distributed._shard.sharded_tensor.metadata"  # torch < 2.2 wrote these

ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [(_MD, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                        "_MEM_FORMAT_ENCODING")]
    + [(_PLANNER, n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                               "BytesIOWriteData")]
    + [(_LEGACY, n) for n in ("TensorProperties", "MEM_FORMAT_ENCODING")]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a lookup of torch.strided etc. by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, as dcp.save records it
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    ]
)  # fmt: skip

# A torch.dtype pickles as the global ``torch.<name>``: these names, and no other torch.*.
TORCH_DTYPES: frozenset[str] = frozenset(
    ["bool", "float16", "bfloat16", "float32", "float64", "complex32", "complex64",
     "complex128", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
     "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8", "qint32", "quint8", "quint4x2",
     "quint2x4"]
    + [f"{k}{b}" for k in ("int", "uint") for b in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)]
)  # fmt: skip


def allowed(module: str, name: str) -> bool:
    """Whether a checkpoint index may name ``module.name``."""
    return (module, name) in ALLOWED or (module == "torch" and name in TORCH_DTYPES)


class RefusedPickle(pickle.UnpicklingError):
    """A ``.metadata`` that names something other than checkpoint metadata: one line with
    the file and the name; nothing it names was imported or called."""

    def __init__(self, where: str, what: str, instead_of: str = "checkpoint metadata") -> None:
        super().__init__(f"{where}: refused: it would load {what}, not {instead_of}")
        self.where, self.what = where, what


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` for a checkpoint index: only :func:`allowed` globals."""

    def __init__(self, file: BinaryIO, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if not allowed(module, name):  # checked before anything is imported
            raise RefusedPickle(self.where, f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: object) -> NoReturn:
        raise RefusedPickle(self.where, "a persistent object (a storage)")


def load(file: BinaryIO, where: str) -> Any:
    """The object pickled in ``file`` (named ``where`` in errors), built from allowed
    names only, or :class:`RefusedPickle`."""
    return MetadataUnpickler(file, where).load()
