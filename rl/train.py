"""The main job: one controller driving the trainer, generator and reward executors.

Launch from the repo root (the README's ``make run`` runs the first line):

    python -m rl.train                                  # embedded default: tiny_arithmetic
    python -m rl.train rl.mode=sync                     # the synchronous baseline
    python -m rl.train experiment=tiny_sft              # supervised warm-up only
    python -m rl.runtime.torchrun --nproc-per-node 5 -m rl.train ...  # torchrun / srun

The config is composed and validated here before any rank starts. One launch starts every
rank; the role map (rl/config/roles.py) makes rank 0 the controller, then come the
trainer ranks (Megatron, tp*pp*dp), the generator ranks (SGLang servers) and the reward
ranks, each executor on a process group of its own. The trainer warms the policy up on
the task, then the controller runs the loop (rl/controller/loop.py): rollouts stream from
the generator (up to ``algorithm.max_policy_lag`` versions ahead in async mode), are
scored by the reward ranks, trained on with AIPO, and the new weights go from trainer
shards straight into the servers (DDMA) after every step.
"""

from __future__ import annotations

import contextlib
import os
import sys
from functools import partial
from typing import TYPE_CHECKING, NoReturn

import hydra
from omegaconf import OmegaConf

from rl.compose import register
from rl.config.roles import COMPANIONS, RoleMap
from rl.runtime.launch import (
    RankFailed,
    Stopped,
    install_thread_hook,
    quiet_known_warnings,
    spawn,
    under_launcher,
)

if TYPE_CHECKING:
    from rl.config.schema import RootConfig


def run(cfg: RootConfig) -> dict[str, float | None]:
    """One rank of the job: join it, then act as the role the role map gives this rank."""
    import threading

    from rl.runtime.job import join, place

    quiet_known_warnings()
    if threading.excepthook is threading.__excepthook__:  # torchrun: our spawner sets its own
        install_thread_hook()  # a thread that dies ends this rank, so the launcher sees it
    role, role_rank, role_size = place(cfg)
    if role == "generator":  # its servers import SGLang while the other ranks start
        from rl.generator import service
        from rl.generator import startup as gen

        launched = service.launch(gen.settings(cfg), role_rank, role_size,
                                  model_path=partial(gen.model_path, cfg))  # fmt: skip
    job = join(cfg, cfg.trainer.device)
    _title(f"msrl:{job.role}:{job.role_rank}")
    if node := os.environ.get("SLURMD_NODENAME"):  # where each rank runs, for operators
        print(f"[job] {job.role} {job.role_rank} on {node} (rank {job.rank})", flush=True)
    try:
        if job.role == "controller":
            from rl.controller.loop import controller

            return controller(cfg, job)
        if job.role == "trainer":
            from rl.generator.ddma_target import SGLangTarget
            from rl.trainer import startup
            from rl.trainer.service import serve as serve_trainer

            # The trainer pushes weights into SGLang servers without knowing the generator.
            serve_trainer(startup.settings(cfg), job, start=partial(startup.start, cfg),
                          make_target=SGLangTarget)  # fmt: skip
            return {}
        if job.role == "generator":
            service.serve(gen.settings(cfg), job, launched)
            return {}
        if job.role in COMPANIONS:
            from rl.companion import settings_of
            from rl.companion.service import serve as serve_model

            serve_model(settings_of(cfg, job.role), job)
            return {}
        from rl.reward.service import serve as serve_reward

        serve_reward(cfg.reward, job, output_dir=cfg.run.output_dir)
        return {}
    finally:
        job.finish()


def _title(title: str) -> None:
    """Name this rank's process after its role, for ps and top (best effort)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: RootConfig) -> None:
    from rl.checkpoints import resume
    from rl.runtime import secret

    # Checked already (rl.checks.PrelaunchCheck, a Hydra callback run before Hydra wrote
    # anything): the model resolved, every value, the task's data, the files it names and
    # a restarted job's resume state.
    try:  # the control plane's key: every rank (and node) reads the same 0600 file
        secret.ensure(cfg.run.output_dir)
    except (OSError, secret.SecretError) as e:
        sys.exit(f"job secret: {e}")
    if under_launcher():
        run(cfg)
        return
    roles, t = RoleMap.from_config(cfg), cfg.trainer
    print("\n".join(settings(cfg)), flush=True)
    cp = f" cp={t.cp}" if t.cp > 1 else ""
    packed = "packed" if t.packing else "padded"
    print(f"starting {roles.describe()}: trainer tp={t.tp} pp={t.pp} dp={t.dp}{cp} on "
          f"{t.device}, {packed} micro-batches")  # fmt: skip
    print(OmegaConf.to_yaml(cfg), flush=True)
    try:
        # A generator rank needs no Megatron-Core: started fresh, it runs (and starts its
        # servers) while the other ranks' fork server still imports it.
        spawn(run, roles.world_size, cfg, device=t.device, timeout_s=24 * 3600, setup=False,
              names=lambda r: "{} rank {}".format(*roles.role_of(r)),
              saved=lambda: resume.describe(cfg.run.output_dir),
              fresh_ranks=roles.ranks("generator"))  # fmt: skip
    except Stopped as e:  # SIGTERM/SIGINT: every rank and server is gone; one line says so
        _leave(e.exit_code, str(e))
    except RankFailed as e:
        _leave(1, f"error: {e}")
    _leave(0)


def settings(cfg: RootConfig) -> list[str]:
    """The run's sizes in one line, as launched; and a warning when an HF model runs with
    the embedded default's settings (sized for its 1.6M-parameter model)."""
    r, a, s = cfg.rl, cfg.algorithm, cfg.rollout.sampling
    lines = [
        f"settings ({cfg.run.name}): sft.steps={cfg.sft.steps}, rl.steps={r.steps} of "
        f"{r.prompts_per_step} prompts x {a.group_size} samples, up to {s.max_new_tokens} "
        f"new tokens each, task.eval_size={cfg.task.eval_size}"
    ]
    if cfg.model.hf_checkpoint and cfg.run.name == "tiny_arithmetic":
        lines.append(
            "warning: model.hf_checkpoint runs with the embedded default's settings "
            "(experiment=tiny_arithmetic, sized for a 1.6M-parameter model): for your model, "
            "start from experiment=hf_model"
        )
    if "python" in cfg.env.tools:
        from rl.envs.sandbox import launch_warnings

        lines += [f"warning: {line}" for line in launch_warnings()]
    return lines


def _leave(code: int, message: str | None = None) -> NoReturn:
    """Exit now that every process of the job is gone, skipping the interpreter's teardown
    of this process's ~1400 modules (2 s on a busy CPU machine) and Hydra's epilogue: after
    ``done:`` or a stop, nothing is left to write but this process's own last line."""
    if message is not None:
        print(message, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def check_overrides(argv: list[str]) -> None:
    """Exit with one line on an override or config group Hydra cannot compose (its own
    report takes 6-20 lines). Hydra's flags (``--help``, ``--cfg``, ``-m``) and ``hydra.*``
    overrides are left to Hydra."""
    if any(a.startswith("-") for a in argv):
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rl.compose import compose
    from rl.config import composition_error

    try:
        compose([a for a in argv if not a.lstrip("+~").startswith("hydra.")])
    except (HydraException, OmegaConfBaseException) as e:
        sys.exit(f"config error: {composition_error(e)}")


if __name__ == "__main__":
    register()
    check_overrides(sys.argv[1:])
    main()
