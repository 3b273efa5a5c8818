"""Megatron ``torch_dist`` checkpoint files, read without torch: what is on disk, what the
metadata says should be, and the model config the checkpoint was saved for.

Why without torch: the launcher checks a checkpoint before any rank starts, in
milliseconds, and a truncated shard must be named by file rather than surface minutes
later as a bare ``EOFError`` from inside torch's reader. The layout (written by
rl/weights/dist_ckpt.py through Megatron's dist_checkpointing):

* ``metadata.json``: the backend, ``{"sharded_backend": "torch_dist", ...}``;
* ``common.pt``: the non-tensor state (a torch zip: ``*/data.pkl``), with our
  ``format_version`` and ``model_config``;
* ``.metadata``: torch.distributed.checkpoint's pickled ``Metadata``, whose
  ``storage_data`` maps every tensor chunk to (shard file, offset, length);
* ``__<rank>_<n>.distcp``: the shards.

The pickles are read with stand-in classes: no class named in the file is imported and no
code from it runs. ``.metadata`` may name only what torch writes into a checkpoint index
(rl/config/dcp_metadata.py): anything else is refused here, before any rank would load it.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

from rl.config import dcp_metadata
from rl.config.schema import ARCH_FIELDS

FORMAT_VERSION = 1  # of our common state (rl/weights/dist_ckpt.py writes it)
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
TORCH_METADATA = ".metadata"
# Megatron-LM's training runs write iter_NNNNNNN/ directories and this tracker next to them.
TRACKER = "latest_checkpointed_iteration.txt"

# Builtins that rebuild plain data; every other global becomes a stand-in.
_SAFE_BUILTINS = {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex,
                  "bytearray": bytearray, "range": range}  # fmt: skip


# What a field absent from an older checkpoint meant (a Llama-family dense model).
ARCH_DEFAULTS = {
    "architecture": "LlamaForCausalLM",
    "qk_norm": False,
    "head_dim": None,
    "num_experts": 0,
    "moe_ffn_hidden_size": None,
    "shared_expert_ffn_hidden_size": 0,
    "shared_expert_gate": False,
}


class Unreadable(ValueError):
    """A checkpoint file that is missing, cut short or not what the format says."""


class _Stub:
    """Whatever a pickle names (a torch class, a dtype, a rebuild function): it accepts
    any arguments and state and keeps the state as attributes."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args = args

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ values)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return _Stub(*args)


class _StubUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, index: str | None = None) -> None:
        super().__init__(file)
        self.stubs: dict[tuple[str, str], type] = {}
        self.index = index  # a checkpoint index: the file's name, and only its names allowed

    def find_class(self, module: str, name: str) -> object:
        # A stand-in runs nothing, but an index naming anything else would run it in the
        # trainer, whose reader imports what the index names: refuse it here already.
        if self.index is not None and not dcp_metadata.allowed(module, name):
            raise dcp_metadata.RefusedPickle(self.index, f"{module}.{name}")
        if module == "builtins" and name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        if module == "collections" and name == "OrderedDict":
            return dict
        if module == "copyreg" and name == "_reconstructor":  # protocol 0/1 objects
            return lambda cls, base, state: cls()
        key = (module, name)
        if key not in self.stubs:
            self.stubs[key] = type(name, (_Stub,), {"__module__": module})
        return self.stubs[key]

    def persistent_load(self, pid: object) -> object:  # torch's tensor storages in common.pt
        if self.index is not None:
            raise dcp_metadata.RefusedPickle(self.index, "a persistent object (a storage)")
        return _Stub(pid)


def _unpickle(data: bytes, index: str | None = None) -> Any:
    """Stand-ins with whatever attributes the file set; ``index``: the file is a checkpoint
    index of that name (see :class:`_StubUnpickler`)."""
    import io

    return _StubUnpickler(io.BytesIO(data), index).load()


