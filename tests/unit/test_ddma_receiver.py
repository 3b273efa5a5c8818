"""The DDMA receiver's status files (rl/ddma/sglang_receiver.py): written only inside the
directory fixed when the server starts, never where a request points elsewhere; and its
staging option checked when a weight update opens. In process, no server."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from rl.ddma import sglang_receiver as rx

EMPTY = torch.zeros(1, dtype=torch.uint8)


@pytest.fixture
def status_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A server started with $MSRL_DDMA_STATUS_DIR = tmp_path/status, and a fresh receiver."""
    root = tmp_path / "status"
    monkeypatch.setenv(rx.STATUS_DIR_ENV, str(root))
    rx.status_dir.cache_clear()
    monkeypatch.setattr(rx, "RECEIVER", rx.Receiver())
    monkeypatch.setattr(rx, "_tp_rank", lambda: 0)  # asking SGLang means importing it: ~9 s
    yield root
    rx.status_dir.cache_clear()


def _entry(**ctl: object) -> list[tuple[str, torch.Tensor]]:
    return [(json.dumps(ctl), EMPTY)]


def test_status_written_inside_the_directory(status_root: Path) -> None:
    assert rx.status_dir() == Path(os.path.realpath(status_root))
    assert status_root.stat().st_mode & 0o777 == 0o700
    rx.load(torch.nn.Module(), _entry(op="state", status=str(status_root / "a.rank{rank}.json")))
    got = json.loads((status_root / "a.rank0.json").read_text())
    assert got["ok"] and got["staging"] == "device" and got["torn"] is False
    assert (status_root / "a.rank0.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "where",
    [
        "{tmp}/evil.json",  # another directory
        "{root}/../evil.json",  # out by ..
        "{root}/sub/evil.json",  # a subdirectory (not the server's)
        "evil.json",  # relative to the server's working directory
        "{root}/.hidden",
    ],
)
def test_status_outside_the_directory_is_refused(
    status_root: Path, tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing is written, the refusal is logged with the directory, and the version being
    staged fails: a request that may not report cannot be trusted to complete one."""
    (status_root / "sub").mkdir(parents=True)
    path = where.format(tmp=tmp_path, root=status_root)
    rx.RECEIVER.stage = rx.Stage(version=3, digest=0, staging="device")
    before = set(tmp_path.rglob("*"))
    with caplog.at_level(logging.ERROR, logger=rx.__name__):
        rx.load(torch.nn.Module(), _entry(op="noop", status=path))
    assert set(tmp_path.rglob("*")) == before
    assert "is outside the server's status directory" in caplog.text
    assert rx.STATUS_DIR_ENV in caplog.text
    assert rx.RECEIVER.stage.error is not None and "refused" in rx.RECEIVER.stage.error


def test_symlinked_directory_does_not_lead_out(status_root: Path, tmp_path: Path) -> None:
    status_root.mkdir(parents=True, exist_ok=True)
    (status_root / "link").symlink_to(tmp_path)
    with pytest.raises(rx.StatusPathError, match="outside"):
        rx.status_path(str(status_root / "link" / "evil.json"), 0)
    with pytest.raises(rx.StatusPathError, match="outside"):
        rx.status_path(str(tmp_path / "{rank}.json"), 1)
    assert (
        rx.status_path(str(status_root / "x.rank{rank}.json"), 1)
        == rx.status_dir() / "x.rank1.json"
    )


def test_a_malformed_status_never_escapes_load(status_root: Path) -> None:
    """str.format would raise on these; SGLang's scheduler would die of it."""
    for bad in ("{0}", "{rank.__class__}", "{", 7):
        rx.load(torch.nn.Module(), _entry(op="noop", status=bad))


def test_staging_option_is_checked_when_an_update_opens(status_root: Path) -> None:
    out = str(status_root / "s.json")
    rx.load(torch.nn.Module(), _entry(op="discard", staging="gpu", status=out))
    got = json.loads(Path(out).read_text())
    assert not got["ok"] and "staging 'gpu' is not one of" in got["error"]
    rx.load(torch.nn.Module(), _entry(op="discard", staging="none", status=out))
    got = json.loads(Path(out).read_text())
    assert got["ok"] and got["staging"] == "none" and got["staging_bytes"] == 0
