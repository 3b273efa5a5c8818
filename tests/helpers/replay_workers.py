"""Rank functions for tests/multiproc/test_routing_replay.py: the tiny MoE trainer at one
layout, scoring a batch with and without a replayed routing, and reading back what each of
its routers chose."""

from __future__ import annotations

import torch

from rl.batch import TrainBatch

ROWS, SEQ, VOCAB = 4, 16, 32


def tokens() -> torch.Tensor:
    return torch.randint(3, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))


def random_routing(layers: int, experts: int, topk: int, seed: int = 11) -> torch.Tensor:
    """``[ROWS, SEQ, layers, topk]`` int8: distinct experts per (token, layer), as a
    server returns them; the last position unknown (-1), as in a rollout."""
    g = torch.Generator().manual_seed(seed)
    out = torch.rand(ROWS, SEQ, layers, experts, generator=g).argsort(-1)[..., :topk]
    out = out.to(torch.int8)
    out[:, -1] = -1
    return out


def replay_layout(overrides: list[str], load: str | None, routing: torch.Tensor,
                  save: str | None = None) -> dict:  # fmt: skip
    """Log-probs of :func:`tokens` with ``routing`` replayed and without; the model's own
    routing of the first micro-batch (at TP=PP=1, one micro-batch: as ``[B, S, L, K]``); and,
    for this rank's last micro-batch, whether every router chose exactly the replayed
    experts of the tokens it holds, token by token, where the routing is known."""
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    cfg = compose(overrides)
    tr = build_trainer(cfg.model, cfg.trainer, total_steps=1)
    if save:
        tr.save(save)
    if load:
        tr.load(load, load_optimizer=False)
    assert tr.replay is not None
    batch = TrainBatch(tokens())
    own = tr.logprobs(batch)
    own_routing = None
    lay, mbs = tr.layout, cfg.trainer.micro_batch_size
    if lay.tp == lay.pp == lay.dp == 1 and mbs == ROWS:
        chosen = tr.replay.chosen()
        k = cfg.model.moe_router_topk
        own_routing = torch.stack(
            [chosen[i].view(SEQ, ROWS, k).transpose(0, 1) for i in sorted(chosen)], dim=2
        ).to(torch.int8)
    replayed = tr.logprobs(TrainBatch(tokens(), routing=routing))
    agreement = tr.replay.step()
    # The rows of this rank's last micro-batch, the part of the sequence it holds.
    per_rank = ROWS // lay.dp
    lo = lay.dp_rank * per_rank + per_rank - mbs
    want = routing[lo : lo + mbs]
    if tr.replay.sp:
        per = SEQ // lay.tp
        want = want[:, lay.tp_rank * per : (lay.tp_rank + 1) * per]
    checked, exact = {}, True
    for layer, got in tr.replay.chosen().items():
        w = want[:, :, layer].transpose(0, 1).reshape(-1, want.shape[-1]).long()
        known = (w >= 0).all(1)
        checked[layer] = int(known.sum())
        exact = exact and torch.equal(got[known], w[known])
    return {"own": own, "replayed": replayed, "own_routing": own_routing, "exact": exact,
            "checked": checked, "agreement": agreement}  # fmt: skip
