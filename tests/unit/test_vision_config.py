"""A vision-language model's config and batch rows, in milliseconds: config.json both ways,
the one-line refusals, and the rows' images as the model takes them (which embedding
goes where, and a sampled image token refused)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from rl.batch import TrainBatch
from rl.checks import check
from rl.config import ConfigError
from rl.models.checks import validate_model, validate_trainer
from rl.models.shapes import param_count, tower_param_count
from rl.models.vision.inputs import vision_input
from rl.weights.hf_config import HFConfigError, hf_config_from_model, model_config_from_hf
from tests.helpers.configs import composed
from tests.helpers.hf_models import tiny_models
from tests.helpers.vision_models import image_batch, tiny

VL = "Qwen2_5_VLForConditionalGeneration"


KINDS = tiny_models(vision=True)


def _hf(kind: str = "qwen2_5_vl", **changes) -> dict:
    """The tiny model's config.json as transformers writes it."""
    import transformers

    arch = KINDS[kind]
    conf = transformers.AutoConfig.for_model(arch.model_type, **tiny(kind)).to_dict()
    conf["architectures"] = [arch.hf_class]
    conf.update(changes)
    return conf


@pytest.fixture(scope="module")
def model():
    return model_config_from_hf(_hf(), name="vl")


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_vision_family_reads_and_writes_its_config_json(kind: str) -> None:
    import transformers

    m = model_config_from_hf(_hf(kind), name=kind)
    validate_model(m)
    back = hf_config_from_model(m)
    assert model_config_from_hf(back, name=kind) == m
    fields = {k: v for k, v in back.items() if k != "model_type"}
    conf = transformers.AutoConfig.for_model(KINDS[kind].model_type, **fields)
    assert conf.text_config.num_hidden_layers == m.num_layers
    assert conf.text_config.rope_parameters["mrope_section"] == m.vision.mrope_section


def test_qwen3_vl_deepstack_refusals() -> None:
    m = model_config_from_hf(_hf("qwen3_vl"))
    assert m.qk_norm and m.head_dim == 32 and m.vision.tower["deepstack_visual_indexes"] == [0, 1]
    cfg = composed(["trainer.recompute=full"])
    with pytest.raises(ConfigError, match=r"trainer.recompute=full with .* deepstack"):
        validate_trainer(cfg.trainer, m)
    cfg = composed(["trainer.pp=4", "trainer.tp=1"])
    with pytest.raises(ConfigError, match=r"trainer.pp=4 puts fewer than the 2 deepstack layers"):
        validate_trainer(cfg.trainer, m)


def test_config_json_both_ways(model) -> None:
    assert model.architecture == VL and model.qkv_bias and model.num_layers == 2
    v = model.vision
    assert v is not None and v.image_token_id == 150 and v.mrope_section == [2, 3, 3]
    assert v.tower["depth"] == 2 and v.tower["fullatt_block_indexes"] == [1]
    back = hf_config_from_model(model)
    assert back["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert back["vision_config"]["out_hidden_size"] == 64
    assert model_config_from_hf(back, name="vl") == model
    import transformers

    conf = transformers.Qwen2_5_VLConfig(**back)  # transformers reads it as the same model
    assert conf.text_config.hidden_size == 64 and conf.vision_config.depth == 2
    for tied in (True, False):
        m = model_config_from_hf(_hf(tie_word_embeddings=tied))
        assert m.tie_embeddings is tied
        assert hf_config_from_model(m)["tie_word_embeddings"] is tied


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"text_config": None}, "text_config=None must be a dict"),
        ({"vision_config": "x"}, "vision_config='x' must be a dict"),
        ({"image_token_id": None}, "'image_token_id' is missing"),
    ],
)
def test_bad_config_json_is_one_line(changes, message) -> None:
    with pytest.raises(HFConfigError, match=message):
        model_config_from_hf(_hf(**changes))


def test_bad_mrope_section_is_one_line() -> None:
    conf = _hf()
    conf["text_config"]["rope_parameters"]["mrope_section"] = [2, 3]
    with pytest.raises(HFConfigError, match=r"mrope_section=\[2, 3\] must list 3"):
        model_config_from_hf(conf)


def test_model_refusals(model) -> None:
    with pytest.raises(ConfigError, match=r"model.vision is missing: .* vision-language family"):
        validate_model(replace(model, vision=None))
    text = OmegaConf.to_object(composed().model)
    with pytest.raises(ConfigError, match=r"model.vision is set: .* text-only family"):
        validate_model(replace(text, vision=model.vision))
    with pytest.raises(ConfigError, match=r"model.train_vision=true with .* no vision tower"):
        validate_model(replace(text, train_vision=True))
    bad = replace(model.vision, mrope_section=[2, 3, 2])
    with pytest.raises(ConfigError, match=r"mrope_section=\[2, 3, 2\] must be .* = 8"):
        validate_model(replace(model, vision=bad))
    cfg = composed(["trainer.cp=2", "trainer.tp=1", "trainer.max_tokens_per_microbatch=64"])
    with pytest.raises(ConfigError, match=r"trainer.cp=2 with a vision-language model"):
        validate_trainer(cfg.trainer, model)


