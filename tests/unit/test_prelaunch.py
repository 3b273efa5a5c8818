"""Pre-launch file checks (rl/config/prelaunch.py, rl/config/ckpt_check.py) and the
context checks of rl/tasks/checks.py: each bad input is one ConfigError naming field and value.

The checkpoints here are built by hand in the torch_dist layout (a pickled index whose
classes only have to carry the same fields and names, a zip holding ``data.pkl``), so no
torch is needed; tests/multiproc/test_prelaunch_cli.py runs the checks on checkpoints
torch wrote.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rl.config import ConfigError, ckpt_check, lora_base
from rl.config.prelaunch import (
    check_checkpoint,
    check_hf_dir,
    check_output_dir,
    prelaunch,
)
from rl.tasks.checks import check_context
from tests.helpers.configs import composed
from tests.unit.test_dcp_metadata import exec_prefix


def tiny() -> dict:
    """The embedded default's model config as plain data, as a checkpoint stores it."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(composed().model)  # type: ignore[return-value]


# Stand-ins with the fields of torch.distributed.checkpoint's classes: the reader never
# imports the pickled classes, it keeps their state, so these make a valid index.
@dataclass(frozen=True)
class MetadataIndex:
    fqn: str


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int


@dataclass
class Metadata:
    storage_data: dict = field(default_factory=dict)


_DCP = "torch.distributed.checkpoint."
# The names torch pickles its classes under: the index may name only those.
TORCH_NAMES = {MetadataIndex: _DCP + "metadata\nMetadataIndex",
               _StorageInfo: _DCP + "filesystem\n_StorageInfo",
               Metadata: _DCP + "metadata\nMetadata"}  # fmt: skip


class _AsTorch(pickle._Pickler):  # type: ignore[name-defined]  # the pure-Python pickler
    """Writes the stand-ins under torch's names (the C pickler checks that a class is
    importable by the name it writes)."""

    def save_global(self, obj: object, name: str | None = None) -> None:
        if obj in TORCH_NAMES:
            self.write(pickle.GLOBAL + TORCH_NAMES[obj].encode() + b"\n")
            self.memoize(obj)
        else:
            super().save_global(obj, name)


def index_bytes(md: Metadata) -> bytes:
    """``md`` pickled as torch pickles its ``Metadata`` (protocol 2: no frames)."""
    buf = io.BytesIO()
    _AsTorch(buf, protocol=2).dump(md)
    return buf.getvalue()


def make_checkpoint(
    path: Path, shards: dict[str, int], model: dict | None = None, **common_fields: object
) -> Path:
    """A torch_dist directory whose shards hold ``shards`` bytes each, in two chunks."""
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    storage = {}
    for name, size in shards.items():
        half = size // 2
        storage[MetadataIndex(f"{name}/a")] = _StorageInfo(name, 0, half)
        storage[MetadataIndex(f"{name}/b")] = _StorageInfo(name, half, size - half)
        (path / name).write_bytes(b"\0" * size)
    (path / ".metadata").write_bytes(index_bytes(Metadata(storage)))
    common = {"format_version": 1, "model_config": model or tiny(), **common_fields}
    with zipfile.ZipFile(path / "common.pt", "w") as z:
        z.writestr("common/data.pkl", pickle.dumps(common))
    return path


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "ckpt", {"__0_0.distcp": 100, "__1_0.distcp": 60})


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------- checkpoints
def test_a_complete_checkpoint_passes(ckpt: Path) -> None:
    assert ckpt_check.problem(ckpt) is None
    assert ckpt_check.expected_shard_sizes(ckpt) == {"__0_0.distcp": 100, "__1_0.distcp": 60}
    check_checkpoint(str(ckpt), "trainer.load_dir", {**tiny(), "name": "other"})


def test_a_truncated_shard_is_named_with_its_sizes(ckpt: Path) -> None:
    with open(ckpt / "__1_0.distcp", "r+b") as f:
        f.truncate(7)
    msg = _message(check_checkpoint, str(ckpt), "trainer.load_dir")
    assert msg == (
        f"trainer.load_dir={str(ckpt)!r} shard {str(ckpt / '__1_0.distcp')!r} is truncated: "
        "7 of 60 bytes"
    )


def test_a_missing_shard_is_named(ckpt: Path) -> None:
    (ckpt / "__0_0.distcp").unlink()
    msg = _message(check_checkpoint, str(ckpt), "trainer.load_dir")
    assert "__0_0.distcp' is missing (.metadata lists it)" in msg


