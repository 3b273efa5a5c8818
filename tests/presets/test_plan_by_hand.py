"""The placement planner (rl/plan): paper-scale presets plan and fit, numbers match hand
formulas, impossible plans are refused naming the field, and the CLI works."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import DictConfig

from rl.config import ConfigError
from rl.config.roles import NODE_RANKS_ENV, RoleError, RoleMap, format_node_ranks
from rl.models.arch import Dims
from rl.models.registry import active_count
from rl.models.shapes import padded_vocab_size, param_count
from rl.plan import PlanRefused, plan_cluster
from rl.plan.__main__ import main
from rl.plan.memory import GIB, MIB, stage_expert_params, stage_params
from rl.runtime.job import placed_rank
from tests.helpers.configs import config_of as _cfg
from tests.helpers.configs import plan_of as _plan

ROOT = Path(__file__).resolve().parents[2]


def _llama3_8b_params() -> int:
    """Llama 3.1 8B from its published shapes, written out by hand."""
    h, kv, f, vocab, layers = 4096, 8 * 128, 14336, 128256, 32
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    return 2 * vocab * h + layers * per_layer + h


def test_8b_bf16_numbers_by_hand() -> None:
    """bf16 weights are 2 bytes x params on the server and on the wire (TP1: no padding,
    no replicated KV heads); Adam is 12 bytes per parameter over DP; activations follow the
    documented per-token formula."""
    cfg = _cfg("experiment=llama3_8b_256gpu")
    plan = plan_cluster(cfg)
    n = _llama3_8b_params()
    assert n == param_count(cfg.model)
    x = plan.transfer
    assert x is not None and x.fp8_block is None
    assert x.per_server == 2 * n and x.server_weight_bytes == 2 * n
    assert x.total == cfg.rollout.servers * 2 * n
    assert sum(x.per_trainer_rank.values()) == x.roots * 2 * n  # the others relay (chain)
    assert sum(x.per_server_gpu.values()) == x.per_server

    t, g = cfg.trainer, plan.trainer[0]
    assert (t.tp, t.pp, t.dp) == (2, 1, 32)
    # TP2 halves everything but the norms (2 per layer + the final one), which it copies.
    norms = 32 * 2 * 4096 + 4096
    assert g.params == (n - norms) // 2 + norms
    assert (g.weights, g.grads) == (2 * g.params, 4 * g.params)
    assert g.optimizer == math.ceil(12 * g.params / 32)  # fp32 main + m + v, over DP32
    per_token_layer = 2 * (4 * 4096 + (2 * 4096 + 2 * 1024 + 3 * 14336) // 2)
    assert per_token_layer == 86016
    assert g.activations == 1 * 8192 * 32 * 1 * per_token_layer
    assert g.logits == 8192 * (128256 // 2) * (2 + 8)


@pytest.mark.parametrize(
    ("overrides", "activations"),
    [
        # Sequence parallelism splits the 4h over TP2 as well.
        (["trainer.sequence_parallel=true"], 8192 * 32 * 2 * (69632 // 2)),
        # Full recomputation: each layer keeps its bf16 input, one layer's a comes back.
        (["trainer.recompute=full"], 8192 * 32 * 2 * 4096 + 8192 * 86016),
        # Both: the inputs are split over TP2 too.
        (["trainer.recompute=full", "trainer.sequence_parallel=true"],
         8192 * 32 * 2 * 4096 // 2 + 8192 * 2 * (69632 // 2)),
    ],
    ids=["sp", "recompute", "both"],
)  # fmt: skip
def test_8b_activations_with_sequence_parallelism_and_recomputation_by_hand(
    overrides: list[str], activations: int
) -> None:
    """The 8B preset (TP2, one 8192-token row, 32 layers, one micro-batch in flight):
    ``a = 2 * (4h + (2q + 2kv + 3f) / 2)`` is 86016 bytes, 69632 with the 4h split."""
    g = plan_cluster(_cfg("experiment=llama3_8b_256gpu", *overrides)).trainer[0]
    assert g.activations == activations


def test_8b_lora_numbers_by_hand() -> None:
    """LoRA rank 16 on the 8B preset (TP2): the adapters join the weights, and the grads
    and Adam hold only them; a push merges one fc1 shard at a time."""
    full = plan_cluster(_cfg("experiment=llama3_8b_256gpu")).trainer[0]
    cfg = _cfg("experiment=llama3_8b_256gpu", "trainer.lora.rank=16")
    g = plan_cluster(cfg).trainer[0]
    h, q, kv, f, r = 4096, 4096, 1024, 14336, 16
    per_layer = r * (
        (h + (q + 2 * kv) // 2)  # qkv: A whole, B's rows split over TP2
        + (q // 2 + h)  # proj: A's columns split, B whole
        + (h + 2 * f // 2)  # fc1 (gate and up)
        + (f // 2 + h)  # fc2
    )
    adapters = 32 * per_layer
    assert g.params == full.params + adapters
    assert (g.weights, g.grads) == (2 * g.params, 4 * adapters)
    assert g.optimizer == math.ceil(12 * adapters / 32)
    assert g.buffers == full.buffers + 2 * h * 2 * f // 2  # one merged fc1 shard, bf16
    assert g.static < full.static / 2


def test_70b_fp8_volume_by_hand() -> None:
    """FP8: linear weights 1 byte + a float32 scale per 128x128 block (every per-rank dim
    is a multiple of 128 here); norms and embeddings stay bf16, norms copied to each of
    the server's TP ranks."""
    cfg = _cfg("experiment=llama3_70b_512gpu")
    plan = plan_cluster(cfg)
    h, q, kv, f, vocab, layers, tp = 8192, 8192, 1024, 28672, 128256, 80, cfg.rollout.tp
    assert tp == 4 and cfg.rollout.weight_sync.fp8_block == 128
    linear = h * (q + 2 * kv) + q * h + 3 * f * h
    per_layer = linear + 4 * linear // (128 * 128) + tp * 2 * h * 2
    expected = layers * per_layer + 2 * vocab * h * 2 + tp * h * 2
    x = plan.transfer
    assert x is not None and x.per_server == expected
    assert x.server_weight_bytes * tp == expected  # vocab 128256 splits 4 ways unpadded
    assert x.total == cfg.rollout.servers * expected


