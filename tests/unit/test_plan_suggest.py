"""The planner's advice (rl/plan/suggest.py): it never tells the user to lower a value that
is already at its minimum, nor to raise one that cannot go higher."""

from __future__ import annotations

import re

import pytest

from rl.plan import plan_cluster
from rl.plan.suggest import context_floor, trainer_hint
from tests.helpers.configs import composed

SMALL_GPU = "cluster.gpu_memory_gb=20"


def _clauses(hint: str) -> tuple[str, str]:
    """The lower and the raise clauses of a hint ("set ..., or lower ..., or raise ...")."""
    clauses = hint.split(", or ")
    lower = next((c for c in clauses if c.startswith("lower ")), "")
    raise_ = next((c for c in clauses if c.startswith("raise ")), "")
    return lower, raise_


def _values(clause: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"([a-z_]+\.[a-z_.]+)=(\d+)", clause)}


def test_the_planner_does_not_suggest_lowering_micro_batch_size_1() -> None:
    """The 70B preset with a 16k context: its micro-batch is 1 row already."""
    cfg = composed(["experiment=llama3_70b_512gpu", "rollout.context_length=16384"])
    assert cfg.trainer.micro_batch_size == 1
    (problem,) = [p for p in plan_cluster(cfg, strict=False).problems if "trainer GPU" in p]
    assert problem.endswith(
        ": set trainer.recompute=full or trainer.sequence_parallel=true, "
        "or lower rollout.context_length=16384"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["experiment=llama3_70b_512gpu", "rollout.context_length=16384"],
        ["experiment=llama3_70b_512gpu", "trainer.micro_batch_size=2"],
        ["experiment=llama3_8b_256gpu", SMALL_GPU],
        ["experiment=qwen3_0_6b_16gpu", SMALL_GPU, "trainer.micro_batch_size=2"],
        # At the context's floor: the rollouts' prompt bound plus their responses.
        [
            "experiment=qwen3_0_6b_16gpu",
            "task=dataset",
            "task.max_prompt_tokens=1024",
            "rollout.context_length=8192",
        ],
        ["experiment=llama3_70b_512gpu", "task=dataset", "task.max_prompt_tokens=1024"],
    ],
)
@pytest.mark.parametrize("activations", [True, False])
def test_nothing_at_its_minimum_is_to_be_lowered(overrides: list[str], activations: bool) -> None:
    cfg = composed(overrides)
    lower, _ = _clauses(trainer_hint(cfg, activations_dominate=activations))
    minimum = {"trainer.micro_batch_size": 1, "rollout.context_length": context_floor(cfg)}
    for name, value in _values(lower).items():
        assert value > minimum[name], f"suggests lowering {name}={value}: {lower}"


def test_micro_batch_and_context_are_suggested_only_above_their_minimum() -> None:
    base = ["experiment=llama3_70b_512gpu", "rollout.context_length=16384"]
    lower, _ = _clauses(trainer_hint(composed(base), activations_dominate=True))
    assert lower == "lower rollout.context_length=16384"  # micro_batch_size is 1 already
    cfg = composed([*base, "trainer.micro_batch_size=2"])
    lower, _ = _clauses(trainer_hint(cfg, activations_dominate=True))
    assert lower == "lower rollout.context_length=16384 or trainer.micro_batch_size=2"
    cfg = composed(["experiment=qwen3_0_6b_16gpu", "task=dataset", "task.max_prompt_tokens=1024",
                    "rollout.context_length=8192"])  # fmt: skip
    assert context_floor(cfg) == 8192
    assert trainer_hint(cfg, activations_dominate=True) == (
        "set trainer.recompute=full, or raise trainer.tp=1 or trainer.cp=1"
    )
    cfg_args = ["experiment=qwen3_0_6b_16gpu", "task=dataset", "task.max_prompt_tokens=1024",
                "rollout.context_length=8192", "trainer.recompute=full"]  # fmt: skip
    cfg = composed(cfg_args)
    assert trainer_hint(cfg, activations_dominate=True) == "raise trainer.tp=1 or trainer.cp=1"
    # Context parallelism is not offered where it is refused: without packing, for MoE.
    for more in (["trainer.packing=false"], ["model=qwen3_30b_a3b"]):
        assert "trainer.cp" not in trainer_hint(composed([*cfg_args, *more]), True)


def test_raising_stops_at_the_node_and_the_layers() -> None:
    # TP 8 fills an 8-GPU node; PP 80 gives each of the 80 layers its own stage.
    cfg = composed(["experiment=llama3_70b_512gpu", "trainer.tp=8", "trainer.pp=80"])
    assert "trainer.tp" not in trainer_hint(cfg, activations_dominate=False)
    assert "trainer.pp" not in trainer_hint(cfg, activations_dominate=False)
    limit = ["experiment=llama3_70b_512gpu", "trainer.tp=8", "trainer.micro_batch_size=1",
             f"rollout.context_length={context_floor(cfg)}"]  # fmt: skip
    hint = trainer_hint(composed(limit), activations_dominate=True)
    assert hint == "set trainer.recompute=full or trainer.sequence_parallel=true"
    cfg = composed([*limit, "trainer.recompute=full", "trainer.sequence_parallel=true"])
    hint = trainer_hint(cfg, activations_dominate=True)
    assert hint.startswith("every setting that would shrink it is at its limit")
    assert "lower" not in hint and "raise" not in hint
