"""Rollout routing replay (R3): the trainer's log-probs of the sampled tokens against the
server's (mu), with the server's routing replayed and without, in one run.

    PYTHONPATH=. $(tools/setup_env.sh)/bin/python tools/bench/moe_r3.py

The model is the tests' tiny Qwen3-MoE (2 layers, 4 experts, top-2, hidden 64, vocab 99:
tests/helpers/hf_models.py), made here from one seed, in two variants:

* ``as_made``: the checkpoint as the tests make it;
* ``near_tied``: the same, with every router's rows (one per expert) replaced by one
  shared random row plus ``--tie-scale`` times their own. Scaling the router's weights
  alone would not bring experts closer: bf16's error in a score is relative to the score,
  so a scaled router flips as rarely as the original. A shared row makes the scores of
  all experts large and alike, so the same relative error flips the top-k far more often
  (what an MoE model whose experts are barely told apart does).

Per variant, one fp32 CPU SGLang server started with ``--enable-return-routed-experts``
samples ``--prompts`` x ``--samples`` rollouts (temperature 1, seeded, no early stop),
each with its behaviour log-probs and the experts the server routed each input token to.
The server is then stopped, and one Megatron trainer rank (TP=PP=EP=1) per trainer dtype
converts the same checkpoint, loads it and scores the batch twice: its own routing
(the baseline) and the server's replayed. bfloat16 is the case where routing can
differ from the fp32 server's; float32 is the control, where both should be near 0.

Reported on the sampled tokens only (the loss mask): mean and max |log pi - log mu|
without and with replay and their ratio (with / without), ``routing_agreement`` (the
trainer's own top-k set against the replayed one, over every known token and layer),
the share of sampled tokens whose context held a token routed otherwise (in any layer),
|log pi - log mu| on those and on the rest, wall times, and peak memory (RSS) of the
client, the server's process tree and each trainer rank. Written as JSON.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_util import peak_mb, tree_peak_rss_mb, write_result
from common import TINY

from rl.batch import TrainBatch
from rl.config.sampling import SamplingParams
from rl.controller.batch import build_batch
from rl.generator.client import GeneratorClient
from rl.models import arch, registry
from rl.runtime.launch import spawn
from rl.serving.launcher import ServerConfig, ServerLauncher

ROOT = Path(__file__).resolve().parents[2]

# tests/helpers/hf_models.py's tiny Qwen3-MoE, from where it is declared (a benchmark does
# not import the test helpers): the tiny Llama's shape, the MoE fields, the family's own.
TINY_MOE = {**TINY, **arch.TINY_MOE, **registry.get("Qwen3MoeForCausalLM").tiny["qwen3_moe"]}
MODEL = "tiny Qwen3-MoE: 2 layers, 4 experts top-2, hidden 64, vocab 99, fp32 checkpoint"
VARIANTS = ("as_made", "near_tied")
TIMES = ("convert_and_load_s", "logprobs_own_s", "logprobs_replay_s")
DTYPES = ("bfloat16", "float32")


def make_qwen3_moe(path: Path, seed: int, tie_scale: float | None) -> Path:
    """The tiny Qwen3-MoE, fp32, as tests/helpers/hf_models.make_model makes it (random
    norms around 1); with ``tie_scale``, each router's rows are one shared row plus
    ``tie_scale`` times their own."""
    import transformers

    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model("qwen3_moe", **TINY_MOE)
    model = transformers.Qwen3MoeForCausalLM(conf)
    routers = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
        if tie_scale is not None:
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):  # [experts, hidden]
                    # 3 x the rows' spread: every expert's score is mostly the shared part.
                    shared = 3 * p.std() * torch.randn(1, p.shape[1])
                    p.copy_(shared + tie_scale * p)
                    routers += 1
            assert routers == TINY_MOE["num_hidden_layers"], routers
    model.eval().save_pretrained(path)
    return path


def sample(hf: Path, prompts: list[list[int]], sampling: SamplingParams, log_dir: Path) -> dict:
    """Rollouts of every prompt from one fp32 CPU server returning routed experts."""
    cfg = ServerConfig(model_path=str(hf), return_routed_experts=True)
    t0 = time.perf_counter()
    with ServerLauncher(cfg, n=1, log_dir=log_dir) as launcher:
        startup = time.perf_counter() - t0
        with GeneratorClient.for_launcher(launcher) as client:
            client.generate([prompts[0]], SamplingParams(max_new_tokens=4))  # warm up
            t = time.perf_counter()
            rollouts = client.generate(prompts, sampling)
            sample_s = time.perf_counter() - t
        server_mb = tree_peak_rss_mb(launcher.servers[0].proc.pid)
    print(f"  server up in {startup:.1f}s, {len(rollouts)} rollouts in {sample_s:.1f}s",
          flush=True)  # fmt: skip
    return {"rollouts": rollouts, "startup_s": startup, "sample_s": sample_s,
            "server_peak_rss_mb": server_mb}  # fmt: skip


def _timed(fn, batch: TrainBatch, reps: int) -> tuple[torch.Tensor, float]:
    """``fn(batch)`` and its median wall time over ``reps`` calls (each a few ms here)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn(batch)
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def score(
    hf: str, ckpt: str, m, dtype: str, tokens: torch.Tensor, routing: torch.Tensor, reps: int
) -> dict:
    """One trainer rank: convert ``hf`` at ``dtype``, load it, and score ``tokens`` with its
    own routing, then with ``routing`` replayed (``reps`` passes each, timed)."""
    from rl.compose import compose
    from rl.engine.trainer import build_trainer
    from rl.weights.convert import hf_to_mcore_rank

    rows, seq = tokens.shape
    t0 = time.perf_counter()
    hf_to_mcore_rank(hf, ckpt, m, 1, 1, dtype)
    overrides = ["trainer.tp=1", "trainer.pp=1", "trainer.dp=1", "trainer.ep=1",
                 f"trainer.micro_batch_size={rows}", f"trainer.global_batch_size={rows}",
                 f"trainer.params_dtype={dtype}",
                 # padded: the routers' choices are read back in Megatron's [s, b] order
                 "trainer.packing=false"]  # fmt: skip
    tr = build_trainer(m, compose(overrides).trainer, total_steps=1, frozen=True)
    tr.load(ckpt, load_optimizer=False)
    load_s = time.perf_counter() - t0
    assert tr.replay is not None
    tr.logprobs(TrainBatch(tokens))  # warm-up: the first pass pays one-off costs
    own, own_s = _timed(tr.logprobs, TrainBatch(tokens), reps)
    # One micro-batch: the routers' last choice covers every row, in Megatron's [s, b] order.
    k = routing.shape[-1]
    chosen = tr.replay.chosen()
    own_routing = torch.stack(
        [chosen[i].view(seq, rows, k).transpose(0, 1) for i in sorted(chosen)], dim=2
    ).to(routing.dtype)
    assert tr.replay.step() == {}  # nothing replayed yet
    replayed, replay_s = _timed(tr.logprobs, TrainBatch(tokens, routing=routing), reps)
    agreement = tr.replay.step()["routing_agreement"]  # the same on every pass
    return {
        "own": own,
        "replayed": replayed,
        "own_routing": own_routing,
        "routing_agreement": agreement,
        "convert_and_load_s": load_s,
        "logprobs_own_s": own_s,
        "logprobs_replay_s": replay_s,
        "peak_rss_mb": peak_mb(os.getpid()),
    }


