"""Config composition and validation: every preset composes, bad launches fail early."""

from __future__ import annotations

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rl.checks import check
from rl.compose import compose
from rl.config import CONF_DIR, ConfigError
from rl.config.schema import ModelConfig, RootConfig
from rl.models.checks import validate_model
from rl.models.shapes import padded_vocab_size, param_count
from tests.helpers.configs import composed


@pytest.mark.parametrize(
    ("preset", "published"),
    [
        ("llama3_8b", 8.03e9),
        ("llama3_70b", 70.6e9),
        ("llama3_405b", 405.9e9),
        ("qwen2_5_7b", 7.62e9),
    ],
)
def test_llama_param_counts_match_published(preset: str, published: float) -> None:
    """Catches a wrong shape in a preset (e.g. ffn size) that validation cannot see."""
    cfg = compose([f"model={preset}"])
    count = param_count(cfg.model)
    assert abs(count - published) / published < 0.01, f"{preset}: {count:.4g}"


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["trainer.tp=4"], ["trainer.tp=4", "model.num_attention_heads=6"]),
        (["trainer.tp=3"], ["trainer.tp=3", "model.num_query_groups=2"]),
        (["model.ffn_hidden_size=513"], ["trainer.tp=2", "model.ffn_hidden_size=513"]),
        (["trainer.pp=3"], ["trainer.pp=3", "model.num_layers=4"]),
        (
            ["model.vocab_size=33"],
            ["trainer.tp=2", "model.vocab_size=33", "model.make_vocab_size_divisible_by=1"],
        ),
        (["trainer.global_batch_size=48"], ["trainer.global_batch_size=48", "64*1=64"]),
        (
            ["trainer.dp=2", "trainer.global_batch_size=64"],
            ["trainer.global_batch_size=64", "trainer.micro_batch_size*dp=64*2=128"],
        ),
        (["trainer.device=tpu"], ["trainer.device='tpu'"]),
        (["trainer.params_dtype=float16"], ["trainer.params_dtype='float16'"]),
        (["trainer.recompute=selective"], ["trainer.recompute='selective'", "('none', 'full')"]),
        (
            ["trainer.lora.rank=4", "trainer.sequence_parallel=true"],
            ["trainer.lora.rank=4", "trainer.tp=2", "trainer.sequence_parallel"],
        ),
        (["trainer.optim.decay_style=exponential"], ["trainer.optim.decay_style='exponential'"]),
        (["trainer.optim.min_lr=0.5"], ["trainer.optim.min_lr=0.5"]),
        (["trainer.micro_batch_size=0"], ["trainer.micro_batch_size=0"]),
        (["model.hidden_size=200"], ["model.num_attention_heads=6", "model.hidden_size=200"]),
        (["model.num_query_groups=4"], ["model.num_query_groups=4"]),
        (["model.hidden_size=198"], ["model.hidden_size=198", "RoPE"]),
        (
            ["model=llama3_8b", "trainer.tp=8", "model.rope_scaling.low_freq_factor=2.0"],
            ["model.rope_scaling.low_freq_factor=2.0", "Megatron-Core"],
        ),
        (["task.digits=30"], ["task.digits=30", "model.max_position_embeddings=64"]),
        (["trainer.optim.warmup_steps=-1"], ["trainer.optim.warmup_steps=-1"]),
        (["rollout.tp=2"], ["rollout.tp=2", "CPU only at tp=1"]),
        (["rollout.dtype=float16"], ["rollout.dtype='float16'"]),
        (["rollout.servers=0"], ["rollout.servers=0"]),
        (["rollout.segment_tokens=0"], ["rollout.segment_tokens=0"]),
        (["rollout.threads=0"], ["rollout.threads=0"]),
        (["rollout.sampling.temperature=-1"], ["rollout.sampling.temperature=-1"]),
        (["rollout.sampling.max_new_tokens=-4"], ["rollout.sampling.max_new_tokens=-4"]),
        (
            ["rollout.weight_sync.transport=nccl"],
            ["rollout.weight_sync.transport='nccl'", "cuda_ipc, ipc, p2p, p2p_shm"],
        ),
        (["rollout.weight_sync.bucket_mb=0"], ["rollout.weight_sync.bucket_mb=0"]),
        (["rollout.weight_sync.relay=ring"], ["rollout.weight_sync.relay='ring'", "chain"]),
        (["rollout.weight_sync.relay_roots=-1"], ["rollout.weight_sync.relay_roots=-1"]),
        (["rollout.weight_sync.relay_fanout=0"], ["rollout.weight_sync.relay_fanout=0"]),
        (["rollout.weight_sync.relay=chain"], ["relay='chain'", "(p2p)", "transport='ipc'"]),
        (
            ["rollout.weight_sync.transport=p2p_shm", "rollout.weight_sync.relay=tree"],
            ["relay='tree'", "(p2p)", "transport='p2p_shm'"],
        ),
        (
            ["experiment=tiny_arithmetic_slurm", "rollout.weight_sync.transport=p2p_shm"],
            ["rollout.weight_sync.transport='p2p_shm'", "one host", "cluster.nodes=2"],
        ),
        (
            ["rollout.weight_sync.transport=cuda_ipc"],
            ["transport='cuda_ipc'", "trainer.device=cuda and rollout.device=cuda", "cpu, cpu"],
        ),
        (["rollout.weight_sync.fp8_block=128"], ["fp8_block=128", "rollout.device=cuda"]),
        (["rollout.device=cuda", "rollout.tp=4"], ["rollout.tp=4", "num_attention_heads=6"]),
        (
            ["rollout.device=cuda", "rollout.weight_sync.fp8_block=128"],
            ["fp8_block=128", "qkv_proj", "not on block boundaries"],
        ),
        (["algorithm.correction.rho=0"], ["algorithm.correction.rho=0", "> 0"]),
        (["algorithm.max_policy_lag=-1"], ["algorithm.max_policy_lag=-1", ">= 0"]),
        (["algorithm.objective.name=dpo"], ["algorithm/objective='dpo'", "pg, ppo_clip"]),
        (
            ["algorithm.group_size=1", "rl.prompts_per_step=64"],
            ["algorithm/advantage=grpo needs", "algorithm.group_size=1"],
        ),
        (
            [
                "algorithm/advantage=reinforce_pp",
                "algorithm.group_size=1",
                "rl.prompts_per_step=64",
                "algorithm.drop_uniform_groups=true",
            ],
            ["algorithm.drop_uniform_groups=true with algorithm.group_size=1"],
        ),
        (["algorithm.stale=wait"], ["algorithm.stale='wait'"]),
        (["reward.fn=regex"], ["reward.fn", "'regex'", "not a built-in"]),
        (["reward.workers=0"], ["reward.workers=0"]),
        (["rl.mode=fast"], ["rl.mode='fast'"]),
        (["rl.resume=sometimes"], ["rl.resume='sometimes'", "'auto' or 'never'"]),
        (["algorithm.max_policy_lag=0"], ["rl.mode=async", "max_policy_lag=0"]),
        (["rl.prompts_per_step=3"], ["rl.prompts_per_step*algorithm.group_size=3*8=24", "64*1"]),
        (["rollout.sampling.temperature=0"], ["rollout.sampling.temperature=0", "explore"]),
        (["rollout.sampling.n=4"], ["rollout.sampling.n=4", "algorithm.group_size=8"]),
        (["rollout.sampling.max_new_tokens=3"], ["max_new_tokens=3", "4 tokens", "digits=2"]),
        (["cluster.roles.reward=0"], ["cluster.roles.reward=0", "rl.steps=200"]),
        (["cluster.roles.generator=2"], ["rollout.servers=1", "cluster.roles.generator=2"]),
        (["sft.optim.lr=0"], ["sft.optim.lr=0"]),
        (["rl.steps=-1"], ["rl.steps=-1"]),
        (["cluster.nodes=0"], ["cluster.nodes=0", "integer >= 1"]),
        (["cluster.gpu_memory_gb=0"], ["cluster.gpu_memory_gb=0"]),
        (["cluster.nodes=2"], ["cluster.nodes=2", "cluster.name=local"]),
        (
            ["trainer.max_tokens_per_microbatch=512", "trainer.pp=2", "trainer.packing=false"],
            ["trainer.max_tokens_per_microbatch=512", "trainer.packing=false", "trainer.pp=2"],
        ),
        (["trainer.max_tokens_per_microbatch=0"], ["trainer.max_tokens_per_microbatch=0"]),
        (["trainer.attention=dot_product"], ["trainer.packing=true", "trainer.attention=sdpa"]),
        (["trainer.cp=2", "trainer.packing=false"], ["trainer.cp=2", "trainer.packing=true"]),
        (
            ["trainer.cp=2", "trainer.max_tokens_per_microbatch=514"],
            ["trainer.cp=2", "trainer.max_tokens_per_microbatch=514", "2*cp=4"],
        ),
        (["trainer.cp=2", "model=tiny_moe"], ["trainer.cp=2", "model.num_experts=4"]),
        (["algorithm.correction.name=vtrace"], ["algorithm/correction='vtrace'", "icepop"]),
        (
            ["algorithm.correction.name=tis"],
            ["algorithm.correction.name='tis'", "AipoConfig", "algorithm/correction=tis"],
        ),
        (["algorithm/correction=tis", "algorithm.correction.clip=0"], ["correction.clip=0"]),
        (
            ["algorithm=grpo", "algorithm/correction=tis"],
            ["algorithm.correction='tis'", "objective=ppo_clip"],
        ),
        (["algorithm.overlong=truncate"], ["algorithm.overlong='truncate'", "penalise"]),
        (["reward.fn=no/such/file.py:score"], ["reward.fn 'no/such/file.py:score'"]),
        (
            ["reward.fn=json:dumps"],
            ["reward.fn 'json:dumps'", "must take (prompt, response, label, metadata)"],
        ),
        (["task.name=gsm8k"], ["task='gsm8k'", "arithmetic, dataset"]),
        (["task.name=dataset"], ["task.name='dataset'", "ArithmeticTaskConfig", "task=dataset"]),
        (["trainer.lora.rank=-1"], ["trainer.lora.rank=-1", ">= 0"]),
        (["trainer.lora.rank=4", "trainer.lora.targets=[mlp]"], ["targets=['mlp']", "qkv"]),
        (["trainer.lora.rank=4", "trainer.lora.dropout=1.0"], ["trainer.lora.dropout=1.0"]),
        (["trainer.lora.rank=4", "trainer.lora.alpha=0"], ["trainer.lora.alpha=0"]),
        (["model=tiny_moe", "trainer.lora.rank=4"], ["trainer.lora.targets", "experts"]),
        (
            ["model=tiny_moe", "trainer.lora.rank=4", "trainer.lora.targets=[qkv,proj]"],
            ["trainer.lora.rank=4", "sequence parallelism"],
        ),
        (["rl.eval_k=0"], ["rl.eval_k=0"]),
    ],
    ids=[
        "tp-heads",
        "tp-groups",
        "tp-ffn",
        "pp-layers",
        "tp-vocab",
        "gbs-mbs",
        "gbs-mbs-dp",
        "device",
        "dtype",
        "recompute",
        "lora-sequence-parallel",
        "decay-style",
        "min-lr",
        "mbs-positive",
        "heads-hidden",
        "groups-heads",
        "rope-odd-head-dim",
        "rope-scaling-constant",
        "task-too-long",
        "negative-warmup",
        "rollout-tp-cpu",
        "rollout-dtype",
        "rollout-servers",
        "rollout-segment",
        "rollout-threads",
        "rollout-temperature",
        "rollout-max-new-tokens",
        "sync-transport",
        "sync-bucket",
        "sync-relay",
        "sync-relay-roots",
        "sync-relay-fanout",
        "relay-needs-p2p",
        "relay-needs-p2p-not-shm",
        "p2p-shm-one-host",
        "cuda-ipc-needs-cuda",
        "sync-fp8-cpu",
        "sync-dst-tp-heads",
        "sync-fp8-blocks",
        "alg-rho",
        "alg-lag",
        "alg-name",
        "alg-group",
        "alg-drop-one-sample",
        "alg-stale",
        "reward-scorer",
        "reward-workers",
        "rl-mode",
        "rl-resume",
        "rl-async-needs-lag",
        "rl-batch-mbs",
        "rl-greedy",
        "rl-sampling-n",
        "rl-answer-length",
        "roles-reward",
        "roles-servers",
        "sft-optim",
        "rl-steps",
        "cluster-nodes",
        "cluster-gpu-memory",
        "cluster-local-multinode",
        "budget-pp",
        "budget-positive",
        "packing-dot-product",
        "cp-needs-packing",
        "cp-budget",
        "cp-moe",
        "alg-correction",
        "alg-correction-fields",
        "alg-tis-clip",
        "alg-grpo-correction",
        "alg-overlong",
        "reward-fn-file",
        "reward-fn-signature",
        "task-name",
        "task-fields",
        "lora-rank",
        "lora-targets",
        "lora-dropout",
        "lora-alpha",
        "lora-experts",
        "lora-sequence-parallel",
        "rl-eval-k",
    ],
)
def test_validation_error_names_field_and_value(overrides: list[str], fragments: list[str]) -> None:
    """A bad launch must fail in the launcher with a message that says what to change."""
    cfg = composed(overrides)
    with pytest.raises(ConfigError) as info:
        check(cfg)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


