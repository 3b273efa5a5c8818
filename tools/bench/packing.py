"""Packed micro-batches against today's token-budget padded ones, and CP=2 against CP=1.

    PYTHONPATH=. python tools/bench/packing.py            # ~10 min on 2 CPU cores
    PYTHONPATH=. python tools/bench/packing.py --smoke    # seconds: the same code paths

Every figure comes from one run. Each configuration trains in ranks of its own (spawned,
gloo, one thread each): ``MegatronTrainer.train_step`` with the NLL loss on batches whose
rows have lengths drawn from a distribution, the whole row scored. Two distributions:
``tiny`` (the tiny task's: 8 to 40 tokens, uniform) and ``long_tail`` (16 to 4,096
tokens, log-uniform: most rows short, a few long); two models: the tiny one (conf/model/
tiny.yaml) and SmolLM2-135M's shape with 4 layers. Both paths cut each rank's rows under
the same ``trainer.max_tokens_per_microbatch``:

* ``padded``: ``trainer.packing=false``, rows of similar length share a micro-batch and
  are right-padded to its longest (rl/engine/trainer.py ``pack_by_tokens``);
* ``packed``: ``trainer.packing=true``, rows first-fit into streams of their own lengths.

Reported per case: real (unpadded) tokens per second, the padding fraction of the
positions run, the peak RSS of the rank, and ``packed / padded``. Goal: packed >= 1.3x on
``long_tail``, no loss on ``tiny``.

Then context parallelism: one row of ``--cp-length`` tokens trained at CP=1 (one rank)
and CP=2 (two ranks), tokens/s and each rank's peak RSS. And the choice inside packed
attention (rl/models/packed_attention.py), forward and backward: one SDPA call per row
(what it runs), one batched call per distinct row length, and one call over the whole
stream with a block-diagonal causal mask; on a long-tailed pack and on the tiny task's.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench_util import peak_mb, write_result  # noqa: E402

SMOLLM2_4L = ["model.num_layers=4", "model.hidden_size=576", "model.ffn_hidden_size=1536",
              "model.num_attention_heads=9", "model.num_query_groups=3",
              "model.vocab_size=49152", "model.tie_embeddings=true"]  # fmt: skip
MODELS = {"tiny": [], "smollm2_135m_4l": SMOLLM2_4L}
ONE_RANK = [
    "trainer.tp=1",
    "trainer.pp=1",
    "trainer.dp=1",
    "trainer.threads_per_rank=1",
    "trainer.optim.lr=1e-5",
    "trainer.optim.min_lr=0",
    "trainer.optim.warmup_steps=0",
]


def lengths(dist: str, rows: int, seed: int, top: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    if dist == "tiny":
        return torch.randint(8, 41, (rows,), generator=g).tolist()
    u = torch.rand(rows, generator=g)  # log-uniform over [16, top]
    return torch.exp(math.log(16) + u * (math.log(top) - math.log(16))).long().tolist()


def batch_of(lens: list[int], vocab: int, seed: int):
    from rl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    seq = max(lens)
    tokens = torch.zeros(len(lens), seq, dtype=torch.long)
    mask = torch.zeros(len(lens), seq)
    for i, n in enumerate(lens):
        tokens[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, : n - 1] = 1.0
    return TrainBatch(tokens, mask)


def train_rank(overrides: list[str], batches: list, warmup: int) -> dict:
    """Rank function: steps on ``batches`` (the first ``warmup`` untimed); positions run."""
    from rl.algorithms.losses import nll_loss
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    cfg = compose(overrides)
    tr = build_trainer(cfg.model, cfg.trainer, total_steps=len(batches))
    run = real = 0
    seconds = 0.0
    for i, b in enumerate(batches):
        mbs, _ = tr._microbatches(b)
        t0 = time.perf_counter()
        tr.train_step(b, nll_loss)
        if i >= warmup:
            seconds += time.perf_counter() - t0
            real += int(b.loss_mask.sum()) + b.rows  # a row's tokens: its scored ones + 1
            run += sum(m.pack.length if m.pack is not None else m.batch.tokens.numel()
                       for m in mbs)  # fmt: skip
    return {"seconds": seconds, "real_tokens": real, "positions": run,
            "peak_rss_mb": peak_mb(os.getpid())}  # fmt: skip


def case(model: list[str], packing: bool, budget: int, batches: list, warmup: int) -> dict:
    from rl.runtime.launch import spawn

    rows = batches[0].rows
    over = ["model=tiny", *model, "model.max_position_embeddings=8192", *ONE_RANK,
            f"trainer.global_batch_size={rows}", "trainer.micro_batch_size=1",
            f"trainer.max_tokens_per_microbatch={budget}",
            f"trainer.packing={packing}"]  # fmt: skip
    (r,) = spawn(train_rank, 1, over, batches, warmup, timeout_s=3600)
    r["real_tokens_per_s"] = r["real_tokens"] / r["seconds"]
    r["padding_fraction"] = 1 - r["real_tokens"] / r["positions"]
    return r


def cp_case(model: list[str], cp: int, length: int, steps: int) -> dict:
    from rl.runtime.launch import spawn

    batches = [batch_of([length], 32 if not model else 49152, s) for s in range(steps + 1)]
    over = ["model=tiny", *model, f"model.max_position_embeddings={length}", *ONE_RANK,
            "trainer.global_batch_size=1", "trainer.micro_batch_size=1",
            f"trainer.cp={cp}"]  # fmt: skip
    ranks = spawn(train_rank, cp, over, batches, 1, timeout_s=3600)
    seconds = max(r["seconds"] for r in ranks)
    return {"tokens_per_s": ranks[0]["real_tokens"] / seconds,
            "peak_rss_mb_per_rank": [r["peak_rss_mb"] for r in ranks]}  # fmt: skip


def attention_choice(dist: str, total: int, top: int, reps: int) -> dict:
    """Per-segment SDPA calls against one block-diagonal masked call (fwd + bwd)."""
    import torch.nn.functional as F

    from rl.models.packed_attention import packed_attention

    lens, n = [], 0
    for x in lengths(dist, 4 * total // 8, 3, top):
        if n + x > total:
            break
        lens.append(x)
        n += x
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 9, 64, generator=g, requires_grad=True)
    k, v = (torch.randn(n, 3, 64, generator=g, requires_grad=True) for _ in range(2))
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(n)
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])

    def per_segment():
        return packed_attention(q, k, v, cu, 0.125, gqa=True)

    def by_length():
        starts: dict[int, list[int]] = {}
        for lo, hi in itertools.pairwise(cu.tolist()):
            starts.setdefault(hi - lo, []).append(lo)
        order, outs = [], []
        for n, los in starts.items():
            idx = (torch.tensor(los)[:, None] + torch.arange(n)).reshape(-1)
            qs, ks, vs = (t[idx].view(len(los), n, *t.shape[1:]).transpose(1, 2)
                          for t in (q, k, v))  # fmt: skip
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.125,
                                                 enable_gqa=True)  # fmt: skip
            order.append(idx)
            outs.append(out.transpose(1, 2).reshape(-1, *q.shape[1:]))
        return torch.zeros_like(q).index_copy(0, torch.cat(order), torch.cat(outs))

    def masked():
        out = F.scaled_dot_product_attention(
            *(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=0.125,
            enable_gqa=True,
        )  # fmt: skip
        return out[0].transpose(0, 1)

    res = {"tokens": n, "segments": len(lens)}
    for name, fn in (("per_segment", per_segment), ("by_length", by_length),
                     ("block_diagonal_mask", masked)):  # fmt: skip
        fn().sum().backward()  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            fn().sum().backward()
        res[f"{name}_ms"] = (time.perf_counter() - t0) / reps * 1e3
    for other in ("by_length", "block_diagonal_mask"):
        res[f"{other}_vs_per_segment"] = res[f"{other}_ms"] / res["per_segment_ms"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: seconds, not minutes")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2,
                    help="timed steps after one warm-up (the tiny model: 10x)")  # fmt: skip
    ap.add_argument("--cp-length", type=int, default=8192)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/packing.json"))
    args = ap.parse_args()
    top, rows, budget = (512, 8, 1024) if args.smoke else (4096, args.rows, 8192)
    cp_length = 512 if args.smoke else args.cp_length
    steps = 1 if args.smoke else args.steps
    result: dict = {"rows": rows, "budget_tokens": budget, "timed_steps": steps, "cases": {}}
    for model_name, model in MODELS.items():
        if args.smoke and model_name != "tiny":
            continue
        vocab = 32 if not model else 49152
        # The tiny model's step takes a fraction of a second: ten times the steps, so the
        # machine's jitter does not decide its ratio.
        timed = steps * (10 if not model else 1)
        for dist in ("tiny", "long_tail"):
            batches = [batch_of(lengths(dist, rows, 100 + s, top), vocab, s)
                       for s in range(timed + 1)]  # fmt: skip
            padded = case(model, False, budget, batches, 1)
            packed = case(model, True, budget, batches, 1)
            key = f"{model_name}/{dist}"
            result["cases"][key] = {
                "padded": padded,
                "packed": packed,
                "packed_vs_padded": packed["real_tokens_per_s"] / padded["real_tokens_per_s"],
            }
            print(f"{key}: packed {packed['real_tokens_per_s']:.0f} tok/s "
                  f"(padding {packed['padding_fraction']:.1%}), padded "
                  f"{padded['real_tokens_per_s']:.0f} (padding {padded['padding_fraction']:.1%})"
                  f": {result['cases'][key]['packed_vs_padded']:.2f}x", flush=True)  # fmt: skip
    cp_model = [] if args.smoke else SMOLLM2_4L
    one, two = cp_case(cp_model, 1, cp_length, steps), cp_case(cp_model, 2, cp_length, steps)
    result["context_parallel"] = {
        "model": "tiny" if args.smoke else "smollm2_135m_4l",
        "length": cp_length,
        "cp1": one,
        "cp2": two,
        "cp2_vs_cp1_tokens_per_s": two["tokens_per_s"] / one["tokens_per_s"],
    }
    print(f"CP at {cp_length} tokens: cp1 {one['tokens_per_s']:.0f} tok/s, "
          f"cp2 {two['tokens_per_s']:.0f} tok/s; peak RSS per rank {one['peak_rss_mb_per_rank']} "
          f"-> {two['peak_rss_mb_per_rank']} MB", flush=True)  # fmt: skip
    torch.set_num_threads(1)
    result["attention_choice"] = {
        dist: attention_choice(dist, total, top, 2 if args.smoke else 5)
        for dist, total in (("long_tail", 2048 if args.smoke else 8192), ("tiny", 1024))
    }
    print(f"attention: {result['attention_choice']}", flush=True)
    tail = result["cases"].get("smollm2_135m_4l/long_tail") or result["cases"]["tiny/long_tail"]
    result["goal_long_tail_1_3x_met"] = tail["packed_vs_padded"] >= 1.3
    write_result(result, args.out if not args.smoke else "/tmp/packing_smoke.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
