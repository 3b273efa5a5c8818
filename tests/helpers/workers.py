"""Rank functions for the multi-process tests (module level, so spawned ranks import them)."""

from __future__ import annotations

import torch

from rl.batch import TrainBatch


def random_batches(steps: int, rows: int = 8, seq: int = 16, vocab: int = 32) -> list[dict]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        tokens = torch.randint(3, vocab, (rows, seq), generator=g)
        mask = (torch.rand(rows, seq, generator=g) < 0.8).float()
        mask[:, -1] = 0.0
        out.append(TrainBatch(tokens, mask))
    return out


def run_layout(
    overrides: list[str],
    batches: list[dict],
    save_init: str | None = None,
    load: str | None = None,
    load_optimizer: bool = False,
    save_final: str | None = None,
    probe: dict | None = None,
) -> dict:
    """Build a trainer for ``overrides``, optionally load/save, train on ``batches``.

    Returns per-step losses and grad norms, the log-probs of ``probe`` (default: the first
    batch) before and after each
    step, and the number of parameters this rank holds (to show the model is sharded).
    """
    from rl.algorithms.losses import nll_loss
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    cfg = compose(overrides)
    tr = build_trainer(cfg.model, cfg.trainer, total_steps=max(len(batches), 1))
    if save_init:
        tr.save(save_init)
    if load:
        tr.load(load, load_optimizer=load_optimizer)
    if probe is None:
        probe = batches[0] if batches else random_batches(1)[0]
    res: dict = {"losses": [], "grad_norms": [], "logprobs": [tr.logprobs(probe)]}
    # Forwards of this rank's first layer's MLP in training: once per micro-batch, twice
    # when the backward recomputes the layer.
    training, calls = [False], [0]
    mlp = tr.model.module.decoder.layers[0].mlp
    mlp.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + training[0]))
    for b in batches:
        training[0] = True
        m = tr.train_step(b, nll_loss)
        training[0] = False
        res["losses"].append(m["loss"])
        res["grad_norms"].append(m["grad_norm"])
        for k in ("moe_aux_loss", "moe_max_expert_load"):
            if k in m:
                res.setdefault("metrics", {}).setdefault(k, []).append(m[k])
        res["logprobs"].append(tr.logprobs(probe))
    if save_final:
        tr.save(save_final)
    res["local_params"] = sum(p.numel() for p in tr.model.module.parameters())
    res["layout"] = (tr.layout.tp, tr.layout.pp, tr.layout.dp)
    res["mlp_forwards"] = calls[0]
    res["sequence_parallel"] = tr.model.module.config.sequence_parallel
    res["step"] = tr.step
    return res


def convert_then_load(
    hf_dir: str, out: str, m, tp: int, pp: int, dtype: str, rows: int, ep: int, more: tuple = ()
):
    """Convert HF -> Megatron on this world, then load it into a frozen trainer (``more``:
    further trainer overrides)."""
    from rl.compose import compose
    from rl.engine.trainer import build_trainer
    from rl.weights.convert import hf_to_mcore_rank

    summary = hf_to_mcore_rank(hf_dir, out, m, tp, pp, dtype, ep)
    overrides = [f"trainer.tp={tp}", f"trainer.pp={pp}", "trainer.micro_batch_size=1"]
    overrides += [f"trainer.ep={ep}", f"trainer.dp={ep}"]
    overrides += [f"trainer.global_batch_size={rows}", f"trainer.params_dtype={dtype}", *more]
    tr = build_trainer(m, compose(overrides).trainer, total_steps=1, frozen=True)
    tr.load(out, load_optimizer=False)
    return tr, summary


def convert_then_values(
    hf_dir: str, out: str, m, tp: int, pp: int, dtype: str, tokens, more: tuple = ()
):
    """A scalar-head model's values ``[B, S]`` after conversion at this layout."""
    tr, _ = convert_then_load(hf_dir, out, m, tp, pp, dtype, tokens.shape[0], 1, more)
    assert tr.config.sequence_parallel == ("trainer.sequence_parallel=true" in more)
    return tr.values(TrainBatch(tokens))


def convert_then_logits(
    hf_dir: str, out: str, m, tp: int, pp: int, dtype: str, tokens, temps: tuple = (), ep: int = 1
):
    """Convert HF -> Megatron on this world, then load it into a trainer and return logits
    (and per-token log-probs at each temperature in ``temps``)."""
    tr, summary = convert_then_load(hf_dir, out, m, tp, pp, dtype, tokens.shape[0], ep)
    logprobs = {}
    for t in temps:
        tr.temperature = t
        logprobs[t] = tr.logprobs(TrainBatch(tokens))
    return {"logits": tr.logits(TrainBatch(tokens)), "summary": summary, "logprobs": logprobs}