@pytest.mark.parametrize(
    ("damage", "fragment"),
    [
        (lambda p: (p / "metadata.json").unlink(), "has no metadata.json"),
        (lambda p: (p / "metadata.json").write_text("{"), "metadata.json is unreadable"),
        (lambda p: (p / ".metadata").unlink(), "has no .metadata"),
        (lambda p: (p / ".metadata").write_bytes(b"\x80\x04\x95"), ".metadata is unreadable"),
        (lambda p: (p / "common.pt").unlink(), "has no common.pt"),
        (lambda p: (p / "common.pt").write_bytes(b"PK\x03\x04"), "common.pt is unreadable"),
        (
            lambda p: (p / "metadata.json").write_text('{"sharded_backend": "zarr"}'),
            "is a 'zarr' checkpoint",
        ),
    ],
)
def test_damaged_metadata_is_one_line(ckpt: Path, damage, fragment: str) -> None:
    damage(ckpt)
    msg = _message(check_checkpoint, str(ckpt), "trainer.load_dir")
    assert msg.startswith(f"trainer.load_dir={str(ckpt)!r} ") and fragment in msg


def test_missing_and_misplaced_checkpoints(tmp_path: Path, ckpt: Path) -> None:
    missing = str(tmp_path / "nothing")
    assert _message(check_checkpoint, missing, "trainer.load_dir") == (
        f"trainer.load_dir={missing!r} does not exist"
    )
    # The run directory instead of one of its checkpoints.
    msg = _message(check_checkpoint, str(tmp_path), "trainer.load_dir")
    assert "holds no checkpoint itself" in msg and "subdirectories are checkpoints: ckpt" in msg
    # A Megatron-LM training run's root, with its tracker file.
    root = tmp_path / "mlm"
    root.mkdir()
    (root / ckpt_check.TRACKER).write_text("1200\n")
    msg = _message(check_checkpoint, str(root), "trainer.load_dir")
    assert "latest_checkpointed_iteration.txt says '1200'" in msg
    assert repr(str(root / "iter_0001200")) in msg


def test_a_checkpoint_of_another_model_is_refused(ckpt: Path) -> None:
    msg = _message(check_checkpoint, str(ckpt), "trainer.load_dir", {**tiny(), "hidden_size": 64})
    assert msg.endswith("is for a different model: hidden_size: checkpoint 192 vs config 64")


def test_a_lora_checkpoint_names_its_base_by_content(tmp_path: Path, ckpt: Path) -> None:
    """Adapters only: the base is found (next to it as saved, or where it was) and must
    hash as it did; a missing or changed base is one line before any rank starts."""
    ref = lora_base.reference(ckpt, tmp_path / "rl" / "adapters")
    assert ref["relpath"] == "../ckpt" and len(ref["digest"]) == 32
    adapters = make_checkpoint(tmp_path / "rl" / "adapters", {"__0_0.distcp": 8},
                               lora={"rank": 4, "scale": 2.0, "base": ref})  # fmt: skip
    check_checkpoint(str(adapters), "trainer.load_dir", tiny())
    # Moved together (a run directory with its conversion cache): found by relpath.
    moved = tmp_path / "moved"
    moved.mkdir()
    (tmp_path / "rl").rename(moved / "rl")
    ckpt.rename(moved / "ckpt")
    assert lora_base.resolve(ref, moved / "rl" / "adapters") == str(moved / "ckpt")
    check_checkpoint(str(moved / "rl" / "adapters"), "trainer.load_dir", tiny())
    with open(moved / "ckpt" / "__1_0.distcp", "r+b") as f:  # same size, other bytes
        f.write(b"\1")
    msg = _message(check_checkpoint, str(moved / "rl" / "adapters"), "trainer.load_dir", tiny())
    assert msg.startswith("trainer.load_dir: checkpoint ") and "has changed since" in msg
    shutil.rmtree(moved / "ckpt")
    msg = _message(check_checkpoint, str(moved / "rl" / "adapters"), "trainer.load_dir", tiny())
    assert f"its base {str(ckpt)!r} is missing (digest {ref['digest']})" in msg


def test_the_index_is_read_without_running_its_code(tmp_path: Path) -> None:
    """A pickle that names os.system is refused by name, never called."""
    path = make_checkpoint(tmp_path / "c", {"__0_0.distcp": 10})

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    assert ckpt_check.problem(path) == (
        f"cannot be loaded: {path / '.metadata'}: refused: it would load posix.system, "
        "not checkpoint metadata"
    )
    assert not (tmp_path / "pwned").exists()


def test_an_index_prefixed_with_code_is_refused_in_one_line(tmp_path: Path) -> None:
    """``exec(payload)``, its result popped, then a complete, valid index. The
    stand-ins ran nothing, but the check passed it and every trainer rank then ran it."""
    path = make_checkpoint(tmp_path / "c", {"__0_0.distcp": 10})
    marker = tmp_path / "pwned"
    index = path / ".metadata"
    index.write_bytes(exec_prefix(marker, proto=2) + index.read_bytes()[2:])
    msg = _message(check_checkpoint, str(path), "trainer.load_dir")
    assert msg == (
        f"trainer.load_dir={str(path)!r} cannot be loaded: {path / '.metadata'}: refused: "
        "it would load builtins.exec, not checkpoint metadata"
    )
    assert not marker.exists()


