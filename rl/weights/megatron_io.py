"""Move global (TP=1) tensors into and out of Megatron-Core's sharded layout.

Both directions go through Megatron's own ``sharded_state_dict`` metadata (key, global
shape, this rank's offset), so they agree with Megatron's checkpoints by construction:

* :func:`fill_model` writes each rank's local shards from a provider of global tensors
  (one layer's tensor at a time), e.g. from a Hugging Face checkpoint;
* :func:`read_layer` loads the global tensors of one layer from a ``torch_dist``
  checkpoint written at any TP/PP, without loading the rest of the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from rl.models import arch as a
from rl.weights import dcp_guard
from rl.weights import keymap as km
from rl.weights.keymap import LAYERS

if TYPE_CHECKING:  # Megatron is imported only after megatron_patches.apply_all
    from megatron.core.transformer.module import MegatronModule

# provider(key, layer, row_range) -> global tensor of ``key`` (for ``layer``), or only the
# rows [start, stop) of it when row_range is given (used for vocab-sized tensors).
Provider = Callable[[str, int | None, tuple[int, int] | None], torch.Tensor]
ROW_SLICED = ("embedding.word_embeddings.weight", "output_layer.weight")


def leaves(obj: object) -> Iterator[object]:  # a nested sharded state dict
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from leaves(v)
    elif isinstance(obj, ShardedTensorFactory):
        yield from leaves(obj.build())
    else:
        yield obj


def split_key(key: str, prepend: int, offset: tuple[int, ...]) -> tuple[str, int | None]:
    """Checkpoint key -> (keymap key, layer index or None).

    Per-layer tensors carry a leading layer axis; routed experts (SequentialMLP) a second,
    expert axis, under ``...mlp.experts.experts.<name>``, which the keymap names
    ``mlp.experts.{e}.<name>`` for global expert e."""
    if not key.startswith(LAYERS):
        return key, None
    rel = key[len(LAYERS) :]
    if prepend == 1:
        return rel, int(offset[0])
    if prepend == 2 and _EXPERTS in rel:
        return rel.replace(_EXPERTS, f".experts.{int(offset[1])}.", 1), int(offset[0])
    raise ValueError(f"{key}: expected a layer axis (and an expert axis), got {prepend}")


_EXPERTS = ".experts.experts."


def checkpoint_key(key: str, layer: int | None) -> tuple[str, int | None]:
    """Keymap key -> (full checkpoint key, expert index or None): the inverse of split_key."""
    if layer is None:
        return key, None
    e = a.expert_of(key)
    if e is None:
        return LAYERS + key, None
    return LAYERS + a.template(key).replace(".experts.{e}.", _EXPERTS, 1), e


def stored_keys(d: km.Dims) -> dict[str, tuple[int, ...]]:
    """Every model tensor a torch_dist checkpoint of ``d`` holds, with its stacked shape."""
    out = {k: km.megatron_shape(k, d) for k in km.global_keys(d)}
    for k in km.layer_keys(d):
        full, e = checkpoint_key(k, 0)
        experts = (d.experts,) if e is not None else ()
        out[full] = (d.layers, *experts, *km.megatron_shape(k, d))
    return out


@torch.no_grad()
def fill_model(
    model: MegatronModule, provider: Provider, on_layer: Callable[[int], None] | None = None
) -> int:
    """Copy every local shard of ``model`` from ``provider``; return the tensors written.

    Global tensors of per-layer keys are requested once per (key, layer) and dropped after
    use; vocab-sized tensors are requested as row ranges only.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    written, last_layer = 0, None
    cache: dict[tuple[str, int | None], torch.Tensor] = {}
    for st in leaves(model.sharded_state_dict()):
        if not isinstance(st, ShardedTensor):
            continue  # _extra_state objects: nothing to convert
        key, layer = split_key(st.key, st.prepend_axis_num, st.global_offset)
        if layer is not None and layer != last_layer:
            if on_layer is not None and last_layer is not None:
                on_layer(last_layer)
            cache.clear()
            last_layer = layer
        offs = st.global_offset[st.prepend_axis_num :]
        shape = st.data.shape
        if key in ROW_SLICED:
            src = provider(key, None, (offs[0], offs[0] + shape[0]))
            src = src[:, offs[1] : offs[1] + shape[1]]
        else:
            if (key, layer) not in cache:
                cache[(key, layer)] = provider(key, layer, None)
            full = cache[(key, layer)]
            src = full[tuple(slice(o, o + n) for o, n in zip(offs, shape, strict=True))]
        if tuple(src.shape) != tuple(shape):
            raise ValueError(f"{st.key}: provider gave {list(src.shape)}, shard is {list(shape)}")
        st.data.copy_(src)
        written += 1
    if on_layer is not None and last_layer is not None:
        on_layer(last_layer)
    return written


def checkpoint_tensors(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every model tensor in a torch_dist checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp_guard.apply()  # the index is unpickled: only checkpoint metadata, no code
    md = FileSystemReader(path).read_metadata()
    out = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata) and not key.startswith("optimizer"):
            out[key] = (tuple(m.size), m.properties.dtype)
    return out


def read_layer(
    path: str, keys: dict[str, tuple[tuple[int, ...], torch.dtype]], layer: int | None
) -> dict[str, torch.Tensor]:
    """Load the global tensors ``keys`` (full checkpoint keys) of one layer (None: globals).

    Why not Megatron's ``dist_checkpointing.load``: it only accepts requests that cover
    whole tensors across ranks, and stacked layer tensors would then be read for all layers
    at once. PyTorch DCP reads any chunk; a small planner asks for exactly this layer's.
    Runs in a single process, with no process group.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    chunks: dict[str, ChunkStorageMetadata] = {}
    bufs: dict[str, torch.Tensor] = {}
    for key, (shape, dtype) in keys.items():
        if layer is None:
            offsets, sizes = (0,) * len(shape), shape
        else:
            offsets, sizes = (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:])
        chunks[key] = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        bufs[key] = torch.empty(sizes, dtype=dtype)

    class _ChunkPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            assert self.metadata is not None  # set by set_up_planner before any plan
            for fqn in self.state_dict:
                md = self.metadata.state_dict_metadata[fqn]
                assert isinstance(md, TensorStorageMetadata), fqn
                items += create_read_items_for_chunk_list(fqn, md, [chunks[fqn]])
            return LoadPlan(items)

        def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
            return self.state_dict[index.fqn]  # read items carry chunk-relative offsets

    dcp_guard.apply()
    with warnings.catch_warnings():  # "assuming ... single process" is exactly the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load(bufs, storage_reader=FileSystemReader(path), planner=_ChunkPlanner(), no_dist=True)
    return {k: (v[0] if layer is not None else v) for k, v in bufs.items()}
