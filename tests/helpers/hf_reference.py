"""Hugging Face transformers as the reference generator (tests and parity checks only).

Why: SGLang's outputs are only trustworthy if something independent reproduces them. This
generator runs the same checkpoint in fp32 with plain full-sequence forwards (no KV cache,
no fused kernels), samples under the same rules as ``SamplingParams`` (greedy at
temperature 0, stop on the model's EOS or ``stop_token_ids``, keep the stop token) and
reports the log-prob of each chosen token under ``log_softmax(logits / T)`` (T=1 when
greedy), which is what SGLang returns. It is slow by design and is never used to train.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from rl.config.sampling import SamplingParams
from rl.generator.types import Rollout


class HFReferenceGenerator:
    def __init__(self, model_path: str | Path, eos_ids: Iterable[int] | None = None):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32
        ).eval()
        if eos_ids is None:
            eos = self.model.config.eos_token_id
            eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
        self.eos_ids = tuple(int(e) for e in eos_ids)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite parameters by HF name; every name must exist (strict)."""
        params = dict(self.model.named_parameters())
        for name, t in named_tensors:
            if name not in params:
                raise KeyError(f"{name!r} is not a parameter of the reference model")
            params[name].copy_(t.to(torch.float32))

    @torch.no_grad()
    def score(self, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0):
        """Teacher-forced ``log_softmax(logits / T)`` of each output token (T=0 means 1):
        the behaviour log-prob a server must report for tokens it sampled."""
        ids = torch.tensor([list(prompt_ids) + list(output_ids)])
        logits = self.model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        return logp.gather(-1, torch.tensor(output_ids)[:, None])[:, 0].tolist()

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        out = Rollout(list(prompt_ids), sampling)
        stops = sampling.stops(self.eos_ids)
        ids = list(prompt_ids)
        for _ in range(sampling.max_new_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            if sampling.temperature == 0:
                logp = torch.log_softmax(logits, -1)
                tok = int(torch.argmax(logp))
            else:
                logp = torch.log_softmax(logits / sampling.temperature, -1)
                tok = int(
                    torch.multinomial(_filtered(logp, sampling).exp(), 1, generator=generator)
                )
            ids.append(tok)
            reason = "stop" if tok in stops else None
            out.append([tok], [float(logp[tok])], [0], reason)
            if out.finished:
                break
        return out


def _filtered(logp: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Top-k then top-p truncation, renormalised (log space)."""
    if sampling.top_k > 0:
        kth = torch.topk(logp, min(sampling.top_k, logp.numel())).values[-1]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_lp, order = torch.sort(logp, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop = cum - sorted_lp.exp() > sampling.top_p
        logp = logp.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.log_softmax(logp, -1)
