"""wandb beside TensorBoard: MetricsLogger logs the same metrics at the same steps, read
back from the offline run's .wandb file with no network; a bad ``logging.wandb_mode`` is
refused at composition, in one line."""

from __future__ import annotations

import json
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rl.config import ConfigError
from rl.metrics import WANDB_ID, MetricsLogger, WandbRun, read_jsonl

# The .wandb file: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB-log
# records in 32 KiB blocks, each record a protobuf Record. wandb 0.30 ships no Python
# reader (its datastore module went with the Python backend), so the test has its own.
_HEADER, _BLOCK = b":W&B\xe1\xbe\x00", 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[: len(_HEADER)] == _HEADER, data[:7]
    pos, parts = len(_HEADER), b""
    while len(data) - pos >= 7:
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind == 0:  # zeros: the end of what was written
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad record at {pos}"
        parts += chunk
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(parts)
            yield rec
            parts = b""


def _offline_runs(out: Path) -> list[Path]:
    return sorted((out / "wandb").glob("offline-run-*"))


def _history(run_dir: Path) -> dict[tuple[str, int], dict[str, float]]:
    """{(phase, step): {name: value}} of the run's rows, as the JSONL keeps them."""
    (path,) = run_dir.glob("run-*.wandb")
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for rec in _records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
        metrics = {k: v for k, v in row.items() if not k.startswith("_") and k != "step"}
        (phase,) = {k.split("/", 1)[0] for k in metrics}  # one phase per MetricsLogger.log
        got = rows.setdefault((phase, row["step"]), {})
        assert not got.keys() & metrics.keys(), f"{phase} step {row['step']} logged twice"
        got.update({k.split("/", 1)[1]: v for k, v in metrics.items()})
    return rows


def _jsonl(out: Path) -> dict[tuple[str, int], dict[str, float]]:
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for r in read_jsonl(out / "metrics.jsonl"):
        m = {k: v for k, v in r.items() if k not in ("phase", "step", "time")}
        rows.setdefault((r["phase"], r["step"]), {}).update(m)
    return rows


def _run_record(run_dir: Path) -> Any:
    (path,) = run_dir.glob("run-*.wandb")
    return next(r.run for r in _records(path) if r.WhichOneof("record_type") == "run")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Offline and quiet, with no way out: wandb-core's server address is a closed local
    port, and this process may open only Unix sockets (its link to wandb-core)."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_ERROR_REPORTING": "false",  # no crash reports (Sentry) either
        "WANDB_DISABLE_GIT": "true",
        "WANDB__DISABLE_STATS": "true",  # no system-metrics sampler: seconds saved
        "WANDB__DISABLE_MACHINE_INFO": "true",
    }.items():
        monkeypatch.setenv(name, value)
    # The logger points WANDB_CACHE_DIR and WANDB_DATA_DIR into the run dir unless set;
    # set here, so that no later test inherits this one's tmp_path.
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb" / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb" / "data"))
    connect, tried = socket.socket.connect, []

    def local_only(self: socket.socket, address: object) -> None:
        if self.family != socket.AF_UNIX:
            tried.append(address)  # kept: a raise in one of wandb's threads may be lost
            raise OSError(f"no network in this test: {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    yield
    assert not tried, f"wandb tried the network: {tried}"
    for log in (tmp_path / "wandb").glob("offline-run-*/logs/debug-internal.log"):
        assert "127.0.0.1:9" not in log.read_text(), f"wandb-core tried the network: {log}"


def _attempt(out: Path, run: WandbRun, rl: range, resume_step: int | None = None) -> None:
    log = MetricsLogger(out, totals={"warmup": 4, "rl": 6}, resume_step=resume_step,
                        wandb_run=run)  # fmt: skip
    if resume_step is None:
        for s in range(1, 5):
            log.log(s, {"loss": 1.0 / s, "lr": 1e-3 * s}, phase="warmup", echo=False)
            if s % 2 == 0:
                log.log(s, {"eval_accuracy": s / 8}, phase="warmup_eval", echo=False)
    for s in rl:
        log.log(s, {"reward_mean": s / 10, "train_s": 0.5}, phase="rl", echo=False)
        if s % 3 == 0:
            log.log(s, {"eval_accuracy": s / 6}, phase="rl_eval", echo=False)
    log.close()


@pytest.mark.usefixtures("no_network")
def test_wandb_gets_the_jsonl_metrics_at_the_same_steps(tmp_path: Path) -> None:
    run = WandbRun(project="p", name="tiny", config={"rl": {"steps": 6}})
    _attempt(tmp_path, run, range(1, 5))  # killed after RL step 4, its checkpoint at 2
    (first,) = _offline_runs(tmp_path)
    assert _history(first) == _jsonl(tmp_path)  # same keys, values, phases and steps
    assert ("rl", 4) in _history(first) and ("warmup", 4) in _history(first)
    rec = _run_record(first)
    run_id = (tmp_path / WANDB_ID).read_text().strip()
    assert (rec.run_id, rec.display_name, rec.project) == (run_id, "tiny", "p")
    config = {u.key: json.loads(u.value_json) for u in rec.config.update}
    assert config["rl"] == {"steps": 6}

    # The requeued job resumes after step 2 in the same dir: the JSONL drops steps 3-4 of
    # the lost attempt; wandb keeps them (it cannot delete) and continues the same run id.
    # wandb names an offline run's dir by its start second: a real requeue starts later.
    t0 = int(time.time())
    while int(time.time()) == t0:
        time.sleep(0.02)
    _attempt(tmp_path, run, range(3, 7), resume_step=2)
    runs = _offline_runs(tmp_path)
    assert len(runs) == 2 and all(p.name.endswith(f"-{run_id}") for p in runs)
    second = next(p for p in runs if p != first)
    jsonl = _jsonl(tmp_path)
    assert [s for (ph, s) in jsonl if ph == "rl"] == [1, 2, 3, 4, 5, 6]
    assert _history(second) == {k: v for k, v in jsonl.items() if k[0].startswith("rl")
                                and k[1] > 2}  # fmt: skip
    assert _run_record(second).run_id == run_id


def test_the_wandb_run_of_a_config(tmp_path: Path) -> None:
    """``logging.wandb`` off: none; on: the run's name and the resolved config."""
    from tests.helpers.configs import composed

    assert WandbRun.from_config(composed([])) is None
    on = ["logging.wandb=true", "logging.wandb_mode=online", "logging.wandb_entity=me",
          f"run.output_dir={tmp_path}/${{run.name}}"]  # fmt: skip
    run = WandbRun.from_config(composed(on))
    assert run is not None
    assert (run.project, run.mode, run.entity) == ("megatron-sglang-rl", "online", "me")
    assert run.name == run.config["run"]["name"] == "tiny_arithmetic"
    assert run.config["run"]["output_dir"] == f"{tmp_path}/tiny_arithmetic"  # resolved
    assert run.config["logging"]["wandb_mode"] == "online"  # a str, not the enum
    json.dumps(run.config)  # wandb stores it as JSON


def test_a_bad_wandb_mode_is_refused_in_one_line() -> None:
    from rl.checks import compose_resolved

    with pytest.raises(ConfigError) as info:
        compose_resolved(["logging.wandb_mode=ofline"])
    msg = str(info.value)
    assert "\n" not in msg
    assert "logging.wandb_mode" in msg and "ofline" in msg, msg