def test_405b_generator_kv_cache_by_hand() -> None:
    """KV bytes per token per GPU: K and V x 126 layers x one KV head (8 heads over TP8)
    x 128 x bf16; the cache gets what weights and SGLang's reserve leave."""
    cfg = _cfg("experiment=llama3_405b_1024gpu")
    g = plan_cluster(cfg).generator
    assert g is not None
    assert g.kv_bytes_per_token == 2 * 126 * 1 * 128 * 2
    assert g.reserved == int((512 + 1.5 * 8192 + 1024 + 2 * 512) * MIB)
    assert g.kv_capacity == (80 * GIB - g.reserved - g.weights) // g.kv_bytes_per_token
    assert g.kv_tokens == g.kv_capacity  # rollout.max_total_tokens: null


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model=llama3_70b", "trainer.tp=8", "trainer.pp=4"],
        ["experiment=llama3_405b_1024gpu"],
        ["model.tie_embeddings=true", "trainer.pp=2"],
    ],
    ids=["tiny-tp2", "70b-tp8-pp4", "405b-tp8-pp18", "tiny-tied-pp2"],
)
def test_stage_params_add_up_to_the_model(overrides: list[str]) -> None:
    """Over all stages and TP ranks, the trainer holds every (padded) parameter once, plus
    TP copies of the norms and, with tied embeddings over PP, the last stage's copy."""
    cfg = _cfg(*overrides)
    m, t = cfg.model, cfg.trainer
    held = sum(stage_params(m, t.tp, t.pp, p) for p in range(t.pp)) * t.tp
    copies = (t.tp - 1) * (2 * m.hidden_size * m.num_layers + m.hidden_size)
    if m.tie_embeddings and t.pp > 1:  # the last stage's output layer
        copies += padded_vocab_size(m) * m.hidden_size
    assert held == param_count(m, padded=True) + copies


