"""The rollout ledger of a run dir (``trained_prompts.jsonl``, rl/controller/rollout_state.py):
where every group the rollout stream drew ended up."""

from __future__ import annotations

import json
from pathlib import Path

PLACES = ("groups", "dropped", "skipped")  # per step: trained on, too old, no signal
CARRIED = ("restored_at", "rollouts")  # what a resumed attempt adds to a group it carried over


def ledger(out: Path) -> list[dict]:
    path = out / "trained_prompts.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def rids(recs: list[dict], place: str) -> set[str]:
    """The rollout ids of every group in ``place`` of every record (``leftover``: of the
    last record only: an earlier one is a save's, whose groups were trained on later)."""
    chosen = recs[-1:] if place == "leftover" else recs
    return {rid for rec in chosen for g in rec.get(place, ()) for rid in g["rids"]}


def where_each_group_went(recs: list[dict]) -> dict[int, str]:
    """Each drawn group's prompt-stream index -> where it ended: trained on (``groups``),
    ``dropped``, ``skipped``, or ``leftover`` at the end. Fails if a group is in two places
    or the indices leave a gap (a group drawn and then recorded nowhere)."""
    seen: dict[int, str] = {}
    for rec in recs:
        for place in PLACES:
            for g in rec[place]:
                assert g["index"] not in seen, (g, seen[g["index"]], place, rec["step"])
                seen[g["index"]] = place
    for g in recs[-1]["leftover"]:
        assert g["index"] not in seen, (g, seen[g["index"]], "leftover")
        seen[g["index"]] = "leftover"
    missing = sorted(set(range(max(seen) + 1)) - set(seen))
    assert not missing, f"groups drawn and recorded nowhere: {missing[:10]}"
    return seen


def as_if_uninterrupted(line: str) -> str:
    """A ledger line without what a resumed attempt adds to the groups it carried over (the
    step they were saved at, their samples), written as the controller writes a line: a
    resumed deterministic run's line is then the uninterrupted run's, byte for byte."""
    rec = json.loads(line)
    for g in rec["groups"]:
        for key in CARRIED:
            g.pop(key, None)
    return json.dumps(rec)