def _stats(d: torch.Tensor) -> dict:
    if d.numel() == 0:
        return {"tokens": 0}
    return {"tokens": int(d.numel()), "mean": d.mean().item(), "max": d.max().item()}


def compare(batch: TrainBatch, out: dict) -> dict:
    """|log pi - log mu| on the sampled tokens, without and with replay."""
    mask = batch.loss_mask.bool()
    mu = batch.behaviour_logprobs
    d_own = (out["own"] - mu).abs()
    d_rep = (out["replayed"] - mu).abs()
    # Where the trainer's own top-k set differs from the server's (known rows only).
    srv, own = batch.routing.long(), out["own_routing"].long()
    known = (srv >= 0).all(-1)
    differs = ((srv.sort(-1).values != own.sort(-1).values).any(-1) & known).any(-1)  # [B, S]
    # Log-prob t scores token t+1 from tokens 0..t: it moves if any of them was routed
    # otherwise, in any layer.
    touched = differs.long().cummax(1).values.bool()
    without, with_ = _stats(d_own[mask]), _stats(d_rep[mask])
    return {
        "without_replay": without,
        "with_replay": with_,
        "ratio_with_over_without": {
            "mean": with_["mean"] / without["mean"],
            "max": with_["max"] / without["max"],
        },
        "routing_agreement": out["routing_agreement"],
        "routing_differs": {
            "input_tokens": int(differs.sum()),
            "of_known": int(known.any(-1).sum()),
            "sampled_tokens_with_context_routed_otherwise": int((touched & mask).sum()),
            "without_replay_on_those": _stats(d_own[mask & touched]),
            "with_replay_on_those": _stats(d_rep[mask & touched]),
            "without_replay_on_the_rest": _stats(d_own[mask & ~touched]),
        },
        "seconds": {k: round(out[k], 3) for k in TIMES},
        "replay_time_ratio": out["logprobs_replay_s"] / out["logprobs_own_s"],
        "trainer_peak_rss_mb": round(out["peak_rss_mb"], 1),
    }


