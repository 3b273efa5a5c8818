"""Rank functions for the job tests (module level, so spawned ranks import them)."""

from __future__ import annotations

from rl.batch import TrainBatch


def checkpoint_logits(hf_dir: str, ckpt: str, tokens, extra: list[str]):
    """Logits of the Megatron checkpoint ``ckpt`` (of the model in ``hf_dir``) at TP=1."""
    from rl.checks import resolve_model
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    rows = tokens.shape[0]
    cfg = compose([f"model.hf_checkpoint={hf_dir}", "trainer.tp=1", *extra,
                   "trainer.micro_batch_size=1", f"trainer.global_batch_size={rows}"])  # fmt: skip
    resolve_model(cfg)
    tr = build_trainer(cfg.model, cfg.trainer, total_steps=1, frozen=True)
    tr.load(ckpt, load_optimizer=False)
    return tr.logits(TrainBatch(tokens))[..., : cfg.model.vocab_size]
