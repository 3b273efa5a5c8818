"""The DDMA receiver's status files (rl/ddma/sglang_receiver.py): written only inside the
directory fixed when the server starts, never where a request points elsewhere, and that
directory this user's alone (not a symlink, not another user's, mode 0700); and its
staging option checked when a weight update opens. In process, no server."""

from __future__ import annotations

import json
import logging
import os
import tempfile
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


# ------------------------------------------------------- the directory itself
@pytest.fixture
def default_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """No $MSRL_DDMA_STATUS_DIR: the per-user default, under a temp dir of this test's."""
    monkeypatch.delenv(rx.STATUS_DIR_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rx.status_dir.cache_clear()
    yield tmp_path / f"ddma-{os.getuid()}"
    rx.status_dir.cache_clear()


def _refusal() -> str:
    with pytest.raises(rx.StatusDirError) as e:
        rx.status_dir()
    assert "\n" not in str(e.value) and rx.STATUS_DIR_ENV in str(e.value)
    return str(e.value)


def test_the_default_directory_is_created_owner_only(default_root: Path) -> None:
    assert rx.status_dir() == default_root
    assert default_root.stat().st_mode & 0o777 == 0o700


def test_an_existing_directory_of_ours_open_to_others_is_closed(default_root: Path) -> None:
    default_root.mkdir()
    default_root.chmod(0o777)
    assert rx.status_dir() == default_root
    assert default_root.stat().st_mode & 0o777 == 0o700


def test_a_symlink_in_its_place_is_refused(default_root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    default_root.symlink_to(elsewhere)
    assert _refusal() == (
        f"DDMA status directory {default_root} is a symlink: refused (remove it, or set "
        f"{rx.STATUS_DIR_ENV} to a directory of your own)"
    )


def test_another_users_directory_is_refused(
    default_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user created /tmp/ddma-<our uid> first, 0777 (here: we pretend to be uid
    ``them + 1``, since a test cannot chown)."""
    them = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: them + 1)
    squatted = tmp_path / f"ddma-{them + 1}"
    squatted.mkdir()
    squatted.chmod(0o777)
    assert _refusal().startswith(
        f"DDMA status directory {squatted} belongs to uid {them}, not to this user ({them + 1})"
    )
    assert squatted.stat().st_mode & 0o777 == 0o777  # not touched


def test_a_file_or_a_symlinked_env_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rx.status_dir.cache_clear()
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv(rx.STATUS_DIR_ENV, str(tmp_path / "afile"))
    assert "afile is not a directory: refused" in _refusal()
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv(rx.STATUS_DIR_ENV, str(tmp_path / "link"))
    assert "link is a symlink: refused" in _refusal()
    # A symlink among its parents is the site's layout, not a swap: followed.
    monkeypatch.setenv(rx.STATUS_DIR_ENV, str(tmp_path / "link" / "status"))
    assert rx.status_dir() == tmp_path / "real" / "status"
    rx.status_dir.cache_clear()
