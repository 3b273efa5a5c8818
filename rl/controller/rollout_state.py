"""The rollout stream's state, saved with every RL checkpoint so a resumed job loses nothing.

What a checkpoint at step s does not hold is everything the generator made that the
trainer has not used yet: scored groups waiting in the queue, groups being scored, and
groups still generating (finished samples, parked partial rollouts, samples on a server
right now). Without it a resumed job would throw that work away and, worse, draw a fresh
prompt order. :meth:`RolloutStream.snapshot` takes all of it under the stream's lock
together with the prompt stream's position (every prompt drawn is either trained on by
step s or in the snapshot), :func:`save` writes it as JSON next to the resume point, and
a resumed job restores it (:meth:`RolloutStream.restore`) and draws on from the position.

A sample on a server at save time is kept with the tokens it had when its segment was
sent; the segment running then is sampled again. Tokens keep their behaviour log-prob and
version; the segments sampled after the resume get the resumed job's versions.

The file (``rollout_state/step-<s>.json`` in the run dir) is written to a temporary name
and renamed, then the resume point is pointed at it, then older states are deleted: a kill
at any moment leaves a resume point naming a complete state file. Format
``rl.rollout_state`` version 1 (see :func:`to_json`); no pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl.config.sampling import SamplingParams
from rl.controller.rollouts import Group, StreamState
from rl.generator import routing
from rl.generator.types import Rollout
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreResult

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rl.checkpoints.resume import ResumePoint

FORMAT, VERSION = "rl.rollout_state", 1
DIR = "rollout_state"
TRAINED = "trained_prompts.jsonl"  # per RL step: the prompts trained on (and resumed samples)


class RolloutStateError(ValueError):
    """A rollout state file that cannot be used; one line naming the file and the field."""


# ---------------------------------------------------------------------- JSON schema
def _spans(versions: Sequence[int]) -> list[list[int]]:
    """Run-length ``[[version, count], ...]``: a response spans few versions."""
    out: list[list[int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _rollout_json(r: Rollout) -> dict[str, Any]:
    return {"rid": r.rid, "sample_index": r.sample_index, "sampling": asdict(r.sampling),
            "output_ids": r.output_ids, "logprobs": r.logprobs,
            "versions": _spans(r.versions), "finish_reason": r.finish_reason,
            "segments": r.segments, "observed": r.observed, "episode": r.episode,
            "routing": routing.to_json(r.routing)}  # fmt: skip


def _group_json(g: Group) -> dict[str, Any]:
    e = g.item
    item = {"uid": e.uid, "prompt_ids": list(e.prompt_ids), "prompt_text": e.prompt_text,
            "label": e.label, "metadata": dict(e.metadata),
            "target_ids": None if e.target_ids is None else list(e.target_ids),
            "messages": [dict(m) for m in e.messages],
            "target_mask": None if e.target_mask is None else list(e.target_mask)}  # fmt: skip
    results = None if g.results is None else [asdict(r) for r in g.results]
    return {"gid": g.gid, "index": g.index, "start_version": g.start_version, "item": item,
            "rollouts": [_rollout_json(r) for r in g.rollouts], "results": results,
            "step": g.step}  # fmt: skip


def to_json(state: StreamState) -> dict[str, Any]:
    """The file's content: the stream's counters and position, then per group its prompt
    (the whole :class:`Example`, so no data file is needed to rebuild it), its samples
    (tokens, behaviour log-probs, version spans, sampling, finish reason, and with routing
    replay their routing rows as bytes: rl/generator/routing.py) and its scores (null
    until scored)."""
    return {"format": FORMAT, "version": VERSION, "step": state.step,
            "weight_version": state.version, "drawn": state.drawn,
            "position": state.position,
            "groups": [_group_json(g) for g in state.groups]}  # fmt: skip


def from_json(d: Any, where: str = "rollout state") -> StreamState:  # a JSON value
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise RolloutStateError(f"{where}: not a {FORMAT} file")
    if d.get("version") != VERSION:
        raise RolloutStateError(f"{where}: format version {d.get('version')!r}, not {VERSION}")
    try:
        groups = []
        for g in d["groups"]:
            item = _example(g["item"])
            rollouts = [_rollout(r, list(item.prompt_ids), g["gid"]) for r in g["rollouts"]]
            results = g["results"]
            groups.append(Group(
                g["gid"], item, g["start_version"], rollouts,
                results=None if results is None else [ScoreResult(**r) for r in results],
                done=sum(r.finished for r in rollouts), index=g["index"],
                step=g.get("step", 0),  # files of free-running streams before it had none
            ))  # fmt: skip
        return StreamState(d["step"], d["weight_version"], d["drawn"], dict(d["position"]),
                           groups=groups)  # fmt: skip
    except (KeyError, TypeError, ValueError) as e:
        raise RolloutStateError(f"{where}: malformed ({type(e).__name__}: {e})") from None


def _example(e: dict[str, Any]) -> Example:
    target, mask = e["target_ids"], e.get("target_mask")
    return Example(
        e["uid"],
        tuple(e["prompt_ids"]),
        e["prompt_text"],
        e["label"],
        metadata=dict(e["metadata"]),
        target_ids=None if target is None else tuple(target),
        messages=tuple(e.get("messages", ())),
        target_mask=None if mask is None else tuple(mask),
    )


def _rollout(r: dict[str, Any], prompt_ids: list[int], gid: int) -> Rollout:
    versions = [int(v) for v, n in r["versions"] for _ in range(n)]
    if not len(r["output_ids"]) == len(r["logprobs"]) == len(versions):
        raise ValueError(f"rollout {r['rid']}: tokens, log-probs and versions differ in length")
    rows = routing.from_json(r.get("routing"))  # files of runs without replay have none
    if rows is not None and rows.shape[0] > len(prompt_ids) + len(r["output_ids"]) - 1:
        raise ValueError(f"rollout {r['rid']}: {rows.shape[0]} routing rows for its tokens")
    return Rollout(
        prompt_ids,
        SamplingParams.from_dict(r["sampling"]),
        r["sample_index"],
        gid,
        output_ids=list(r["output_ids"]),
        logprobs=[float(x) for x in r["logprobs"]],
        versions=versions,
        finish_reason=r["finish_reason"],
        segments=r["segments"],
        rid=r["rid"],
        observed=[[int(a), int(n)] for a, n in r.get("observed", [])],
        episode=r.get("episode"),
        routing=rows,
    )


# ---------------------------------------------------------------------- files
def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that a reader (or a job killed meanwhile) sees the old file or the
    whole new one, never part of one, and no temporary file stays behind."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a power cut
        d = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(d)
        finally:
            os.close(d)


def save(out_dir: str | os.PathLike, step: int, state: StreamState) -> str:
    """Write step ``step``'s state; return its path relative to the run dir (for the
    resume point, which is written after it)."""
    state.step = step
    rel = f"{DIR}/step-{step:07d}.json"
    path = Path(out_dir) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = json.dumps(to_json(state), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:  # a label or metadata value JSON cannot hold
        raise RolloutStateError(f"step {step}'s rollout state is not JSON: {e}") from None
    write_atomic(path, text)
    return rel


def prune(out_dir: str | os.PathLike, keep: str) -> None:
    """Delete the states the resume point no longer names (older ones, one a killed
    attempt wrote without naming it, temporaries of a killed write)."""
    for p in (Path(out_dir) / DIR).iterdir():
        if p != Path(out_dir) / keep:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def load(out_dir: str | os.PathLike, point: ResumePoint | None) -> StreamState | None:
    """The state saved with ``point``'s checkpoint; None for a fresh run or a resume
    point written before rollout states were saved (its prompt stream then starts over)."""
    if point is None:
        return None
    if point.rollouts is None:
        print(f"resume point of step {point.step} has no rollout state: the prompt stream "
              "starts over", flush=True)  # fmt: skip
        return None
    path = Path(out_dir) / point.rollouts
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RolloutStateError(f"{path}: unreadable rollout state ({e})") from None
    state = from_json(d, str(path))
    if state.step != point.step:
        raise RolloutStateError(f"{path}: holds step {state.step}, the resume point {point.step}")
    return state


def digest(g: Group) -> str:
    """A hash of a group's samples: their tokens, log-probs (bit for bit) and versions."""
    h = hashlib.blake2b(digest_size=8)
    for r in g.rollouts:
        h.update(json.dumps([r.output_ids, r.logprobs, r.versions]).encode())
    return h.hexdigest()


