"""Pure rollout types for the generator: no HTTP, and no torch at import (a rollout's
routing is a tensor, made and read by rl/generator/routing.py).

Why a type of our own instead of SGLang's dicts: a rollout in this framework outlives one
HTTP request. It can be cut after ``segment_tokens`` new tokens, parked while the trainer
steps, and resumed on another server under a newer policy. Every token therefore carries
the behaviour log-prob and the weight version it was sampled with, and those lists only
ever grow. Validation happens here (token ids against the model, sampling parameters in
rl/config/sampling.py), before anything reaches a server, so a bad field fails with its
name and value instead of as a 400 (or a silent truncation) deep in SGLang.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import torch  # at run time: a Rollout's routing crosses channels (rl.runtime.codec)

from rl.config.sampling import RequestError, SamplingParams
from rl.serving.server_api import ServerResponseError, parse_version

FINISHED = ("stop", "length", "abort")
_ids = itertools.count()


def new_rid() -> str:
    """A rollout id unique in this process, in the order rollouts are made: for rollouts
    no run's ledger names (an evaluation's, a benchmark's). A run's rollout stream names
    its own from what each rollout is (rl/controller/rollouts.py)."""
    return f"r{next(_ids)}"


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class RoutingShape:
    """What one routing row of the served MoE model holds: ``layers`` (every decoder layer,
    as SGLang returns them) x ``topk`` expert ids, each below ``experts``."""

    layers: int
    topk: int
    experts: int

    @property
    def dtype(self) -> str:
        """The torch dtype a rollout keeps its rows in: the smallest that holds every id."""
        return "int8" if self.experts <= 127 else "int16"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RoutingShape:
        """From a config.json (its ``text_config``): the names SGLang reads, and each MoE
        family's name for its routed expert count."""
        n = next((cfg[k] for k in ("num_experts", "n_routed_experts", "num_local_experts")
                  if cfg.get(k)), None)  # fmt: skip
        if not n or not cfg.get("num_experts_per_tok"):
            raise RequestError(
                "algorithm.routing_replay needs a Mixture-of-Experts model: config.json has "
                f"num_experts={n} num_experts_per_tok={cfg.get('num_experts_per_tok')}"
            )
        return cls(int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"]), int(n))


@dataclass(frozen=True)
class ModelLimits:
    """What the client checks token ids against (read from the served model's config),
    and, with routing replay, the shape of the routing it asks for."""

    vocab_size: int
    context_len: int
    eos_ids: tuple[int, ...] = ()
    _: KW_ONLY
    routing: RoutingShape | None = None  # None: rollouts carry no routing
    # A vision-language model's image-pad token: a request sends one per image and the
    # server expands it (None: a text model).
    image_token_id: int | None = None

    @classmethod
    def from_model_dir(
        cls, path: Path, context_len: int | None = None, routing: bool = False
    ) -> ModelLimits:
        """Limits of a Hugging Face model directory, as SGLang will serve it: vocab from
        config.json, context from ``context_len`` (the server's ``--context-length``) or
        ``max_position_embeddings``, EOS ids from config.json and generation_config.json;
        with ``routing``, the routing shape (:class:`RoutingShape`)."""
        top = json.loads((path / "config.json").read_text())
        cfg = top.get("text_config", top)
        eos: set[int] = set()
        gen = path / "generation_config.json"
        for src in (cfg, json.loads(gen.read_text()) if gen.is_file() else {}):
            e = src.get("eos_token_id")
            eos.update([] if e is None else [e] if isinstance(e, int) else e)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            context_len=int(context_len or cfg["max_position_embeddings"]),
            eos_ids=tuple(sorted(eos)),
            routing=RoutingShape.from_config(cfg) if routing else None,
            image_token_id=top.get("image_token_id") if "vision_config" in top else None,
        )

    def check(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("prompt_ids is empty")
        bad = [t for t in prompt_ids if not (_is_int(t) and 0 <= t < self.vocab_size)]
        if bad:
            raise RequestError(
                f"prompt token id {bad[0]!r} out of range for vocab_size={self.vocab_size}"
            )
        for name in ("stop_token_ids", "banned_ids"):
            bad = [t for t in getattr(sampling, name) if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"sampling.{name} has {bad[0]}, out of range for vocab_size={self.vocab_size}"
                )
        need = len(prompt_ids) + sampling.max_new_tokens
        if need > self.context_len:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens + sampling.max_new_tokens="
                f"{sampling.max_new_tokens} exceeds the context length {self.context_len}"
            )


