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
    """Log-probs of :func:`tokens` with ``routing`` replayed and without; at TP=PP=DP=1 in
    one micro-batch, also with the model's own routing replayed, as it is and shifted by one
    layer; and, for this rank's last micro-batch, whether every router chose exactly the
    replayed experts of the tokens it holds, token by token, where the routing is known."""
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
    more = {}
    if own_routing is not None:  # its own routing replayed, as is and shifted by a layer
        own_routing[:, -1] = -1  # as a rollout's: unknown at the last position
        more["own_replayed"] = tr.logprobs(TrainBatch(tokens(), routing=own_routing))
        more["own_agreement"] = tr.replay.step()
        shifted = own_routing.roll(1, dims=2)
        more["shifted_replayed"] = tr.logprobs(TrainBatch(tokens(), routing=shifted))
        tr.replay.step()
    replayed = tr.logprobs(TrainBatch(tokens(), routing=routing))
    agreement = tr.replay.step()
    exact, checked = chose_as_replayed(tr, routing, mbs)
    return {"own": own, "replayed": replayed, "exact": exact, "checked": checked,
            "agreement": agreement, **more}  # fmt: skip


def chose_as_replayed(tr, routing: torch.Tensor, mbs: int) -> tuple[bool, dict[int, int]]:
    """Whether every router of ``tr`` chose, in its last forward (this rank's last
    micro-batch of ``mbs`` rows), exactly ``routing``'s experts for the tokens it holds
    where they are known; and how many tokens each local layer checked."""
    lay, rows = tr.layout, routing.shape[0]
    per_rank = rows // lay.dp
    lo = lay.dp_rank * per_rank + per_rank - mbs
    want = routing[lo : lo + mbs]
    if tr.replay.sp:  # this TP rank's slice of the (padded) sequence
        want = tr_slice(want, lay.tp, lay.tp_rank)
    checked, exact = {}, True
    for layer, got in tr.replay.chosen().items():
        w = want[:, :, layer].transpose(0, 1).reshape(-1, want.shape[-1]).long()
        known = (w >= 0).all(1)
        checked[layer] = int(known.sum())
        exact = exact and torch.equal(got[known], w[known])
    return exact, checked


def tr_slice(rows: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    pad = (-rows.shape[1]) % tp
    if pad:
        more = rows.new_full((rows.shape[0], pad, *rows.shape[2:]), -1)
        rows = torch.cat([rows, more], 1)
    per = rows.shape[1] // tp
    return rows[:, rank * per : (rank + 1) * per]


def replay_checkpoint(m, ckpt: str, ep: int, batch: TrainBatch) -> dict:
    """A trainer of model config ``m`` at EP ``ep`` (DP the world) loads ``ckpt`` and
    scores ``batch`` (one micro-batch of its rows per rank) with its routing replayed:
    whether each router chose the replayed experts, and the log-probs."""
    import torch.distributed as dist

    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    dp, rows = dist.get_world_size(), batch.tokens.shape[0]
    # Padded: chose_as_replayed reads the routers' choices in Megatron's [s, b] order.
    cfg = compose([f"trainer.dp={dp}", f"trainer.ep={ep}", "trainer.tp=1",
                   f"trainer.micro_batch_size={rows // dp}",
                   f"trainer.global_batch_size={rows}", "trainer.packing=false"])  # fmt: skip
    tr = build_trainer(m, cfg.trainer, total_steps=1)
    tr.load(ckpt, load_optimizer=False)
    logprobs = tr.logprobs(batch)
    assert batch.routing is not None
    exact, checked = chose_as_replayed(tr, batch.routing, rows // dp)
    return {"exact": exact, "checked": checked, "logprobs": logprobs, **tr.replay.step()}
