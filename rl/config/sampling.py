"""Sampling parameters: the typed, checked form of ``rollout.sampling`` and of a request's.

Config validation checks ``rollout.sampling`` with the same class the generator sends, so a
bad field fails before launch with its name and value instead of as a 400 (or a silent
truncation) deep in SGLang. Pure: no torch, no HTTP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl.config.schema import SamplingConfig


# The logit bias of a banned token: exp() of it is 0 in fp32 and bf16, as the trainer's own
# mask for it (rl/engine/trainer.py masks with the same value).
BANNED = -1e9


class RequestError(ValueError):
    """A request that cannot be valid, raised before it is sent."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """What a caller may ask of the generator; ``temperature=0`` is greedy.

    ``n`` samples of one prompt are sent as ``n`` independent requests (seeds ``seed + i``)
    so the load balancer can spread them over servers.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    _: KW_ONLY
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    # Token ids the policy must never sample (a vision-language model's image and video
    # tokens): the server gives them no probability, and the trainer masks them out of its
    # softmax as well, so both score the same distribution.
    banned_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        stops = self.stop_token_ids
        if not all(_is_int(t) and t >= 0 for t in stops):
            raise RequestError(f"sampling.stop_token_ids={stops!r} must be token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        if not all(_is_int(t) and t >= 0 for t in self.banned_ids):
            raise RequestError(f"sampling.banned_ids={self.banned_ids!r} must be token ids >= 0")
        object.__setattr__(self, "banned_ids", tuple(self.banned_ids))
        num = _is_number
        checks = (
            ("temperature", num(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_p", num(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            (
                "top_k",
                _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
                "must be -1 (off) or an integer >= 1",
            ),
            (
                "max_new_tokens",
                _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                "must be an integer >= 1",
            ),
            ("n", _is_int(self.n) and self.n >= 1, "must be an integer >= 1"),
            (
                "seed",
                self.seed is None or (_is_int(self.seed) and self.seed >= 0),
                "must be None or an integer >= 0",
            ),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be true or false"),
        )
        for name, ok, why in checks:
            if not ok:
                raise RequestError(f"sampling.{name}={getattr(self, name)!r} {why}")
        if self.ignore_eos and self.stop_token_ids:
            # SGLang's ignore_eos switches off every token-based stop, not only EOS.
            raise RequestError(
                f"sampling.stop_token_ids={list(self.stop_token_ids)!r} cannot be used with "
                "sampling.ignore_eos=True (the server then stops on max_new_tokens only)"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise RequestError(
                f"unknown sampling field {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        return cls(**d)

    @classmethod
    def from_config(cls, s: SamplingConfig, **changes: object) -> SamplingParams:
        """``rollout.sampling`` (its schema's fields), with ``changes`` on top."""
        fields = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                      max_new_tokens=s.max_new_tokens, n=s.n, seed=s.seed)  # fmt: skip
        return cls.from_dict({**fields, **changes})

    def to_sglang(self, max_new_tokens: int, seed: int | None) -> dict[str, Any]:
        """SGLang's sampling dict. A rollout ends on the model's EOS ids (from its config)
        or any of ``stop_token_ids``, and the stop token is kept in the output, because the
        trainer must see (and learn) the token that ended the response.

        ``seed`` becomes SGLang's ``sampling_seed``, which SGLang honours only with
        ``--enable-deterministic-inference`` (a GPU attention backend); a CPU server
        honours it through rl/serving/cpu_seeds.py."""
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "no_stop_trim": True,
        }
        if seed is not None:
            out["sampling_seed"] = seed
        if self.banned_ids:  # SGLang adds the bias before its softmax and its log-probs
            out["logit_bias"] = {str(t): BANNED for t in self.banned_ids}
        return out

    def stops(self, eos_ids: tuple[int, ...]) -> frozenset[int]:
        """Token ids that end a rollout under these params."""
        return frozenset() if self.ignore_eos else frozenset(self.stop_token_ids + eos_ids)