def main(argv: list[str] | None = None) -> dict:
    from rl.weights.convert import prepare_hf_to_mcore

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="the checkpoint's, prompts', sampling's")
    ap.add_argument("--tie-scale", type=float, default=0.05,
                    help="near_tied: each router row = shared row + this x its own")  # fmt: skip
    ap.add_argument("--reps", type=int, default=3, help="timed log-prob passes per mode")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--out", default=str(ROOT / "tools/bench/results/moe_r3.json"))
    a = ap.parse_args(argv)

    g = torch.Generator().manual_seed(a.seed)
    lengths = torch.randint(4, 13, (a.prompts,), generator=g).tolist()
    vocab = TINY_MOE["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens,
                              ignore_eos=True, n=a.samples, seed=a.seed)  # fmt: skip
    result: dict = {
        "benchmark": "moe_r3",
        "what": "|log pi_trainer - log mu_server| on sampled tokens, routing replayed or not",
        "baseline": "the trainer's own routing (no replay), measured in the same run",
        "model": MODEL,
        "server": "SGLang, CPU, TP=1, float32, --enable-return-routed-experts",
        "trainer": "Megatron-Core, CPU, TP=PP=EP=1, one micro-batch, frozen",
        "workload": {
            "prompts": a.prompts,
            "samples_per_prompt": a.samples,
            "prompt_len": [min(lengths), max(lengths)],
            "max_new_tokens": a.max_new_tokens,
            "temperature": 1.0,
            "seed": a.seed,
        },
        "variants": {},
    }
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moe-r3-") as tmp:
        root = Path(tmp)
        for variant in a.variants:
            tie = a.tie_scale if variant == "near_tied" else None
            why = "bf16 trainer vs fp32 server"
            if tie is not None:
                why += (f", router rows near-tied: a shared random row (3x their spread) + "
                        f"{tie} x their own")  # fmt: skip
            print(f"[{variant}]", flush=True)
            hf = make_qwen3_moe(root / variant / "hf", a.seed, tie)
            s = sample(hf, prompts, sampling, root / variant / "logs")
            rollouts = s["rollouts"]
            groups = [rollouts[i : i + a.samples] for i in range(0, len(rollouts), a.samples)]
            batch = build_batch(groups, [[0.0] * a.samples for _ in groups])
            m, _ = prepare_hf_to_mcore(str(hf), 1, 1, vocab_multiple=128, dtype="float32")
            entry: dict = {
                "routing_differs_because": why,
                "rollouts": len(rollouts),
                "sampled_tokens": int(batch.loss_mask.sum()),
                "server_startup_s": round(s["startup_s"], 1),
                "sample_s": round(s["sample_s"], 2),
                "server_peak_rss_mb": round(s["server_peak_rss_mb"], 1),
                "trainer": {},
            }
            for dtype in a.dtypes:
                t = time.perf_counter()
                ckpt = str(root / variant / dtype)
                args = (str(hf), ckpt, m, dtype, batch.tokens, batch.routing, a.reps)
                out = spawn(score, 1, *args)[0]
                c = compare(batch, out)
                c["seconds"]["rank_total_s"] = round(time.perf_counter() - t, 2)
                entry["trainer"][dtype] = c
                w, r = c["without_replay"], c["with_replay"]
                print(f"  trainer {dtype}: mean |d| {w['mean']:.2e} -> {r['mean']:.2e} "
                      f"(x{c['ratio_with_over_without']['mean']:.3f}), max {w['max']:.2e} -> "
                      f"{r['max']:.2e}, routing agreement {c['routing_agreement']:.4f}, "
                      f"peak RSS {c['trainer_peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
            result["variants"][variant] = entry
    result["summary"] = {
        f"{v}/{dtype}": {
            "mean_ratio_with_over_without": round(c["ratio_with_over_without"]["mean"], 4),
            "max_ratio_with_over_without": round(c["ratio_with_over_without"]["max"], 4),
            "routing_agreement": round(c["routing_agreement"], 4),
        }
        for v, e in result["variants"].items()
        for dtype, c in e["trainer"].items()
    }
    result["total_s"] = round(time.perf_counter() - t_all, 1)
    client_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["client_peak_rss_mb"] = round(client_mb, 1)
    write_result(result, a.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
