"""The main job. Launch (from the repo root; the README's `make run` does this):

    python -m rl.train                                # embedded default (tiny, CPU, TP=2)
    python -m rl.train experiment=tiny_sft trainer.tp=1 sft.steps=50
    torchrun --nproc-per-node 2 -m rl.train ...       # ranks started by torchrun/srun

The config is composed and validated in this process before any rank is started; then
every rank builds the Megatron trainer and runs the supervised warm-up (the RL loop joins
here in later stages). Rank 0 prints a line per step and writes metrics.jsonl, TensorBoard
events, a PNG of the curves and a torch_dist checkpoint under run.output_dir.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from rl.config import ConfigError, register, validate
from rl.dist.launch import setup_rank, spawn, under_launcher


def run(cfg: DictConfig) -> dict[str, float]:
    """One rank's whole job; returns the final metrics (same on every rank)."""
    from rl.metrics import MetricsLogger, plot_curves
    from rl.tasks.arithmetic import AdditionTask
    from rl.trainer.trainer import build_trainer
    from rl.warmup import supervised_warmup

    setup_rank(cfg.trainer.device, cfg.trainer.threads_per_rank)
    out = Path(cfg.run.output_dir)
    rank0 = dist.get_rank() == 0
    log = MetricsLogger(out, enabled=rank0, total_steps=cfg.sft.steps)
    task = AdditionTask(cfg.task.digits, cfg.task.seed, cfg.task.eval_size)
    trainer = build_trainer(cfg.model, cfg.trainer, total_steps=cfg.sft.steps)
    if cfg.trainer.load_dir:
        trainer.load(cfg.trainer.load_dir, cfg.trainer.load_optimizer)

    ckpt = cfg.trainer.save_dir or str(out / "checkpoint")
    acc = supervised_warmup(trainer, task, cfg.sft, log, ckpt, cfg.trainer.save_interval)
    trainer.save(ckpt)
    log.close()
    if rank0:
        png = plot_curves(out / "metrics.jsonl", out / "curves.png", ("loss", "eval_accuracy"))
        print(f"done: held-out accuracy {acc:.3f}; metrics, plot ({png}) and checkpoint in {out}")
    return {"eval_accuracy": acc}


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    t = cfg.trainer
    world = int(os.environ["WORLD_SIZE"]) if under_launcher() else t.tp * t.pp * t.dp
    try:
        validate(cfg, world_size=world)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    if under_launcher():
        run(cfg)
    else:
        print(f"starting {world} rank(s): tp={t.tp} pp={t.pp} dp={t.dp} on {t.device}")
        print(OmegaConf.to_yaml(cfg), flush=True)
        spawn(run, world, cfg, device=t.device, threads=t.threads_per_rank)


if __name__ == "__main__":
    register()
    main()
