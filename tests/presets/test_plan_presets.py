"""The paper-scale and dataset experiments, planned in full (the DDMA plan of a 1,024-GPU
MoE preset alone takes seconds): every GPU used once, and both kinds of GPU fit."""

from __future__ import annotations

import pytest

from rl.config import CONF_DIR
from rl.config.roles import RoleMap
from rl.models.arch import Dims
from rl.models.registry import active_count
from rl.models.shapes import param_count
from rl.plan import plan_cluster
from rl.plan.cluster import suggested_staging
from rl.plan.memory import stage_expert_params
from tests.helpers.configs import config_of as _cfg
from tests.helpers.configs import plan_of as _plan

PAPER = ["llama3_8b_256gpu", "llama3_70b_512gpu", "llama3_405b_1024gpu"]
QWEN3 = [
    "qwen3_0_6b_16gpu",
    "qwen3_8b_64gpu",
    "qwen3_30b_a3b_128gpu",
    "qwen3_235b_a22b_1024gpu",
]


def test_paper_experiments_exist() -> None:
    """Guards the parametrisation below against a renamed or missing preset."""
    for name in PAPER + QWEN3:
        assert (CONF_DIR / "experiment" / f"{name}.yaml").is_file()


@pytest.mark.parametrize("name", PAPER + QWEN3)
def test_paper_experiment_plans_and_fits(name: str) -> None:
    """Every GPU of the cluster is used exactly once, TP groups stay inside a node, each
    generator rank sits with its servers, and both kinds of GPU fit in memory."""
    cfg = _cfg(f"experiment={name}")
    plan = _plan(f"experiment={name}")
    assert plan.fits and plan.problems == []
    c, t, r, p = cfg.cluster, cfg.trainer, cfg.rollout, plan.placement
    gpn = c.gpus_per_node
    assert c.nodes * gpn == int(name.split("_")[-1].removesuffix("gpu"))
    assert p.world_size == RoleMap.from_config(cfg).world_size

    used: list[tuple[int, int]] = []
    trainer = p.ranks["trainer"]
    for i, rank in enumerate(trainer):
        assert p.node_of[rank] < c.train_nodes
        used.append((p.node_of[rank], i % gpn))
    for start in range(0, len(trainer), t.tp):  # Megatron's TP groups: consecutive ranks
        assert len({p.node_of[x] for x in trainer[start : start + t.tp]}) == 1
    for s in p.servers:
        assert s.gpus is not None and s.gpus[1] - s.gpus[0] + 1 == r.tp
        assert s.node >= c.train_nodes and p.node_of[s.owner] == s.node
        used += [(s.node, g) for g in range(s.gpus[0], s.gpus[1] + 1)]
    assert sorted(used) == [(n, g) for n in range(c.nodes) for g in range(gpn)]

    layers = [x for st in p.stages for x in range(st.layers[0], st.layers[1] + 1)]
    assert layers == list(range(cfg.model.num_layers))
    assert plan.busiest_trainer.total <= plan.gpu_bytes
    assert plan.generator is not None and plan.generator.total <= plan.gpu_bytes
    assert plan.generator.kv_tokens >= plan.sequence


DATASET_PRESETS = ["qwen2_5_7b_gsm8k", "llama3_8b_math", "qwen2_5_vl_7b_geo"]


@pytest.mark.parametrize("name", DATASET_PRESETS)
def test_dataset_experiments_validate_and_fit(name: str) -> None:
    """The user-data presets validate as launched (the files and checkpoint are the user's:
    nothing is read), every GPU is used once, and both kinds of GPU fit."""
    from rl.checks import check

    cfg = _cfg(f"experiment={name}")
    check(cfg)
    assert cfg.task.name == "dataset" and cfg.task.train_files
    assert cfg.model.hf_checkpoint is None  # the user sets it; the model YAML gives the shape
    plan = plan_cluster(cfg)
    assert plan.fits and plan.problems == []
    c, r, p = cfg.cluster, cfg.rollout, plan.placement
    used = [(p.node_of[rank], i % c.gpus_per_node) for i, rank in enumerate(p.ranks["trainer"])]
    for s in p.servers:
        assert s.gpus is not None and p.node_of[s.owner] == s.node
        used += [(s.node, g) for g in range(s.gpus[0], s.gpus[1] + 1)]
    assert sorted(used) == [(n, g) for n in range(c.nodes) for g in range(c.gpus_per_node)]
    # The token budget never packs more than the one full-length row the planner sizes.
    assert cfg.trainer.max_tokens_per_microbatch == r.context_length == plan.sequence
    assert r.context_length >= cfg.task.max_prompt_tokens + r.sampling.max_new_tokens
    assert cfg.rl.prompts_per_step * cfg.algorithm.group_size == cfg.trainer.global_batch_size
    assert plan.generator is not None and plan.generator.kv_tokens >= plan.sequence