def test_config_error_is_value_error() -> None:
    """Callers catching ValueError (the CLI) must also catch config errors."""
    assert issubclass(ConfigError, ValueError)


def test_vocab_padding_fixes_indivisible_vocab() -> None:
    """make_vocab_size_divisible_by is the advertised fix for a vocab TP does not divide."""
    cfg = composed(["model.vocab_size=33", "model.make_vocab_size_divisible_by=8"])
    check(cfg)
    assert padded_vocab_size(cfg.model) == 40
    # The padding rows are counted in both the embedding and the untied output layer.
    assert param_count(cfg.model, padded=True) - param_count(cfg.model) == 2 * 7 * 192


def test_world_size_mismatch() -> None:
    """The launched world must be exactly the role map, or ranks would be left without a
    role (or roles without ranks)."""
    cfg = composed([])
    check(cfg, world_size=5)
    with pytest.raises(ConfigError) as info:
        check(cfg, world_size=3)
    msg = str(info.value)
    assert "started 3 ranks" in msg
    assert "controller 1 + trainer 2 + generator 1 + reward 1 = 5 ranks" in msg


def test_missing_model_field_raises() -> None:
    """A preset that forgets a required shape must not validate with a default."""
    model = OmegaConf.structured(ModelConfig)
    with pytest.raises(MissingMandatoryValue, match="num_layers"):
        validate_model(model)
    with pytest.raises(MissingMandatoryValue, match="model"):
        check(OmegaConf.structured(RootConfig))


