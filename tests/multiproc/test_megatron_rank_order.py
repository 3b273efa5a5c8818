"""Our rank -> (TP, PP, DP, EP) coordinates (rl/ddma/layout.py, used by the planner, DDMA
and the tests) against the process groups Megatron-Core itself builds."""

from __future__ import annotations

import pytest

from rl.ddma.plan import PlanError, SrcLayout


@pytest.mark.parametrize(
    "tp,pp,dp,ep",
    [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 2, 1), (2, 2, 2, 2), (2, 3, 4, 2), (1, 2, 4, 4)],
)
def test_rank_coordinates_are_megatrons(tp, pp, dp, ep):
    """Every trainer rank's TP/PP/DP/EP rank as the planner and DDMA read it, against the
    groups Megatron-Core builds itself (default order; experts: expert TP = TP)."""
    from megatron.core.parallel_state import RankGenerator

    src = SrcLayout(tp, pp, dp, ep=ep)
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    expert = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order=order)
    want: dict[int, dict[str, int]] = {r: {} for r in range(src.world)}
    for gen, axis in ((dense, "tp"), (dense, "pp"), (dense, "dp"), (expert, "ep")):
        for ranks in gen.get_ranks(axis):
            for i, r in enumerate(ranks):
                want[r][axis] = i
    for r in range(src.world):
        at = src.coords(r)
        assert at._asdict() == want[r], r
        assert src.rank(at.tp, at.pp, at.dp) == r
    with pytest.raises(PlanError, match=f"trainer rank {src.world} is outside"):
        src.coords(src.world)