def test_local_default_plans_on_one_node() -> None:
    """The embedded CPU job: every rank on node 0, nothing GPU-sized to refuse."""
    plan = plan_cluster(_cfg())
    p = plan.placement
    assert not p.split and p.world_size == 5
    assert set(p.node_of.values()) == {0}
    assert plan.gpu_bytes is None and plan.fits and plan.generator is not None
    assert [s.gpus for s in p.servers] == [None]
    sft = plan_cluster(_cfg("experiment=tiny_sft"))
    assert sft.transfer is None and sft.generator is None and sft.placement.servers == []


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (
            ["experiment=llama3_70b_512gpu", "trainer.pp=1", "trainer.dp=16"],
            ["trainer GPU", "> cluster.gpu_memory_gb=80", "raise trainer.pp=1"],
        ),
        (
            ["experiment=llama3_70b_512gpu", "rollout.context_length=16384"],
            ["> cluster.gpu_memory_gb=80", "lower rollout.context_length=16384"],
        ),
        (
            ["experiment=llama3_405b_1024gpu", "rollout.weight_sync.fp8_block=null"],
            ["generator GPU", "rollout.tp=8", "rollout.weight_sync.fp8_block=128"],
        ),
        (
            ["experiment=llama3_405b_1024gpu", "rollout.max_total_tokens=10000000"],
            ["rollout.max_total_tokens=10000000", "KV cache"],
        ),
        (
            ["experiment=llama3_405b_1024gpu", "cluster.train_nodes=70"],
            ["cluster.train_nodes + generation_nodes = 70 + 56 = 126 != cluster.nodes=128"],
        ),
        (
            ["experiment=llama3_8b_256gpu", "trainer.dp=16"],
            ["trainer.tp*pp*dp = 2*1*16 = 32 GPUs", "cluster.train_nodes*gpus_per_node = 8*8"],
        ),
        (
            ["experiment=llama3_8b_256gpu", "rollout.servers=96"],
            ["rollout.servers*tp = 96*1 = 96 GPUs", "generation_nodes*gpus_per_node = 24*8"],
        ),
        (
            [
                "experiment=llama3_405b_1024gpu",
                "rollout.tp=16",
                "rollout.servers=28",
                "cluster.roles.generator=28",
            ],
            ["rollout.tp=16", "cluster.gpus_per_node=8"],
        ),
        (["experiment=llama3_8b_256gpu", "trainer.tp=3"], ["trainer.tp=3", "heads=32"]),
        (
            ["experiment=llama3_70b_512gpu", "cluster.roles.generator=24"],
            ["cluster.roles.generator=24", "cluster.generation_nodes=48"],
        ),
        (
            [
                "experiment=llama3_8b_256gpu",
                "rollout.weight_sync.transport=ipc",
                "rollout.weight_sync.relay=none",
            ],
            ["rollout.weight_sync.transport='ipc'", "p2p"],
        ),
        (["experiment=llama3_8b_256gpu", "trainer.device=cpu"], ["trainer.device='cpu'"]),
        (
            ["experiment=llama3_8b_256gpu", "cluster.train_nodes=0", "cluster.generation_nodes=0"],
            ["cluster.nodes=32", "cluster.train_nodes=0"],
        ),
        (["experiment=llama3_8b_256gpu", "cluster.cpus_per_node=8"], ["cluster.cpus_per_node=8"]),
        (["cluster.name=k8s"], ["cluster.name='k8s'"]),
        (["cluster.nodes=2"], ["cluster.nodes=2"]),
    ],
    ids=[
        "trainer-static",
        "trainer-activations",
        "generator-weights",
        "generator-kv-pool",
        "node-sum",
        "trainer-gpus",
        "server-gpus",
        "tp-past-node",
        "tp-heads",
        "owner-straddles",
        "ipc-across-nodes",
        "device",
        "shared-multinode",
        "cpus",
        "cluster-name",
        "local-multinode",
    ],
)
def test_refused_plans_name_the_field(overrides: list[str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        plan_cluster(_cfg(*overrides))
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


def test_kv_cache_shorter_than_one_sequence_is_refused() -> None:
    """Shrink the GPU until the KV cache holds one token less than a sample."""
    cfg = _cfg("experiment=llama3_405b_1024gpu")
    g = plan_cluster(cfg).generator
    assert g is not None
    need = g.weights + g.reserved + (cfg.rollout.context_length - 1) * g.kv_bytes_per_token
    small = _cfg("experiment=llama3_405b_1024gpu", f"cluster.gpu_memory_gb={need / GIB}")
    plan = plan_cluster(small, strict=False)
    assert any("KV cache holds" in p and "rollout.context_length=2048" in p for p in plan.problems)
    with pytest.raises(PlanRefused):
        plan.check()


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment=llama3_405b_1024gpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    cfg = _cfg("experiment=llama3_405b_1024gpu")
    assert data["fits"] is True
    assert data["placement"]["world_size"] == RoleMap.from_config(cfg).world_size
    assert len(data["placement"]["servers"]) == cfg.rollout.servers
    assert len(data["placement"]["nodes_detail"]) == cfg.cluster.nodes
    assert len(data["memory"]["trainer"]) == cfg.trainer.pp
    assert data["ddma"]["total"] == cfg.rollout.servers * data["ddma"]["per_server"]


def test_cli_refuses_a_plan_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["experiment=llama3_70b_512gpu", "rollout.context_length=16384"])
    captured = capsys.readouterr()
    assert code == 1
    assert "fits: NO" in captured.out
    assert "plan refused: trainer GPU" in captured.err
    assert "cluster.gpu_memory_gb=80" in captured.err


@pytest.mark.parametrize(
    ("override", "needle"),
    [("trainer.tpp=8", "tpp"), ("cluster.nodez=4", "nodez"), ("trainer.tp=two", "two")],
)
def test_cli_hydra_error_names_the_key(
    override: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["experiment=llama3_8b_256gpu", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error:") and needle in err


# ---------------------------------------------------------------------- placed ranks
def _node_ranks(experiment: str, capsys: pytest.CaptureFixture[str]) -> str:
    """What launch/slurm/train.sbatch exports as MSRL_NODE_RANKS for ``experiment``."""
    assert main(["--node-ranks", f"experiment={experiment}"]) == 0
    return capsys.readouterr().out.strip()


def _placed(
    cfg: DictConfig, node_ranks: str, node: int, local: int, started: int
) -> tuple[str, int]:
    env = {NODE_RANKS_ENV: node_ranks, "SLURM_NODEID": str(node), "LOCAL_RANK": str(local)}
    env["LOCAL_WORLD_SIZE"] = str(started)
    roles = RoleMap.from_config(cfg)
    return roles.role_of(placed_rank(roles, env, rank=-1))


def test_sbatch_ranks_find_their_role_from_node_and_local_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """torchrun's c10d ranks follow the agents' rendezvous order, so under the sbatch
    script a process takes its role from (node, local rank) in the planner's placement,
    which the script hands over as text (the job itself never runs the planner)."""
    tiny = _cfg("experiment=tiny_arithmetic_slurm")
    assert main(["--ranks-per-node", "experiment=tiny_arithmetic_slurm"]) == 0
    assert capsys.readouterr().out.strip() == "3,2"
    text = _node_ranks("tiny_arithmetic_slurm", capsys)
    assert text == "0,1,2;3,4"
    assert [_placed(tiny, text, 0, i, 3) for i in range(3)] == [
        ("controller", 0),
        ("trainer", 0),
        ("trainer", 1),
    ]
    assert [_placed(tiny, text, 1, i, 2) for i in range(2)] == [("generator", 0), ("reward", 0)]
    big = _cfg("experiment=llama3_405b_1024gpu")
    per_node = plan_cluster(big).placement.node_ranks()
    assert sum(map(len, per_node)) == RoleMap.from_config(big).world_size == 641
    text = _node_ranks("llama3_405b_1024gpu", capsys)
    assert text == format_node_ranks(per_node)
    assert _placed(big, text, 0, 8, 9) == ("trainer", 7)  # node 0: the controller + 8 GPUs
    assert _placed(big, text, 71, 7, 8) == ("trainer", 575)
    assert _placed(big, text, 72, 0, 2) == ("generator", 0)
    assert _placed(big, text, 72, 1, 2) == ("reward", 0)  # scores next to the servers
    assert _placed(big, text, 127, 0, 1) == ("generator", 55)
    with pytest.raises(RoleError, match=r"node 1 started 3 ranks but .* puts 2 there"):
        _placed(tiny, "0,1,2;3,4", 1, 0, 3)
    with pytest.raises(RoleError, match=r"node 2 started 1 ranks but .* puts 0 there"):
        _placed(tiny, "0,1,2;3,4", 2, 0, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,1,x;3,4", r"MSRL_NODE_RANKS='0,1,x;3,4' is not the planner's node ranks"),
        ("", r"MSRL_NODE_RANKS places 0 ranks on 1 nodes, not each rank of the role map once"),
        ("0,1,2;3", r"places 4 ranks on 2 nodes, not each rank .* \(controller 1 \+ trainer 2"),
        ("0,1,2;3,3", r"places 5 ranks on 2 nodes, not each rank of the role map once"),
    ],
    ids=["not-numbers", "empty", "another-config", "a-rank-twice"],
)
def test_node_ranks_that_do_not_fit_the_role_map_are_refused(text: str, message: str) -> None:
    with pytest.raises(RoleError, match=message):
        _placed(_cfg("experiment=tiny_arithmetic_slurm"), text, 0, 0, 3)


def test_without_the_sbatch_marker_the_launcher_rank_is_the_role_map_rank() -> None:
    roles = RoleMap.from_config(_cfg())
    assert placed_rank(roles, {"SLURM_NODEID": "1", "LOCAL_RANK": "0"}, rank=3) == 3


# ---------------------------------------------------------------------- dataset presets
def test_qwen_gsm8k_numbers_by_hand() -> None:
    """1 node trains at TP1 x DP8, 3 nodes hold 24 TP1 servers. Per trainer GPU (the whole
    7,615,616,512-parameter model): bf16 weights 2P + fp32 grads 4P + Adam 12P/8 +
    activations 1536 x 28 x 2*(4*3584 + (2*3584 + 2*512 + 3*18944)) + logits
    1536 x 152064 x (2 + 8) + two 512 MiB buckets + 4 GiB = 71,647,765,760 bytes (66.7 GiB,
    13 GiB under 80). Per server: K and V x 28 layers x 4 KV heads x 128 x 2 bytes."""
    cfg = _cfg("experiment=qwen2_5_7b_gsm8k")
    plan = plan_cluster(cfg)
    t, p = cfg.trainer, plan.placement
    assert (t.tp, t.pp, t.dp) == (1, 1, 8) and len(p.ranks["trainer"]) == 8
    assert {p.node_of[x] for x in p.ranks["trainer"]} == {0}
    assert len(p.servers) == 24 and {s.node for s in p.servers} == {1, 2, 3}
    n = 7_615_616_512
    assert param_count(cfg.model) == n == plan.trainer[0].params
    g = plan.busiest_trainer
    assert g.activations == 1536 * 28 * 158720
    assert g.total == 71_647_765_760 < plan.gpu_bytes - 10 * GIB
    gen = plan.generator
    assert gen is not None and gen.weights == 2 * n
    assert gen.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57344
    assert gen.reserved == (512 + 12288 + 128 + 512) * MIB
    assert gen.kv_tokens == (80 * GIB - gen.reserved - 2 * n) // 57344 == 986_594


def test_qwen_gsm8k_tp1_trainer_holds_up_to_about_3_5k_tokens() -> None:
    """The preset's comment: TP1 fits up to a ~3.5k-token context, then needs TP2."""
    at = ("experiment=qwen2_5_7b_gsm8k", "trainer.max_tokens_per_microbatch=null")
    assert plan_cluster(_cfg(*at, "rollout.context_length=3584")).fits
    with pytest.raises(PlanRefused, match=r"trainer GPU .* > cluster.gpu_memory_gb=80"):
        plan_cluster(_cfg(*at, "rollout.context_length=4096"))
    plan_cluster(_cfg(*at, "rollout.context_length=4096", "trainer.tp=2", "trainer.dp=4"))


def test_llama3_math_numbers_by_hand() -> None:
    """2 nodes train at TP2 x DP8, 6 nodes hold 48 TP1 servers. Per trainer GPU (TP2 halves
    all but the 65 norms): 4,015,263,744 params; 6P of weights and grads + 12P/8 of Adam +
    5120 x 32 x 86016 of activations + 5120 x 64128 x 10 of logits + 5 GiB ~ 49.2 GiB. TP1
    on the same 16 GPUs would need ~82.8 GiB: the preset's reason for TP2."""
    cfg = _cfg("experiment=llama3_8b_math")
    plan = plan_cluster(cfg)
    t, p = cfg.trainer, plan.placement
    assert (t.tp, t.pp, t.dp) == (2, 1, 8) and len(p.ranks["trainer"]) == 16
    assert {p.node_of[x] for x in p.ranks["trainer"]} == {0, 1}
    assert len(p.servers) == 48 and {s.node for s in p.servers} == set(range(2, 8))
    g = plan.busiest_trainer
    assert g.params == 4_015_263_744
    assert g.activations == 5120 * 32 * 86016 and g.logits == 5120 * 64128 * 10
    assert 49 * GIB < g.total < 50 * GIB
    with pytest.raises(PlanRefused, match=r"needs 82.8 GB > cluster.gpu_memory_gb=80"):
        plan_cluster(_cfg("experiment=llama3_8b_math", "trainer.tp=1", "trainer.dp=16"))


def test_qwen_trainer_tp3_is_refused_naming_the_heads() -> None:
    """28 heads (and 4 KV heads) split 1, 2 or 4 ways, not 3."""
    from rl.checks import check as validate

    for check in (validate, plan_cluster):
        with pytest.raises(ConfigError) as info:
            check(_cfg("experiment=qwen2_5_7b_gsm8k", "trainer.tp=3"))
        msg = str(info.value)
        assert "trainer.tp=3" in msg and "model.num_attention_heads=28" in msg


def test_cli_plans_the_qwen_gsm8k_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment=qwen2_5_7b_gsm8k"]) == 0
    out = capsys.readouterr().out
    for fragment in (
        "trainer    node 0 (8 GPUs): Megatron TP1 x PP1 x DP8",
        "generator  nodes 1-3 (24 GPUs): 24 SGLang server(s) x TP1",
        "fits: yes",
    ):
        assert fragment in out, f"{fragment!r} not in:\n{out}"


# ---------------------------------------------------------------------- Qwen3 and MoE
def _qwen3_30b_a3b_by_hand() -> tuple[int, int, int, int]:
    """Qwen3-30B-A3B from its published shapes: (total, active per token, one expert, the
    tensors TP copies per layer), written out by hand."""
    h, heads, kv, hd, experts, k, f, vocab, layers = 2048, 32, 4, 128, 128, 8, 768, 151936, 48
    attention = h * (heads + 2 * kv) * hd + heads * hd * h  # fused QKV and o_proj
    copied = 2 * h + 2 * hd + experts * h  # input/post norms, q/k norms, the router
    expert = 3 * h * f  # gate, up, down
    globals_ = 2 * vocab * h + h  # embedding, output layer (untied), final norm
    total = layers * (attention + copied + experts * expert) + globals_
    active = layers * (attention + copied + k * expert) + globals_
    return total, active, expert, copied


def test_qwen3_30b_a3b_parameters_by_hand() -> None:
    """~30.5B parameters in all and ~3.3B per token (top-8 of 128 experts), as published;
    rl/models/arch.py's active_count agrees."""
    total, active, expert, _ = _qwen3_30b_a3b_by_hand()
    assert (total, active) == (30_532_122_624, 3_353_032_704)
    m = _cfg("model=qwen3_30b_a3b").model
    assert param_count(m) == total
    d = Dims.of(m)
    per_layer = active_count(d, m.moe_router_topk)
    assert per_layer == (active - 2 * 151936 * 2048 - 2048) // 48
    assert active_count(d, m.num_experts) - per_layer == 120 * expert


def test_qwen3_30b_a3b_trainer_gpu_by_hand() -> None:
    """TP2 x DP16 x EP4: a GPU holds 32 of the 128 experts of every layer, halved by TP
    (expert TP = TP), whose Adam state the 16 / 4 = 4 replicas of each expert shard; the
    rest is sharded over DP16. Activations per token and layer: bf16 x (8 copies of h for
    the experts' input + (4h + 2q + 2kv + 3 x 8 x 768) / 2, sequence parallel)."""
    cfg = _cfg("experiment=qwen3_30b_a3b_128gpu")
    t = cfg.trainer
    assert (t.tp, t.pp, t.dp, t.ep) == (2, 1, 16, 4)
    total, _, expert, copied = _qwen3_30b_a3b_by_hand()
    experts = 48 * 32 * expert // 2
    assert experts == 3_623_878_656 == stage_expert_params(cfg.model, 2, 1, 4)
    # TP2 halves all but the copies (and the final norm); EP4 keeps a quarter of the experts.
    dense = total - 48 * 128 * expert
    params = (dense - 48 * copied - 2048) // 2 + 48 * copied + 2048 + experts
    assert params == 4_400_822_272
    plan = _plan("experiment=qwen3_30b_a3b_128gpu")
    g = plan.busiest_trainer
    assert g.params == params and (g.weights, g.grads) == (2 * params, 4 * params)
    assert g.optimizer == 12 * (params - experts) // 16 + 12 * experts // 4
    per_token_layer = 2 * (8 * 2048 + (4 * 2048 + 2 * 4096 + 2 * 512 + 3 * 8 * 768) // 2)
    assert per_token_layer == 68608
    assert g.activations == 8192 * 48 * per_token_layer
    assert g.logits == 8192 * (151936 // 2) * (2 + 8)
    assert g.total == 6 * params + g.optimizer + g.activations + g.logits + 5 * GIB
    assert 71 * GIB < g.total < 72 * GIB  # the preset's 71.2 GB
    # Megatron's expert groups: EP fastest inside DP, so each EP group is one node's
    # GPUs at one TP rank and the all-to-all stays on NVLink.
    trainer, node_of = plan.placement.ranks["trainer"], plan.placement.node_of
    for tp_rank in range(t.tp):
        for replica in range(t.dp // t.ep):
            group = [tp_rank + t.tp * (e + t.ep * replica) for e in range(t.ep)]
            assert len({node_of[trainer[r]] for r in group}) == 1
    # The servers: TP2 holds 2 of the 4 KV heads per GPU; DDMA sends every parameter
    # once per server plus the tensors each TP rank holds whole (norms, router) again.
    gen, x = plan.generator, plan.transfer
    assert gen is not None and x is not None and x.fp8_block is None
    assert gen.kv_bytes_per_token == 2 * 48 * 2 * 128 * 2
    assert x.per_server == 2 * (total + 48 * copied + 2048)
    assert x.total == 48 * x.per_server


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (
            ["experiment=qwen3_30b_a3b_128gpu", "trainer.dp=12", "trainer.ep=6"],
            ["trainer.ep=6 does not divide model.num_experts=128"],
        ),
        (
            ["experiment=qwen3_30b_a3b_128gpu", "trainer.tp=8", "trainer.dp=4"],
            ["trainer.tp=8 does not divide model.num_query_groups=4"],
        ),
        (
            ["experiment=qwen3_30b_a3b_128gpu", "trainer.ep=32"],
            ["trainer.ep=32 does not divide trainer.dp=16"],
        ),
        (
            ["experiment=qwen3_235b_a22b_1024gpu", "trainer.pp=4", "trainer.dp=16"],
            ["trainer.pp=4 does not divide model.num_layers=94"],
        ),
    ],
    ids=["ep-experts", "tp-kv-heads", "ep-dp", "pp-layers"],
)
def test_moe_refusals_name_the_field(overrides: list[str], fragments: list[str]) -> None:
    """Refused by validation (at launch) and by the planner alike."""
    from rl.checks import check as validate

    for check in (validate, plan_cluster):
        with pytest.raises(ConfigError) as info:
            check(_cfg(*overrides))
        msg = str(info.value)
        for fragment in fragments:
            assert fragment in msg, f"{fragment!r} not in {msg!r}"


def test_cli_shows_expert_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["experiment=qwen3_30b_a3b_128gpu"]) == 0
    out = capsys.readouterr().out
    for fragment in (
        "Megatron TP2 x PP1 x DP16 (EP4 inside DP)",
        "4.40B params (3.62B in 32 of the 128 routed experts per layer)",
        "Adam 10.7 GB/DP16 (experts /4)",
        "48 SGLang server(s) x TP2",
        "fits: yes",
    ):
        assert fragment in out, f"{fragment!r} not in:\n{out}"


def _with_critic_and_teacher(tmp_path: Path) -> DictConfig:
    """The 8B preset with a critic (TP2 x DP4) and a Llama 3.1 70B teacher (TP8) on two
    model nodes; the teacher's directory holds its config.json only (the planner and the
    simulator read nothing else)."""
    from omegaconf import OmegaConf

    from rl.config.schema import ModelConfig
    from rl.weights.hf_config import hf_config_from_model

    teacher = tmp_path / "llama3_70b"
    teacher.mkdir()
    m70 = OmegaConf.to_object(_cfg("model=llama3_70b").model)
    assert isinstance(m70, ModelConfig)
    (teacher / "config.json").write_text(json.dumps(hf_config_from_model(m70, dtype="bfloat16")))
    (teacher / "model.safetensors").write_bytes(b"")
    models = ["critic=gpu", "algorithm/advantage=gae", "critic.trainer.dp=4", "teacher=gpu",
              f"teacher.hf_checkpoint={teacher}", "algorithm.distill_coef=1"]  # fmt: skip
    return _cfg("experiment=llama3_8b_256gpu", *models, "cluster.nodes=34", "cluster.model_nodes=2")


def _llama_layer(h: int, kv: int, f: int) -> int:
    return h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h


def test_a_critic_and_a_teacher_get_gpus_and_memory_by_hand(tmp_path: Path) -> None:
    """The 8B preset with a critic (the policy's decoder and a scalar head, TP2 x DP4,
    trained) and a Llama 3.1 70B teacher (TP8, frozen) on two model nodes after the
    generation nodes: their ranks follow the others', each on a GPU of its node, and their
    memory is the formulas of rl/plan/memory.py written out."""
    cfg = _with_critic_and_teacher(tmp_path)
    plan = plan_cluster(cfg)
    p = plan.placement
    first = 1 + 64 + 24 + 8  # controller, trainer, generator and reward ranks
    assert p.ranks["critic"] == list(range(first, first + 8))
    assert p.ranks["teacher"] == list(range(first + 8, first + 16))
    assert {p.node_of[r] for r in p.ranks["critic"]} == {32}
    assert {p.node_of[r] for r in p.ranks["teacher"]} == {33}
    assert [p.gpu_of[r] for r in p.ranks["teacher"]] == list(range(8))

    # The critic: the 8B decoder at TP2 with a scalar head [1, h] on every rank instead of
    # the LM head's vocab rows; bf16 weights, fp32 grads, Adam over DP4; no logits.
    n, h, vocab, norms = _llama3_8b_params(), 4096, 128256, 32 * 2 * 4096 + 4096
    params = (n - norms - vocab * h) // 2 + norms + h
    (c,) = plan.models["critic"]
    assert c.params == params
    assert (c.weights, c.grads, c.optimizer) == (2 * params, 4 * params, math.ceil(12 * params / 4))
    assert c.activations == 1 * 8192 * 32 * 1 * 86016 and c.logits == 0
    assert (c.reference, c.buffers, c.overhead) == (0, 0, 4 * GIB)

    # The teacher: Llama 3.1 70B at TP8, frozen: its weights, one layer's activations of a
    # 16384-token micro-batch, the LM head's logits (and fp32 softmax) over 16384 tokens.
    h, kv, f, layers = 8192, 1024, 28672, 80
    per_layer = _llama_layer(h, kv, f)
    n70, norms70 = 2 * vocab * h + layers * per_layer + h, layers * 2 * h + h
    (t,) = plan.models["teacher"]
    assert t.params == (n70 - norms70) // 8 + norms70
    assert (t.weights, t.grads, t.optimizer) == (2 * t.params, 0, 0)
    assert t.activations == 16384 * 2 * (4 * h + (2 * h + 2 * kv + 3 * f) // 8)
    assert t.logits == 16384 * (vocab // 8) * (2 + 8)
    assert plan.fits

    from rl.plan.report import render

    text = render(plan, cfg)
    for line in (
        "  critic     node(s) 32 (8 GPUs): LlamaForSequenceClassification, Megatron TP2 x PP1 "
        "x DP4, bfloat16, trained, global ranks 97-104",
        "  teacher    node(s) 33 (8 GPUs): LlamaForCausalLM, Megatron TP8 x PP1 x DP1, bfloat16, "
        "frozen, global ranks 105-112",
        "memory per teacher GPU (of 80.0 GB), busiest: stage 0, 8.82B params",
    ):
        assert line in text, text


def test_the_simulator_counts_the_critic_and_the_teacher_by_hand(tmp_path: Path) -> None:
    """The step's training phase: the teacher's and the critic's forwards over the step's
    tokens (2 N each), then the longer of the policy's step and the critic's (6 N), each
    over its own 8 GPUs at the hardware's MFU; N with the head the model has (the 70B
    teacher's vocabulary rows, the critic's one)."""
    from rl.simulate.phases import Workload, train_s
    from rl.simulate.simulation import simulate

    cfg = _with_critic_and_teacher(tmp_path)
    w, hw = Workload.of(cfg), cfg.cluster.hardware
    rate = 8 * hw.bf16_tflops * 1e12 * hw.train_mfu  # each has 8 GPUs
    critic = 32 * _llama_layer(4096, 1024, 14336) + 4096
    teacher = 80 * _llama_layer(8192, 1024, 28672) + 128256 * 8192
    before = 2 * (critic + teacher) * w.tokens / rate
    policy = train_s(cfg, w, 64, 32)
    s = simulate(cfg)
    assert s.asyn.train == pytest.approx(before + max(policy, 6 * critic * w.tokens / rate))
    assert s.asyn.train > 10 * policy  # the 70B teacher's forward on 8 GPUs dominates