def _brief(g: Group) -> dict[str, Any]:
    return {"index": g.index, "uid": g.item.uid, "rids": [r.rid for r in g.rollouts]}


def log_trained(
    out_dir: str | os.PathLike,
    step: int,
    groups: Sequence[Group],
    requeued: Sequence[str] = (),
    aside: Sequence[tuple[str, Group]] = (),
    leftover: Sequence[Group] | None = None,
) -> None:
    """One line per RL step: each trained group's prompt (stream index and uid), its
    samples' ids and a digest of their tokens, log-probs and versions (two runs that
    should repeat are compared by it: the first group that differs is where they part),
    for a group carried over a restart the samples themselves, and the samples re-queued
    since the last step (their server was lost); so a run's prompts, resumed and
    re-queued samples can be checked across attempts and server restarts. The records are
    phase ``rl``: a resumed job drops the lost attempt's lines after its checkpoint as it
    does its metrics.

    The rest of the ledger: the groups set aside since the last step (``dropped``: too
    old for the trainer; ``skipped``: no signal), and at a save and at the run's end the
    groups drawn and not trained on (``leftover``: queued, being scored, generating,
    parked). Every group the stream drew is then in exactly one place: trained, dropped
    or skipped at some step, or left over at the last record."""
    recs = []
    for g in groups:
        rec: dict[str, Any] = {**_brief(g), "digest": digest(g)}
        if g.restored_at is not None:
            rec["restored_at"] = g.restored_at
            rec["rollouts"] = [{"rid": r.rid, "output_ids": r.output_ids,
                                "logprobs": r.logprobs, "versions": r.versions}
                               for r in g.rollouts]  # fmt: skip
        recs.append(rec)
    line: dict[str, Any] = {"phase": "rl", "step": step, "groups": recs,
                            "requeued": list(requeued)}  # fmt: skip
    for why in ("dropped", "skipped"):
        line[why] = [_brief(g) for w, g in aside if w == why]
    if leftover is not None:
        line["leftover"] = [_brief(g) for g in leftover]
    with open(Path(out_dir) / TRAINED, "a") as f:
        f.write(json.dumps(line) + "\n")