def budget_parity(overrides: list[str], batch: dict, budget: int) -> dict:
    """One optimizer step with ``micro_batch_size`` micro-batches, then the same from the
    same initial weights with ``trainer.max_tokens_per_microbatch=budget``. Returns, per
    path, the log-probs of ``batch`` before and after, the step's loss and grad norm, and
    how many micro-batches this rank ran."""
    from rl.algorithms.losses import nll_loss
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    res: dict = {}
    for name, extra in (("plain", []), ("budget", [f"trainer.max_tokens_per_microbatch={budget}"])):
        cfg = compose([*overrides, *extra])
        # Same seed in both builds: both trainers start from identical weights.
        tr = build_trainer(cfg.model, cfg.trainer, total_steps=1)
        before = tr.logprobs(batch)
        m = tr.train_step(batch, nll_loss)
        res[name] = {
            "before": before,
            "after": tr.logprobs(batch),
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "num_microbatches": len(tr._microbatches(batch)[0]),
            "dp": tr.layout.dp,
        }
    return res


def reuse_steps(overrides: list[str], batch: TrainBatch, epochs: int, minibatches: int) -> dict:
    """One RL step of ``epochs`` x ``minibatches`` updates (MegatronTrainer.train_batch) on
    ``batch`` sampled by the trainer's own starting policy (behaviour log-probs are its
    own), with ``algorithm``'s loss. Returns the log-probs before and after, the step's
    metrics and the optimizer steps taken."""
    from dataclasses import replace

    from rl.algorithms.registry import loss_from_config
    from rl.algorithms.reuse import Reuse
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    cfg = compose(overrides)
    reuse = Reuse(epochs, minibatches, cfg.trainer.seed)
    tr = build_trainer(cfg.model, cfg.trainer, total_steps=reuse.updates)
    before = tr.logprobs(batch)
    sampled = replace(batch, behaviour_logprobs=before)
    loss = loss_from_config(cfg.algorithm, cfg.rollout.sampling.max_new_tokens)
    m = tr.train_batch(sampled, loss, reuse, step=3)
    return {"before": before, "after": tr.logprobs(batch), "metrics": m, "step": tr.step}


def critic_steps(
    overrides: list[str], batches: list[TrainBatch], clip: float, init: str, save: bool
) -> dict:
    """A scalar-head model at the layout of ``overrides``, saved to (``save``) or loaded
    from the checkpoint ``init``, trained one step per batch with the clipped value loss;
    its losses and its values of the first batch before and after."""
    from rl.algorithms.value_loss import clipped_value_loss
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    cfg = compose(overrides)
    tr = build_trainer(cfg.model, cfg.trainer, total_steps=len(batches))
    if save:
        tr.save(init)
    else:
        tr.load(init, load_optimizer=False)
    res: dict = {"values": [tr.values(batches[0])], "losses": [], "clipfrac": []}
    for b in batches:
        m = tr.train_step(b, clipped_value_loss(clip))
        res["losses"].append(m["loss"])
        res["clipfrac"].append(m.get("vf_clipfrac", 0.0))
    res["values"].append(tr.values(batches[0]))
    return res


def variant_steps(
    overrides: list[str],
    batch: TrainBatch,
    variants: dict[str, list[str]],
    mutate: dict[str, str] | None = None,
) -> dict:
    """For each variant (more overrides on the same layout), from the same initial weights:
    log-probs of ``batch`` before and after one step, the step's loss and grad norm, and
    the micro-batches this rank ran. ``mutate`` names a variant's deliberate packing bug
    (see :func:`packing_mutation`), in force for that variant only."""
    import contextlib

    from rl.algorithms.losses import nll_loss
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    res: dict = {}
    for name, extra in variants.items():
        cfg = compose([*overrides, *extra])
        tr = build_trainer(cfg.model, cfg.trainer, total_steps=1)
        bug = (mutate or {}).get(name)
        with packing_mutation(bug) if bug else contextlib.nullcontext():
            before = tr.logprobs(batch)
            m = tr.train_step(batch, nll_loss)
            after = tr.logprobs(batch)
        res[name] = {
            "before": before,
            "after": after,
            "loss": m["loss"],
            "grad_norm": m["grad_norm"],
            "num_microbatches": len(tr._microbatches(batch)[0]),
        }
    return res