# ------------------------------------------------------------------- output and models
def test_output_dir_checks(tmp_path: Path) -> None:
    check_output_dir(str(tmp_path / "new" / "run"))
    assert not (tmp_path / "new").exists()  # checked, not created
    assert list(tmp_path.iterdir()) == []  # nor its probe left
    # Root may write anywhere by its permission bits, yet /proc refuses a new directory.
    assert _message(check_output_dir, "/proc/msrl_out") == (
        "run.output_dir='/proc/msrl_out' cannot be written: no directory can be made in /proc "
        "(No such file or directory)"
    )
    afile = tmp_path / "afile"
    afile.write_text("")
    assert _message(check_output_dir, str(afile)) == (
        f"run.output_dir={str(afile)!r} is a file, not a directory"
    )
    assert _message(check_output_dir, str(afile / "run")) == (
        f"run.output_dir={str(afile / 'run')!r} cannot be written: Not a directory ({afile} "
        "is a file)"
    )


def test_the_hydra_callback_exits_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    from rl.checks import PrelaunchCheck
    from rl.compose import compose

    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = compose([f"run.output_dir={afile / 'run'}"])
    with pytest.raises(SystemExit) as e:
        PrelaunchCheck().on_run_start(config=cfg)
    assert str(e.value.code).startswith("config error: run.output_dir=")
    bad = compose([f"run.output_dir={tmp_path / 'run'}", "trainer.tp=3"])
    with pytest.raises(SystemExit) as e:
        PrelaunchCheck().on_run_start(config=bad)
    assert str(e.value.code).startswith("config error: trainer.tp=3")
    PrelaunchCheck().on_run_start(config=compose([f"run.output_dir={tmp_path / 'run'}"]))
    assert list(tmp_path.iterdir()) == [afile]  # nothing written, even when it passes


def test_model_dir_checks(tmp_path: Path) -> None:
    d = tmp_path / "m"
    assert _message(check_hf_dir, str(d), "rollout.model_path").endswith("does not exist")
    d.mkdir()
    assert _message(check_hf_dir, str(d), "rollout.model_path").endswith("has no config.json")
    (d / "config.json").write_text("{oops")
    assert "config.json is unreadable" in _message(check_hf_dir, str(d), "rollout.model_path")
    (d / "config.json").write_text('{"max_position_embeddings": 32}')
    assert "has no weights" in _message(check_hf_dir, str(d), "rollout.model_path")
    (d / "model.safetensors").write_bytes(b"")
    assert check_hf_dir(str(d), "rollout.model_path") == {"max_position_embeddings": 32}


def test_prelaunch_on_a_whole_config(tmp_path: Path) -> None:
    out = f"run.output_dir={tmp_path / 'run'}"
    prelaunch(composed([out]))
    m = tmp_path / "m"
    m.mkdir()
    (m / "model.safetensors").write_bytes(b"")
    (m / "config.json").write_text('{"max_position_embeddings": 32}')
    # The tiny model's context is 64 positions; this directory serves 32.
    msg = _message(prelaunch, composed([out, f"rollout.model_path={m}"]))
    assert msg.startswith(f"rollout.model_path={str(m)!r} has max_position_embeddings=32")
    prelaunch(composed([out, f"rollout.model_path={m}", "rollout.context_length=32"]))
    good = make_checkpoint(tmp_path / "good", {"__0_0.distcp": 8})
    prelaunch(composed([out, f"trainer.load_dir={good}"]))
    msg = _message(prelaunch, composed([out, f"trainer.load_dir={good}", "model.num_layers=2"]))
    assert msg == (
        f"trainer.load_dir={str(good)!r} is for a different model: num_layers: checkpoint 4 "
        "vs config 2"
    )


# ---------------------------------------------------------------------------- context
def test_context_length_beyond_the_model_is_refused() -> None:
    msg = _message(check_context, composed(["rollout.context_length=65"]), 7)
    assert msg.startswith("rollout.context_length=65 exceeds model.max_position_embeddings=64")
    check_context(composed(["rollout.context_length=64"]), 7)


def test_rollouts_must_fit_context_and_kv_cache() -> None:
    cfg = composed(["rollout.sampling.max_new_tokens=57"])
    check_context(cfg, 7)  # 7 + 57 = 64 positions
    assert _message(check_context, cfg, 8).startswith(
        "rollout.sampling.max_new_tokens=57 + the longest prompt (8 tokens) exceeds the "
        "context of 64 tokens"
    )
    cfg = composed(["rollout.max_total_tokens=10"])
    assert _message(check_context, cfg, 7).startswith(
        "rollout.max_total_tokens=10 (a server's KV cache) cannot hold one rollout"
    )