def test_qwen3_235b_a22b_expert_shards_by_hand() -> None:
    """TP4 x PP2 x EP16: a GPU holds 47 layers x 8 experts, quartered by TP4; TP8 servers
    replicate each of the 4 KV heads on 2 GPUs (one KV head per GPU)."""
    cfg = _cfg("experiment=qwen3_235b_a22b_1024gpu")
    m, t = cfg.model, cfg.trainer
    assert (t.tp, t.pp, t.dp, t.ep) == (4, 2, 32, 16)
    expert = 3 * 4096 * 1536
    assert stage_expert_params(m, t.tp, t.pp, t.ep) == 47 * 8 * expert // 4 == 1_774_190_592
    d = Dims.of(m)
    active = 94 * active_count(d, m.moe_router_topk) + 2 * 151936 * 4096 + 4096
    assert abs(param_count(m) - 235.1e9) < 0.05e9 and abs(active - 22.2e9) < 0.05e9
    plan = _plan("experiment=qwen3_235b_a22b_1024gpu")
    assert plan.generator is not None
    assert plan.generator.kv_bytes_per_token == 2 * 94 * 1 * 128 * 2
    assert [s.layers for s in plan.placement.stages] == [(0, 46), (47, 93)]


@pytest.mark.parametrize("name", PAPER + QWEN3 + DATASET_PRESETS)
def test_presets_stage_where_the_rule_says(name: str) -> None:
    """rollout.weight_sync.staging in each preset follows rl.plan.cluster's rule: a device
    copy only where it costs <= 10% of the KV cache, else host copies where they take
    <= 25% of a node's host memory, else none; what it would leave is counted."""
    cfg = _cfg(f"experiment={name}")
    plan = _plan(f"experiment={name}")
    g = plan.generator
    assert g is not None and plan.transfer is not None
    staging = cfg.rollout.weight_sync.staging
    assert staging == suggested_staging(cfg, plan)
    assert g.staged == (g.weights if staging == "device" else 0)
    assert plan.host_staging == (8 * g.weights if staging == "host" else 0)
    assert plan.gpu_bytes is not None and g.total <= plan.gpu_bytes


def test_405b_preset_does_not_fit_with_a_device_copy() -> None:
    """The staging the 405B preset avoids: 2 x 47.8 GB of weights per 80 GB GPU."""
    plan = plan_cluster(_cfg(f"experiment={PAPER[2]}", "rollout.weight_sync.staging=device"), False)
    assert not plan.fits and "rollout.weight_sync.staging=device" in plan.problems[0]
    g = _plan(f"experiment={PAPER[2]}").generator
    assert g is not None and g.staging == "none"


@pytest.mark.parametrize("name", PAPER)
def test_paper_ddma_senders_are_balanced_and_servers_relay(name: str) -> None:
    """The busiest trainer rank sends at most 1.2x the mean; servers forward to servers
    (a chain below the roots the trainer feeds), so a trainer rank sends no more than one
    server GPU receives, and the sync's lower bound is the busiest GPU's bytes at 400 Gb/s.
    It is <= 1.0 s but at 405B, where one server GPU's own FP8 weights (51.3 GB) take
    1.03 s to arrive through its NIC, whatever sends them."""
    relay = "rollout.weight_sync.relay=chain"  # planned; live syncs do not relay yet
    cfg = _cfg(f"experiment={name}", relay)
    x = _plan(f"experiment={name}", relay).transfer
    assert x is not None and x.seconds is not None and x.relay == "chain"
    assert x.balance <= 1.2, x.balance
    busiest_gpu = max([*x.per_server_gpu.values(), *x.per_server_gpu_out.values()])
    assert x.busiest_trainer_rank[1] <= busiest_gpu
    rate = cfg.cluster.interconnect_gbps * 1e9 / 8
    assert x.seconds == busiest_gpu / rate
    before = {PAPER[0]: 4.87, PAPER[1]: 1.53, PAPER[2]: 1.48}[name]  # one sender per tensor
    assert x.seconds < before / 1.4
    if name == PAPER[2]:
        assert x.roots == x.servers and x.depth == 1  # the trainer keeps up with every server
        assert max(x.per_server_gpu.values()) == x.server_weight_bytes
        assert 1.0 < x.seconds < 1.03
    else:
        assert x.roots < x.servers and x.depth > 1 and x.seconds <= 1.0


def test_8b_relay_plan_writes_every_server_once() -> None:
    """The 8B preset's relay plan in full (192 servers, every hop scheduled): every byte of
    every server written exactly once, each forwarded after it arrived."""
    from rl.ddma import relay
    from rl.ddma.plan import coverage_errors

    cfg = _cfg(f"experiment={PAPER[0]}", "rollout.weight_sync.relay=chain")
    plan = relay.plan_with_relay(cfg.model, cfg.trainer, cfg.rollout, cfg.trainer.dp, 1 << 50)
    assert plan.replicas == cfg.rollout.servers == 192 and len(plan.hops) == 192 * len(plan.buckets)
    assert coverage_errors(plan) == [] and relay.schedule_errors(plan) == []