def test_a_vision_job_without_a_checkpoint_or_with_a_model_executor_is_refused(model) -> None:
    from rl.checks import check_job

    cfg = composed()
    cfg.model = model
    with pytest.raises(ConfigError, match=r"needs model.hf_checkpoint: its image processor"):
        check_job(cfg)  # the planner's check() takes the model YAML's shape
    cfg.model.max_pixels = 0
    with pytest.raises(ConfigError, match=r"model.max_pixels=0 must be >= 1"):
        check(cfg)
    cfg.model.max_pixels = None
    cfg.critic.enabled = True
    with pytest.raises(ConfigError, match=r"critic.enabled=true .* the critic's forward takes no"):
        check(cfg)


def test_each_image_embedding_goes_to_its_own_pads() -> None:
    rows = [([3], [(1, 4, 4)]), ([2, 10], [(1, 4, 6), (1, 2, 2)]), ([], [])]
    b = image_batch(rows, 24)
    v = vision_input(b.tokens, b.pixel_values, b.image_grids, image_token_id=150, merge=2)
    assert v is not None
    assert v.grid_thw.tolist() == [[1, 4, 4], [1, 4, 6], [1, 2, 2]]
    assert v.pixel_values.shape[0] == 16 + 24 + 4
    assert torch.equal(v.pixel_values[:16], b.pixel_values[0, :16])
    assert torch.equal(v.pixel_values[16:], b.pixel_values[1, :28])
    # Embeddings in image order: row 0's 4, then row 1's 6 and 1; -1 elsewhere.
    assert v.slots[0, 3:7].tolist() == [0, 1, 2, 3]
    assert v.slots[1, 2:8].tolist() == [4, 5, 6, 7, 8, 9] and v.slots[1, 10] == 10
    assert int((v.slots >= 0).sum()) == 11 and (v.slots[2] == -1).all()
    text = image_batch([([], [])], 8)
    assert vision_input(text.tokens, text.pixel_values, text.image_grids,
                        image_token_id=150, merge=2) is None  # fmt: skip


def test_an_image_token_outside_the_images_is_refused() -> None:
    b = image_batch([([3], [(1, 4, 4)]), ([2], [(1, 2, 2)])], 16)
    b.tokens[1, 12] = 150  # a response that sampled the image token
    with pytest.raises(ValueError, match=r"row 1 holds 2 image-pad tokens .* images take 1"):
        vision_input(b.tokens, b.pixel_values, b.image_grids, image_token_id=150, merge=2)


def test_column_cuts_leave_the_images_alone() -> None:
    """Per-row image fields survive a cut even when their second dimension is the width."""
    b = image_batch([([0], [(1, 4, 4)])], 16)  # 16 patches in a 16-token row
    assert b.pixel_values is not None and b.pixel_values.shape[1] == b.seq
    cut = b.per_token(lambda t: t[:, :8])
    assert cut.tokens.shape[1] == 8 and cut.positions.shape[1] == 8
    assert torch.equal(cut.pixel_values, b.pixel_values)
    wide = b.pad_columns(2)
    assert wide.tokens.shape[1] == 18 and torch.equal(wide.image_grids, b.image_grids)
    assert TrainBatch.__dataclass_fields__["pixel_values"].default is None


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_the_planners_tower_count_is_transformers_own(kind) -> None:
    """The family's formula (rl/models/vl_fields.py) against the module transformers builds,
    for the tiny model and for transformers' default (full-size) vision config."""
    import transformers

    from rl.models import registry

    arch = registry.get(tiny_models(vision=True)[kind].hf_class)
    assert arch.vision is not None
    for fields in (tiny(kind)["vision_config"], {}):
        conf = getattr(transformers, arch.vision.config_class)(**fields)
        with torch.device("meta"):
            module = getattr(transformers, arch.vision.tower_class)._from_config(conf)
        want = sum(p.numel() for p in module.parameters())
        assert arch.vision.params(conf.to_dict()) == want
    m = model_config_from_hf(_hf(kind), name=kind)
    assert tower_param_count(m) == arch.vision.params(tiny(kind)["vision_config"])
    assert param_count(m) - tower_param_count(m) == param_count(replace(m, vision=None))