@dataclass
class Rollout:
    """One sampled response, possibly still unfinished.

    ``finish_reason`` is None while the rollout can be resumed (cut at a segment boundary
    or interrupted by a weight update), else one of ``FINISHED``.

    ``routing`` (routing replay only, else None): per input token, the experts the server
    routed it to in each layer, ``[len(prompt_ids) + len(output_ids) - 1, layers, topk]``
    (int8, or int16 past 127 experts): row ``i`` is token ``i`` of prompt + output. The
    last output token is no model's input, hence the -1. Rows are kept as first routed: a
    resumed segment or a multi-turn episode's next turn asks only for the rows of the
    tokens it adds as input (the last token before it, an environment's observation, its
    new tokens), so a re-prefill under newer weights never rewrites them. While the
    rollout is unfinished it may hold fewer rows (none before its first reply, none yet
    for an observation: :meth:`rows_at`); each reply brings it back to the full count.

    Which weights routed a row is derived, not stored (:func:`routing_versions`): a row
    was computed by the forward that sampled the next sampled token after it, so a prompt
    row by ``versions[0]``'s, output row ``j`` (input position ``len(prompt_ids) + j``)
    by ``versions[j + 1]``'s, and an observation's rows by the next turn's first token's.
    One exception the client cannot see: a request retracted for a weight update (pause
    mode ``retract``) is prefilled again by SGLang itself once generation continues, and
    the rows it returns for what that prefill computed are the new weights' (its radix
    cache may still hold the prompt's older ones).
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    sample_index: int = 0
    group: int | None = None  # the caller's group (samples of one prompt share it)
    _: KW_ONLY
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    segments: int = 0
    server: int | None = None  # the server that produced the last segment
    rid: str = field(default_factory=new_rid)
    # [start, count] runs of output_ids that an environment wrote (multi-turn episodes):
    # in the context, out of the loss.
    observed: list[list[int]] = field(default_factory=list)
    # A multi-turn sample's conversation, JSON, kept by rl/controller/episodes.py.
    episode: dict[str, Any] | None = None
    routing: torch.Tensor | None = None  # see above
    # A vision-language prompt's images (references: rl/models/vision/images.py), sent
    # with every request of the rollout; its prompt_ids hold their tokens expanded.
    images: tuple[str, ...] = ()

    @property
    def routed(self) -> int:
        """The routing rows held: where the next request's rows start."""
        return 0 if self.routing is None else int(self.routing.shape[0])

    def rows_at(self, n: int) -> int:
        """The routing rows the rollout held between requests when it had ``n`` output
        tokens: a reply brings the rows of its inputs, an environment's tokens get theirs
        with the next request."""
        if n == 0:
            return 0
        answered = next((start for start, count in self.observed if start + count == n), None)
        return len(self.prompt_ids) + (n if answered is None else answered) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)

    def next_request(self, segment_tokens: int | None) -> tuple[list[int], int, int | None]:
        """(input ids, max new tokens, seed) of the next segment.

        The seed is a hash of the run's seed, the group, the prompt's ids and the sample
        index: stable across runs and processes, different for every prompt, group and
        sample (a prompt drawn twice is sampled afresh), and the same for every segment.
        SGLang's seeded sampler draws each token from (seed, position), so a rollout cut
        and resumed anywhere samples what it would have sampled uncut."""
        if self.finished:
            raise RequestError(f"rollout {self.rid} is finished ({self.finish_reason})")
        budget = self.remaining if segment_tokens is None else min(segment_tokens, self.remaining)
        ids = self.prompt_ids + self.output_ids
        seed = self.sampling.seed
        if seed is not None:
            prompt = ",".join(map(str, self.prompt_ids))
            key = f"{seed}:{self.group}:{self.sample_index}:{prompt}".encode()
            seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return ids, budget, seed

    def append(
        self,
        ids: list[int],
        logprobs: list[float],
        versions: list[int],
        reason: str | None,
        routing: torch.Tensor | None = None,
    ) -> None:
        """Add one segment's tokens, each with the weight version that sampled it, and
        with routing replay the rows of the tokens it added as input.

        ``reason`` is SGLang's finish type. "stop" ends the rollout; "length" ends it only
        at the rollout's own ``max_new_tokens`` (otherwise it is a segment boundary); an
        "abort" from a pause or weight update leaves it resumable. A caller that wants the
        rollout dropped marks it with ``finish("abort")``."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"{len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions")
        if routing is not None:
            want = len(self.prompt_ids) + len(self.output_ids) + len(ids) - 1 - self.routed
            if routing.shape[0] != want:
                raise ValueError(f"{routing.shape[0]} routing rows for {want} new input tokens")
            if self.routing is not None:
                routing = torch.cat([self.routing, routing])
            self.routing = routing  # a new tensor: a snapshot may hold the old one
        self.output_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.segments += 1
        if reason == "stop":
            self.finish_reason = "stop"
        elif self.remaining <= 0:
            self.finish_reason = "length"

    def observe(self, ids: list[int]) -> None:
        """Append an environment's answer to the turn that just ended (a tool's result as
        the chat template renders it) and make the rollout resumable for the next turn.
        The tokens get log-prob 0 and the version of the turn they answer, so a
        trajectory's staleness is that of its sampled tokens; :meth:`sampled` keeps them
        out of the loss."""
        if self.finish_reason != "stop":
            raise RequestError(f"rollout {self.rid}: only a turn that ended can be answered")
        if len(ids) >= self.remaining:
            raise RequestError(
                f"rollout {self.rid}: {len(ids)} observation tokens leave no room in "
                f"max_new_tokens={self.sampling.max_new_tokens}"
            )
        self.observed.append([len(self.output_ids), len(ids)])
        self.output_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1]] * len(ids)
        self.finish_reason = None

    def sampled(self) -> list[bool]:
        """Per output token: sampled by the policy (trained on) or written by an
        environment."""
        out = [True] * len(self.output_ids)
        for start, count in self.observed:
            out[start : start + count] = [False] * count
        return out

    def finish(self, reason: str) -> None:
        if reason not in FINISHED:
            raise ValueError(f"finish reason {reason!r} not in {FINISHED}")
        self.finish_reason = reason


def collapse_pads(ids: list[int], pad: int) -> list[int]:
    """``ids`` with each run of image-pad tokens (one image's: a chat template puts markers
    between images) as one pad, as a request sends it and the server expands it again.
    SGLang's Qwen3-VL processor fails on pads sent already expanded (it counts each run's
    pads as images); a single pad per image works for every family."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