def read_backend(path: Path) -> str:
    """``sharded_backend`` of ``metadata.json`` (Megatron's marker of a complete save)."""
    f = path / METADATA_JSON
    if not f.is_file():
        raise Unreadable(f"has no {METADATA_JSON} (not a Megatron dist checkpoint, or incomplete)")
    try:
        meta = json.loads(f.read_text())
        return str(meta["sharded_backend"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Unreadable(f"{METADATA_JSON} is unreadable ({type(e).__name__}: {e})") from None


def expected_shard_sizes(path: Path) -> dict[str, int]:
    """Bytes each shard file must hold, from ``.metadata``: the end of its last chunk."""
    f = path / TORCH_METADATA
    if not f.is_file():
        raise Unreadable(f"has no {TORCH_METADATA} (the tensor index): incomplete save")
    try:
        storage = _unpickle(f.read_bytes(), index=str(f)).storage_data
        sizes: dict[str, int] = {}
        for info in storage.values():
            end = int(info.offset) + int(info.length)
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    except dcp_metadata.RefusedPickle as e:  # names the file and what it would load
        raise Unreadable(f"cannot be loaded: {e}") from None
    except Exception as e:  # any damage to the pickle: one line, not its traceback
        raise Unreadable(
            f"{TORCH_METADATA} is unreadable ({type(e).__name__}): cut short?"
        ) from None
    if not sizes:
        raise Unreadable(f"{TORCH_METADATA} lists no shard files")
    return sizes


def shard_problem(path: Path) -> str | None:
    """The first shard that is missing or shorter than ``.metadata`` says, by name."""
    for name, size in sorted(expected_shard_sizes(path).items()):
        shard = path / name
        if not shard.is_file():
            return f"shard {str(shard)!r} is missing ({TORCH_METADATA} lists it)"
        have = shard.stat().st_size
        if have < size:
            return f"shard {str(shard)!r} is truncated: {have} of {size} bytes"
    return None


def read_common(path: Path) -> dict[str, Any]:
    """The common state (``common.pt``) as plain data; tensors in it become stand-ins."""
    f = path / COMMON
    if not f.is_file():
        raise Unreadable(f"has no {COMMON} (the common state): incomplete save")
    try:
        with zipfile.ZipFile(f) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
            common = _unpickle(z.read(pkl))
    except Exception as e:  # a damaged zip or pickle: one line, not its traceback
        raise Unreadable(f"{COMMON} is unreadable ({type(e).__name__}): cut short?") from None
    if not isinstance(common, dict):
        raise Unreadable(f"{COMMON} holds a {type(common).__name__}, not a dict")
    return common


def problem(path: Path) -> str | None:
    """What is wrong with the torch_dist checkpoint directory ``path`` (None: nothing),
    as the end of a sentence about it: its files, not the model it is for."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is not a directory"
    tracker = path / TRACKER
    if tracker.is_file():
        it = tracker.read_text().strip()
        sub = f"iter_{int(it):07d}" if it.isdigit() else it
        return (
            f"is a Megatron-LM run directory ({TRACKER} says {it!r}): point it at the "
            f"checkpoint itself, e.g. {str(path / sub)!r}"
        )
    if not (path / METADATA_JSON).exists():
        inside = sorted(d.name for d in path.iterdir() if (d / METADATA_JSON).is_file())
        if inside:
            return (
                f"holds no checkpoint itself, but these subdirectories are checkpoints: "
                f"{', '.join(inside[:5])}"
            )
    try:
        backend = read_backend(path)
        if backend != "torch_dist":
            return f"is a {backend!r} checkpoint; only torch_dist is supported"
        return shard_problem(path) or _common_problem(read_common(path))
    except Unreadable as e:
        return str(e)


def _common_problem(common: dict[str, Any]) -> str | None:
    version = common.get("format_version")
    if version != FORMAT_VERSION:
        return f"has format_version={version!r} in {COMMON}, expected {FORMAT_VERSION}"
    return None


def architecture_diffs(stored: object, mine: dict[str, Any]) -> list[str]:
    """How the model config a checkpoint was saved for (``stored``; None: not recorded)
    differs from ``mine`` in the fields that shape its tensors."""
    if not isinstance(stored, dict):
        return []
    return [
        f"{k}: checkpoint {stored.get(k, ARCH_DEFAULTS.get(k))!r} vs config {mine.get(k)!r}"
        for k in ARCH_FIELDS
        if stored.get(k, ARCH_DEFAULTS.get(k)) != mine.get(k)
    ]
