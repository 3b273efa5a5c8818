#!/usr/bin/env python
"""Train a Bradley-Terry reward model on (chosen, rejected) pairs, as an HF directory that
``reward_model=cpu reward_model.hf_checkpoint=DIR`` loads.

    python tools/train_reward_model.py --init POLICY_HF_DIR --pairs pairs.jsonl --out RM_DIR
    # pairs of the arithmetic task (the right answer against a wrong one) made here, half
    # of the wrong ones sampled from the policy RL will train:
    python tools/train_reward_model.py --init HF_DIR --arithmetic 20000 \
        --negatives-from POLICY_HF_DIR --out RM_DIR

``--init`` is an HF causal LM (or sequence classifier) directory: the model starts from its
decoder with a fresh one-label scalar head (``*ForSequenceClassification``), so it shares
the policy's tokenizer. A pair is a JSON line with ``prompt_ids``, ``chosen_ids`` and
``rejected_ids`` (token ids), or ``prompt``, ``chosen`` and ``rejected`` (text, tokenized
with ``--init``'s tokenizer). The loss is the pairwise ``-log sigmoid(s_chosen -
s_rejected)``, a sequence's score its value at its rightmost token that is not the model's
``pad_token_id`` (as transformers and the RL job pool it).

Writes the model, the tokenizer files of ``--init``, and ``reward_stats.json``: the held-out
pairs' accuracy (the chosen scored above the rejected), and the mean and std of their
scores, which ``reward_model.normalize=standard`` uses.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Pair = tuple[list[int], list[int], list[int]]  # prompt, chosen, rejected (token ids)


def sampled_answers(init: str, prompts: list[list[int]], new: int, seed: int) -> list[list[int]]:
    """One answer per prompt sampled from the causal LM ``init`` (temperature 1, up to
    ``new`` tokens, cut after its EOS): the mistakes the policy itself makes."""
    from transformers import AutoModelForCausalLM

    from rl.tasks.kinds.arithmetic import EOS, PAD

    model = AutoModelForCausalLM.from_pretrained(init).float().eval()
    torch.manual_seed(seed)
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), 1024):  # every prompt has the task's one length
            ids = torch.tensor(prompts[i : i + 1024])
            gen = model.generate(
                ids, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=new,
                eos_token_id=EOS, pad_token_id=PAD,
            )  # fmt: skip
            for row in gen[:, ids.shape[1] :].tolist():
                out.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return out


def arithmetic_pairs(
    count: int, digits: int, seed: int, init: str | None = None, sampled: float = 0.0
) -> list[Pair]:
    """The arithmetic task's training problems (not its held-out set), each answer against a
    wrong one: with probability ``sampled``, ``init``'s own sampled answer where it is wrong;
    else (and where it is right) one or two digits changed (most), a digit dropped or added,
    or no EOS."""
    from rl.tasks.kinds.arithmetic import ArithmeticTask

    task, rng = ArithmeticTask(digits, seed), random.Random(seed + 7)
    stream = task.train_stream()
    examples = [next(stream) for _ in range(count)]
    own = [None] * count
    if init and sampled > 0:
        picked = [i for i in range(count) if rng.random() < sampled]
        answers = sampled_answers(init, [list(examples[i].prompt_ids) for i in picked],
                                  task.answer_tokens, seed)  # fmt: skip
        for i, a in zip(picked, answers, strict=True):
            own[i] = a
    digit_ids = [i for i in range(3, 13)]  # '0'..'9' (rl/tasks/kinds/arithmetic.py)
    out = []
    for ex, mine in zip(examples, own, strict=True):
        right = list(ex.target_ids or ())
        if mine is not None and mine != right:
            out.append((list(ex.prompt_ids), right, mine))
            continue
        body, eos = right[:-1], right[-1:]
        wrong = list(body)
        kind = rng.random()
        if kind < 0.85:
            for pos in rng.sample(range(len(body)), 1 if kind < 0.65 else 2):
                wrong[pos] = rng.choice([d for d in digit_ids if d != body[pos]])
            wrong += eos
        elif kind < 0.9:
            del wrong[rng.randrange(len(wrong))]
            wrong += eos
        elif kind < 0.95:
            wrong.insert(rng.randrange(len(wrong) + 1), rng.choice(digit_ids))
            wrong += eos
        # else: the digits without EOS (a response cut short)
        out.append((list(ex.prompt_ids), right, wrong))
    return out


def read_pairs(path: str, init: str) -> list[Pair]:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    if rows and "prompt_ids" in rows[0]:
        return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(init, local_files_only=True)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return [(ids(r["prompt"]), ids(r["chosen"]) + eos, ids(r["rejected"]) + eos) for r in rows]


def scores(model, seqs: list[list[int]], pad: int) -> torch.Tensor:
    """Each sequence's value at its rightmost token that is not ``pad`` (the model's
    ``pad_token_id``): where the RL job and transformers pool it; 0 for one of pad ids only
    (as the RL job scores it), ``[N]``."""
    from rl.companion.reward_model import scored_positions

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    at = scored_positions(seqs, pad)
    where = torch.tensor([0 if t is None else t for t in at])
    real = torch.tensor([t is not None for t in at], dtype=hidden.dtype)
    return model.score(hidden[torch.arange(len(seqs)), where])[:, 0] * real


def pair_scores(model, batch: list[Pair], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = scores(model, [p + c for p, c, _ in batch] + [p + r for p, _, r in batch], pad)
    return s[: len(batch)], s[len(batch) :]


def evaluate(model, pairs: list[Pair], pad: int) -> dict[str, float]:
    model.eval()
    with torch.no_grad():
        ch, rj = zip(*(pair_scores(model, pairs[i : i + 256], pad)
                       for i in range(0, len(pairs), 256)), strict=True)  # fmt: skip
    model.train()
    c, r = torch.cat(ch), torch.cat(rj)
    both = torch.cat([c, r])
    return {
        "pair_accuracy": (c > r).float().mean().item(),
        "loss": -F.logsigmoid(c - r).mean().item(),
        "mean": both.mean().item(),
        "std": both.std().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True, help="HF directory of the starting decoder")
    ap.add_argument("--out", required=True, help="HF directory to write")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--pairs", help="JSONL of pairs (ids or text)")
    src.add_argument("--arithmetic", type=int, help="make this many arithmetic-task pairs")
    ap.add_argument("--digits", type=int, default=2, help="--arithmetic's operand digits")
    sampled = "--arithmetic: the fraction of wrong answers sampled from --init"
    ap.add_argument("--sampled", type=float, default=0.5, help=sampled)
    ap.add_argument("--negatives-from", default=None,
                    help="--arithmetic: sample the wrong answers from this HF causal LM (the "
                         "policy RL will train) instead of --init")  # fmt: skip
    ap.add_argument("--held-out", type=float, default=0.1, help="fraction of pairs held out")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=64, help="pairs per step")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--pad-id", type=int, default=None, help="default: the init config's, or 0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    a = ap.parse_args()
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(a.seed)
    if a.arithmetic:
        policy = a.negatives_from or a.init
        pairs = arithmetic_pairs(a.arithmetic, a.digits, a.seed, policy, a.sampled)
        print(f"[rm] {a.arithmetic} pairs of the arithmetic task", flush=True)
    else:
        pairs = read_pairs(a.pairs, a.init)
    if len(pairs) < 2:
        raise SystemExit(f"--pairs: {len(pairs)} pairs; at least 2 are needed")
    random.Random(a.seed).shuffle(pairs)
    n_eval = max(1, int(len(pairs) * a.held_out))
    held, train = pairs[:n_eval], pairs[n_eval:]
    cfg = AutoConfig.from_pretrained(a.init, num_labels=1)
    pad = a.pad_id if a.pad_id is not None else (cfg.pad_token_id or 0)
    cfg.pad_token_id = pad
    model = AutoModelForSequenceClassification.from_pretrained(a.init, config=cfg)
    model.float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    steps = max(1, math.ceil(len(train) * a.epochs / a.batch))
    print(f"[rm] {len(train)} training pairs, {len(held)} held out; {steps} steps of {a.batch}; "
          f"held-out before: {evaluate(model, held, pad)}", flush=True)  # fmt: skip
    t0, rng, curve = time.perf_counter(), random.Random(a.seed + 1), []
    for step in range(1, steps + 1):
        batch = rng.sample(train, min(a.batch, len(train)))
        c, r = pair_scores(model, batch, pad)
        loss = -F.logsigmoid(c - r).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % a.log_every == 0 or step == steps:
            ev = evaluate(model, held, pad)
            curve.append([step, ev["pair_accuracy"]])
            took = time.perf_counter() - t0
            print(f"[rm] step {step}/{steps}: loss {loss.item():.4f}, held-out pair accuracy "
                  f"{ev['pair_accuracy']:.3f} ({took:.0f} s)", flush=True)  # fmt: skip
    stats = {**evaluate(model, held, pad), "pairs": len(train), "held_out_pairs": len(held),
             "steps": steps, "train_s": time.perf_counter() - t0, "curve": curve}  # fmt: skip
    out = Path(a.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in Path(a.init).iterdir():  # the tokenizer: the policy's
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp / f.name)
    (tmp / "reward_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"[rm] held-out pair accuracy {stats['pair_accuracy']:.3f}, scores mean "
          f"{stats['mean']:.3f} std {stats['std']:.3f}; written to {out}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