def routing_versions(r: Rollout) -> list[int]:
    """The weight version that routed each routing row of ``r`` (one per input token,
    ``len(prompt_ids) + len(output_ids) - 1``): that of the next sampled token after the
    row's token (see :class:`Rollout`). An environment's tokens with no sampled token
    after them yet keep their own version; a rollout with no output has none."""
    p, sampled = len(r.prompt_ids), r.sampled()
    after = list(r.versions)  # after[k]: the version of the first sampled token from k on
    if not after:
        return []
    for k in range(len(after) - 2, -1, -1):
        if not sampled[k]:
            after[k] = after[k + 1]
    return [after[max(i + 1 - p, 0)] for i in range(p + len(after) - 1)]


def new_rollouts(
    prompt_ids: list[int],
    sampling: SamplingParams,
    group: int | None,
    rid: str | None = None,
    images: tuple[str, ...] = (),
) -> list[Rollout]:
    """The ``sampling.n`` fresh rollouts of one prompt, each with its own id: sample
    ``i``'s is ``<rid>.<i>`` (the caller keeps ``rid`` unique), or :func:`new_rid`'s."""
    return [Rollout(list(prompt_ids), sampling, i, group,
                    rid=new_rid() if rid is None else f"{rid}.{i}", images=images)
            for i in range(sampling.n)]  # fmt: skip


def parse_result(out: dict) -> tuple[list[int], list[float], list[int], str]:
    """One SGLang ``/generate`` result (``return_logprob=True``) -> (new token ids, their
    log-probs, the weight version of each, SGLang's finish type).

    Strict on purpose: a misaligned log-prob or version list would silently train on the
    wrong behaviour policy, so anything malformed raises ServerResponseError."""
    try:
        meta = out["meta_info"]
        ids = [int(t) for t in out["output_ids"]]
        lps = meta["output_token_logprobs"] or []
        finish = meta["finish_reason"]
        reason = finish.get("type") if isinstance(finish, dict) else None
        spans = meta.get("weight_versions") or [
            {"version": meta["weight_version"], "start": 0, "end": len(ids)}
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise ServerResponseError(f"malformed generation result ({e!r}): {out!r:.300}") from None
    if len(lps) != len(ids) or any(int(lp[1]) != t for lp, t in zip(lps, ids, strict=True)):
        raise ServerResponseError(f"log-probs {lps!r:.200} do not match output ids {ids!r:.200}")
    if reason not in FINISHED:
        raise ServerResponseError(f"unknown finish reason {finish!r}")
    versions: list[int] = []
    for span in spans:
        start, end = int(span["start"]), min(int(span["end"]), len(ids))
        if start != len(versions) or end < start:
            raise ServerResponseError(f"weight-version spans are not contiguous: {spans!r}")
        versions += [parse_version(span["version"])] * (end - start)
    if len(versions) != len(ids):
        raise ServerResponseError(
            f"weight-version spans {spans!r} cover {len(versions)} of {len(ids)} tokens"
        )
    return ids, [float(lp[0]) for lp in lps], versions, reason