def packing_mutation(bug: str):
    """A context in which packing has one deliberate bug: ``cross`` (attention runs the
    whole stream as one sequence, so a row sees the rows before it), ``positions`` (RoPE
    restarts its positions one token after each row's start) or ``zigzag`` (CP ranks hold
    contiguous quarters, where attention and RoPE expect chunks r and 2cp-1-r).

    Positions that never restart at all are no bug RoPE can show: they shift a whole row
    by one offset, and RoPE's scores depend on the distance between positions only."""
    from unittest import mock

    import rl.engine.packing as packing
    import rl.models.sdpa_attention as sdpa
    from rl.engine.trainer import MegatronTrainer

    if bug == "cross":
        real = sdpa.packed_attention

        def one_segment(q, k, v, cu, *args):
            return real(q, k, v, cu[[0, -1]], *args)

        return mock.patch.object(sdpa, "packed_attention", one_segment)
    if bug == "positions":
        real_inputs = MegatronTrainer._packed_inputs

        def late_restart(self, mb, pack):
            tokens, positions, labels, params = real_inputs(self, mb, pack)
            late = params.cu_seqlens_q.clone()
            late[1:-1] += 1
            params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = late  # RoPE's only
            params.max_seqlen_q = params.max_seqlen_kv = int((late[1:] - late[:-1]).max())
            return tokens, positions, labels, params

        return mock.patch.object(MegatronTrainer, "_packed_inputs", late_restart)
    if bug == "zigzag":

        def contiguous(cu, cp, rank):
            total = int(cu[-1])
            return torch.arange(rank * total // cp, (rank + 1) * total // cp)

        return mock.patch.object(packing, "zigzag", contiguous)
    raise ValueError(f"no packing mutation {bug!r}")


def vision_logits(
    hf_dir: str, out: str, m, tp: int, pp: int, batches: dict, more: tuple = (), train: bool = False
) -> dict:
    """A vision-language model converted at this layout and loaded into a trainer: its
    logits of each of ``batches`` (TrainBatch by name). With ``train``: one optimizer step
    of NLL on the text tokens of ``batches["image"]`` (the largest change of a vision-tower
    weight), saved, resumed into a second trainer, and a second step on both (the largest
    gap between their logits); the logits are then the first trainer's. Without ``train``
    also the logits of ``batches["image"]`` with the tower's deepstack turned off
    (``no_deepstack``: the same as ``image`` for a model without it)."""
    from rl.algorithms.losses import nll_loss
    from rl.compose import compose
    from rl.engine.trainer import build_trainer
    from rl.weights.convert import hf_to_mcore_rank

    hf_to_mcore_rank(hf_dir, out, m, tp, pp, "float32")
    rows = next(iter(batches.values())).rows
    overrides = [f"trainer.tp={tp}", f"trainer.pp={pp}", "trainer.micro_batch_size=1",
                 f"trainer.global_batch_size={rows}", "trainer.optim.lr=0.01", *more]  # fmt: skip
    cfg = compose(overrides).trainer
    tr = build_trainer(m, cfg, total_steps=2, frozen=not train)
    tr.load(out, load_optimizer=False)
    res: dict = {}
    if train:
        from dataclasses import replace

        tower = tr.model.module.visual
        before = {n: p.detach().clone() for n, p in tower.named_parameters()} if tower else {}
        b = batches["image"]
        mask = (b.tokens != m.vision.image_token_id).float()
        mask[:, -1] = 0
        b = replace(b, loss_mask=mask)
        res["metrics"] = tr.train_step(b, nll_loss)
        res["tower_moved"] = max(
            ((p.detach() - before[n]).abs().max().item() for n, p in tower.named_parameters()),
            default=None,
        ) if tower else None  # fmt: skip
        # Saved and resumed (the tower's Adam state with it), a second step is the same.
        tr.save(out + "_step1")
        again = build_trainer(m, cfg, total_steps=2)
        again.load(out + "_step1")
        tr.train_step(b, nll_loss)
        again.train_step(b, nll_loss)
        res["resumed_gap"] = (tr.logits(b) - again.logits(b)).abs().max().item()
    res["logits"] = {name: tr.logits(b) for name, b in batches.items()}
    tower = tr.model.module.visual
    if not train and getattr(tower, "deepstack_visual_indexes", None):
        tower.deepstack_visual_indexes = []  # the same model without deepstack
    res["logits"]["no_deepstack"] = tr.logits(batches["image"])
    return res