def test_missing_value_from_override_raises() -> None:
    """`???` on the command line composes, but validation refuses it, naming the field."""
    cfg = compose(["model.hidden_size=???"])
    with pytest.raises(MissingMandatoryValue, match=r"model\.hidden_size"):
        check(cfg)


def _composition_error_text(overrides: list[str]) -> str:
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as info:
        compose(overrides)
    err: BaseException | None = info.value
    parts = []
    while err is not None:
        parts.append(str(err))
        err = err.__cause__
    return "\n".join(parts)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.tpp=2"], "tpp"),
        (["trainer.tp=two"], "two"),
        (["model=llama3_9b"], "llama3_9b"),
        (["trainer.optim.lr=fast"], "fast"),
        (["rollout.sever=2"], "sever"),
        (["rollout.sampling.temprature=0.5"], "temprature"),
        (["algorithm/correction=icepop", "algorithm.correction.rho=2"], "rho"),
        (["algorithm/correction=tis", "algorithm.correction.clip=wide"], "wide"),
        (["algorithm/correction=vtrace"], "vtrace"),
        (["task=dataset", "task.digits=3"], "digits"),
        (["algorithm.correction=tis"], "pick it with algorithm/correction=tis"),
    ],
    ids=[
        "unknown-key",
        "bad-int",
        "unknown-preset",
        "bad-float",
        "rollout-key",
        "sampling-key",
        "other-correction-key",
        "correction-type",
        "unknown-correction",
        "other-task-key",
        "choice-as-value",
    ],
)
def test_hydra_rejects_bad_overrides(overrides: list[str], needle: str) -> None:
    """Typos and wrong types fail at composition, before any process is spawned."""
    assert needle in _composition_error_text(overrides)


