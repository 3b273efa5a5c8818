"""The checkpoint index's unpickler (rl/config/dcp_metadata.py) and torch DCP's reader with
it in place (rl/weights/dcp_guard.py): a ``.metadata`` that names anything but checkpoint
metadata is refused in one line naming the file and the name, and nothing it names runs.
The pure part needs no torch; the reader's, only ``dcp.save`` in process.
tests/multiproc/test_checkpoint.py does the same on a checkpoint the trainer wrote."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from rl.config import dcp_metadata as dm

ROOT = Path(__file__).resolve().parents[2]


def exec_prefix(marker: Path, proto: int = 4) -> bytes:
    """The opcodes of ``exec(<create marker>)`` with its result popped: put in front of a
    valid index (less its 2-byte PROTO), the whole still loads as that index."""
    code = f"open({str(marker)!r}, 'w').close()".encode()
    arg = b"X" + len(code).to_bytes(4, "little") + code  # BINUNICODE, not memoized
    return bytes([0x80, proto]) + b"cbuiltins\nexec\n" + arg + b"\x85R0"  # TUPLE1 REDUCE POP


def _refused(data: bytes, where: str = "ckpt/.metadata") -> str:
    with pytest.raises(dm.RefusedPickle) as e:
        dm.load(io.BytesIO(data), where)
    assert "\n" not in str(e.value)
    return str(e.value)


class _Call:
    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return (self.fn, self.args)


def test_an_exec_prefix_is_refused_before_it_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = exec_prefix(marker, proto=2) + pickle.dumps({"storage_data": {}}, protocol=2)[2:]
    assert _refused(data) == (
        "ckpt/.metadata: refused: it would load builtins.exec, not checkpoint metadata"
    )
    assert not marker.exists()
    assert pickle.loads(data) == {"storage_data": {}} and marker.exists()  # what it did unguarded


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (_Call(os.system, "true"), "posix.system"),
        (_Call(eval, "1"), "builtins.eval"),
        (_Call(getattr, int, "mro"), "builtins.getattr"),
        (_Call(subprocess.call, ["true"]), "subprocess.call"),
    ],
)
def test_any_callable_outside_the_index_types_is_refused(call: _Call, name: str) -> None:
    for proto in (0, 2, 4):  # GLOBAL/INST (0), GLOBAL (2), STACK_GLOBAL (4)
        data = pickle.dumps(call, protocol=proto, fix_imports=False)
        assert f"it would load {name}," in _refused(data)


def test_torch_names_other_than_dtypes_and_size_are_refused() -> None:
    assert dm.allowed("torch", "float32") and dm.allowed("torch", "bfloat16")
    assert dm.allowed("torch", "Size") and dm.allowed("torch", "int64")
    for name in ("load", "save", "from_numpy", "_C", "ops"):
        assert not dm.allowed("torch", name)
    assert not dm.allowed("torch.distributed.checkpoint.filesystem", "FileSystemReader")
    assert not dm.allowed("torch.distributed.checkpoint.metadata", "__builtins__")
    assert not dm.allowed("collections", "namedtuple")


def test_persistent_ids_are_refused() -> None:
    class _WithPid(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return "storage" if obj == "x" else None

    buf = io.BytesIO()
    _WithPid(buf, protocol=2).dump(["x"])
    assert "a persistent object" in _refused(buf.getvalue())


def test_plain_data_loads_and_the_module_imports_no_torch() -> None:
    data = pickle.dumps({"a": [1, (2.0, "b")], "c": {3: None}}, protocol=4)
    assert dm.load(io.BytesIO(data), "x") == {"a": [1, (2.0, "b")], "c": {3: None}}
    code = "import sys, rl.config.ckpt_check, rl.config.dcp_metadata; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# ---------------------------------------------------------------- torch DCP's own reader
def test_torch_dcp_reader_loads_real_metadata_and_refuses_code(tmp_path: Path) -> None:
    """What ``dcp.save`` writes (tensors of several dtypes, a non-tensor object: every class
    of the index) loads through the guarded reader; prefixed with code, it is refused."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from rl.weights import dcp_guard

    ckpt = tmp_path / "ckpt"
    state = {"w": torch.ones(4, 3), "b": torch.zeros(2, dtype=torch.bfloat16),
             "i": torch.arange(3), "extra": {"step": 3}}  # fmt: skip
    with warnings.catch_warnings():  # "assuming ... a single process": as intended
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    dcp_guard.apply()
    assert dcp_guard.applied() and not dcp_guard.apply()  # idempotent
    md = FileSystemReader(str(ckpt)).read_metadata()
    assert isinstance(md, Metadata) and md.storage_meta is not None
    assert md.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    assert isinstance(md.state_dict_metadata["extra.step"], BytesStorageMetadata)
    back = {"w": torch.empty(4, 3), "b": torch.empty(2, dtype=torch.bfloat16),
            "i": torch.empty(3, dtype=torch.int64), "extra": {"step": 0}}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=str(ckpt), no_dist=True)
    assert back["w"].eq(1).all() and back["extra"]["step"] == 3

    marker = tmp_path / "pwned"
    index = ckpt / ".metadata"
    index.write_bytes(exec_prefix(marker) + index.read_bytes()[2:])
    with pytest.raises(dm.RefusedPickle) as e:
        FileSystemReader(str(ckpt)).read_metadata()
    assert str(e.value) == (
        f"{index}: refused: it would load builtins.exec, not checkpoint metadata"
    )
    assert not marker.exists()
    assert isinstance(pickle.loads(index.read_bytes()), Metadata)  # what torch's reader did:
    assert marker.exists()  # a whole index back, and the payload run
    index.write_bytes(pickle.dumps({"not": "an index"}))
    with pytest.raises(dm.RefusedPickle, match="it would load a dict, not checkpoint metadata"):
        FileSystemReader(str(ckpt)).read_metadata()


class _Touch:
    """Unpickled, it creates the file at ``path`` (an ``exec`` payload, as a class)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({str(self.path)!r}, 'w').close()",))


def test_a_non_tensor_item_that_would_run_code_is_refused_naming_it(tmp_path: Path) -> None:
    """DCP reads an item its index calls bytes with ``torch.load(weights_only=False)``;
    guarded, with ``weights_only=True``: the step and a config dict still load, a pickled
    ``exec`` in the data file is refused in one line naming the item, and never runs."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rl.weights import dcp_guard

    marker = tmp_path / "pwned"
    good, evil = tmp_path / "good", tmp_path / "evil"
    with warnings.catch_warnings():  # "assuming ... a single process": as intended
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "extra": {"step": 3, "lr": [1e-3]}},
                 checkpoint_id=str(good), no_dist=True)  # fmt: skip
        dcp.save({"w": torch.ones(2), "extra": _Touch(marker)}, checkpoint_id=str(evil),
                 no_dist=True)  # fmt: skip
    dcp_guard.apply()
    back = {"w": torch.empty(2), "extra": {"step": 0, "lr": [0.0]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=str(good), no_dist=True)
        assert back["extra"] == {"step": 3, "lr": [1e-3]}
        with pytest.raises(BaseException) as e:  # DCP's CheckpointException is one
            dcp.load({"w": torch.empty(2), "extra": None}, checkpoint_id=str(evil), no_dist=True)
    assert not marker.exists()
    from rl.weights.dist_ckpt import first_failure  # how the trainer's load reports it

    refused = first_failure(e.value)
    assert isinstance(refused, dm.RefusedPickle)
    assert str(refused) == "checkpoint item 'extra': refused: it would load exec, not plain data"
