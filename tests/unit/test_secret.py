"""The job's secret file: created once with mode 0600, shared, refused when others may read it."""

from __future__ import annotations

import os

import pytest

from rl.runtime import secret


@pytest.fixture(autouse=True)
def _no_inherited_secret(monkeypatch):
    monkeypatch.delenv(secret.ENV, raising=False)


def test_created_private_and_reused(tmp_path):
    path = secret.ensure(tmp_path / "run")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert os.environ[secret.ENV] == str(path)
    key = secret.load()
    assert len(key) == secret.KEY_BYTES
    assert secret.ensure(tmp_path / "run") == path and secret.load(path) == key
    assert [p.name for p in path.parent.iterdir()] == [secret.NAME]  # no temporary left


def test_env_file_wins(tmp_path, monkeypatch):
    first = secret.ensure(tmp_path / "a")
    assert secret.path_for(tmp_path / "b") == first
    monkeypatch.delenv(secret.ENV)
    assert secret.path_for(tmp_path / "b") == tmp_path / "b" / secret.NAME


def test_a_readable_or_malformed_secret_is_refused(tmp_path):
    path = secret.ensure(tmp_path)
    path.chmod(0o644)
    with pytest.raises(secret.SecretError, match="mode 644"):
        secret.load(path)
    path.write_text("not hex")
    path.chmod(0o600)
    with pytest.raises(secret.SecretError, match="hex key"):
        secret.load(path)
    with pytest.raises(secret.SecretError, match="no job secret"):
        secret.load(tmp_path / "missing")


def test_tags_and_derived_keys():
    key = bytes(range(32))
    tag = secret.sign(key, b"message")
    assert secret.verify(key, b"message", tag)
    assert not secret.verify(key, b"messagf", tag)
    assert not secret.verify(bytes(32), b"message", tag)
    a, b = secret.derive(key, "sglang-api"), secret.derive(key, "sglang-admin")
    assert a != b and len(a) == 64 and secret.derive(key, "sglang-api") == a
