"""Read and write Hugging Face checkpoint directories (config.json + safetensors shards).

Reading validates everything that can be checked from headers *before* any work starts:
missing files, truncated safetensors (data shorter than the header declares), missing or
misshapen tensors. Tensors are then read lazily, whole or as row ranges, so a converter
never holds more than it needs. Writing buffers one output shard at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rl.config.dtypes import SAFETENSORS, torch_dtype

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    # A vision-language model's processor beside its tokenizer (AutoProcessor reads them).
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be converted; the message says what and where."""


def read_header(path: Path) -> dict[str, Any]:
    """The safetensors header of ``path``, after checking the file holds all declared data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise HFCheckpointError(f"{path.name} is truncated: {size} bytes, no header")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise HFCheckpointError(
                f"{path.name} is truncated: header declares {n} bytes, file has {size}"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise HFCheckpointError(f"{path.name} has a corrupt header: {e}") from None
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end > size:
        raise HFCheckpointError(
            f"{path.name} is truncated: tensors need {8 + n + end} bytes, file has {size}"
        )
    return header


class HFCheckpoint:
    """A Hugging Face model directory, opened for lazy, validated reading."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise HFCheckpointError(f"{str(self.path)!r} is not a directory")
        cfg = self.path / "config.json"
        if not cfg.exists():
            raise HFCheckpointError(f"{str(self.path)!r} has no config.json")
        self.config: dict = json.loads(cfg.read_text())
        gen = self.path / "generation_config.json"
        self.generation_config: dict | None = json.loads(gen.read_text()) if gen.exists() else None
        if (self.path / INDEX).exists():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE).exists():
            files = [SINGLE]
        else:
            raise HFCheckpointError(
                f"{str(self.path)!r} has no {SINGLE} or {INDEX} (only safetensors is supported)"
            )
        self.meta: dict[str, tuple[str, torch.dtype, tuple[int, ...]]] = {}
        for fname in files:
            fpath = self.path / fname
            if not fpath.exists():
                raise HFCheckpointError(f"{str(self.path)!r}: shard {fname} is missing")
            for name, v in read_header(fpath).items():
                if v["dtype"] not in SAFETENSORS:
                    raise HFCheckpointError(f"{fname}: tensor {name} has dtype {v['dtype']}")
                self.meta[name] = (fname, torch_dtype(SAFETENSORS[v["dtype"]]), tuple(v["shape"]))
        self._handles: dict[str, safe_open] = {}

    @property
    def dtype(self) -> torch.dtype:
        dtypes = {m[1] for m in self.meta.values()}
        return torch.float32 if len(dtypes) != 1 else dtypes.pop()

    def check(self, expected: dict[str, tuple[int, ...]], carried: str | None = None) -> None:
        """Every expected tensor present with its shape; nothing unexpected but rotary buffers
        and the tensors under ``carried`` (a vision tower's: the model built from the config
        checks their shapes as it loads them)."""
        for name, shape in expected.items():
            if name not in self.meta:
                raise HFCheckpointError(f"{str(self.path)!r}: tensor {name} is missing")
            if self.meta[name][2] != tuple(shape):
                raise HFCheckpointError(
                    f"{str(self.path)!r}: tensor {name} has shape {list(self.meta[name][2])}, "
                    f"config.json implies {list(shape)}"
                )
        extra = [n for n in self.meta if n not in expected and "rotary_emb" not in n
                 and not (carried and n.startswith(carried))]  # fmt: skip
        if extra:
            raise HFCheckpointError(
                f"{str(self.path)!r}: unexpected tensors for this architecture: {extra[:5]}"
            )

    def _handle(self, fname: str) -> safe_open:
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.path / fname), framework="pt")
        return self._handles[fname]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.meta[name][0]).get_tensor(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor, reading only those bytes."""
        return self._handle(self.meta[name][0]).get_slice(name)[start:stop]


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Split tensor names (in order) into consecutive shards of at most ``max_shard_bytes``."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _new_file_mode() -> int:
    """The mode ``open`` gives a new file here: 0o666 less this process's umask (read
    from /proc: ``os.umask`` can only be read by setting it, which races other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


def write_safetensors(
    out: Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    shards: list[list[str]],
    single: str = SINGLE,
) -> None:
    """Write ``tensors`` (arriving in plan order) into the planned shards plus the index
    (one shard: the file ``single``, no index)."""
    names = [n for s in shards for n in s]
    files = (
        [single]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    where = {n: files[i] for i, s in enumerate(shards) for n in s}
    pending: dict[str, torch.Tensor] = {}
    shard_idx, total = 0, 0
    for name, t in tensors:
        if name not in where:
            raise KeyError(f"tensor {name} is not in the shard plan")
        pending[name] = t
        total += t.numel() * t.element_size()
        while shard_idx < len(shards) and all(n in pending for n in shards[shard_idx]):
            save_file(
                {n: pending.pop(n) for n in shards[shard_idx]},
                str(out / files[shard_idx]),
                metadata={"format": "pt"},
            )
            # safetensors writes its file owner-only (0600); an export is read by others
            # (a server started as another user, a colleague), as config.json beside it is.
            os.chmod(out / files[shard_idx], _new_file_mode())
            shard_idx += 1
    if shard_idx != len(shards):
        missing = [n for s in shards[shard_idx:] for n in s if n not in pending]
        raise RuntimeError(f"tensors never produced: {missing[:5]}")
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: where[n] for n in names}}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


@contextlib.contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """A directory that appears whole or not at all: filled at ``<out>.tmp`` (yielded),
    then renamed over ``out``; removed if the filling fails."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