def test_root_config_does_not_chdir() -> None:
    """Relative paths (checkpoints, conf/) must resolve from the launch directory."""
    data = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    assert data["hydra"]["job"]["chdir"] is False


@pytest.mark.parametrize(
    "overrides",
    [
        ["experiment=llama3_405b_1024gpu", "trainer.tp=4", "rollout.context_length=null"],
        ["algorithm=grpo", "algorithm.objective.clip_eps=0.1"],
        ["algorithm/correction=icepop", "algorithm.correction.beta=3"],
        ["task=dataset", "task.train_files=[a.jsonl]", "cluster.roles.generator=0"],
        ["trainer.optim.lr=1e-3", "~experiment", "model.hidden_size=???"],
    ],
)
def test_the_tests_fast_compose_gives_hydras_config(overrides: list[str]) -> None:
    """tests/helpers/configs.py applies value overrides itself: it must agree with Hydra."""
    want = OmegaConf.to_container(compose(overrides))
    assert OmegaConf.to_container(composed(overrides)) == want


def test_a_launch_says_its_sizes_and_warns_of_the_tiny_defaults_for_an_hf_model() -> None:
    from rl.train import settings

    tiny = settings(composed([]))
    assert len(tiny) == 1 and tiny[0].startswith("settings (tiny_arithmetic): sft.steps=600")
    hf = settings(composed(["model.hf_checkpoint=/ckpts/m", "task=dataset"]))
    assert hf[1].startswith("warning: model.hf_checkpoint runs with the embedded default's")
    own = settings(composed(["experiment=hf_model", "model.hf_checkpoint=/ckpts/m"]))
    assert own == [
        "settings (hf_model): sft.steps=0, rl.steps=200 of 8 prompts x 8 samples, up to 512 "
        "new tokens each, task.eval_size=64"
    ]


def test_a_launch_with_the_python_tool_warns_when_host_sockets_are_in_reach(monkeypatch):
    from rl.envs import sandbox
    from rl.train import settings

    tools = ["env.tools=[python]", "env.chat_template=chatml_tools"]
    monkeypatch.setattr(sandbox, "containment", lambda: ("namespaces", "rlimits"))
    root, syscalls = [x for x in settings(composed(tools)) if x.startswith("warning: ")]
    assert root.startswith("warning: sandbox: no private root on this machine")
    assert syscalls.startswith("warning: sandbox: no seccomp filter on this machine")
    monkeypatch.setattr(sandbox, "containment", lambda: ("private-root", "seccomp"))
    assert not [x for x in settings(composed(tools)) if x.startswith("warning: ")]
