"""Stand-ins for the generator client a rollout stream drives (rl/controller/rollouts.py),
so the stream's logic is tested without a server. :class:`FakeClient` has the client's
calls (submit, resume); each subclass says what happens to a segment once it is sent
(``started``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from rl.config.sampling import SamplingParams
from rl.generator.types import Rollout, new_rollouts


class FakeClient(ABC):
    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        group: int | None = None,
        segment_tokens: int | None = None,
        rid: str | None = None,
        images: tuple[str, ...] = (),
    ) -> list[Future]:
        """``sampling.n`` rollouts of one prompt, each a future with its ``rollout``."""
        rollouts = new_rollouts(prompt_ids, sampling, group, rid, images)
        return self.resume_many(rollouts, segment_tokens)

    def resume(self, rollout: Rollout, segment_tokens: int | None = None) -> Future:
        return self.resume_many([rollout], segment_tokens)[0]

    def resume_many(
        self, rollouts: list[Rollout], segment_tokens: int | None = None
    ) -> list[Future]:
        out = []
        for r in rollouts:
            f: Future = Future()
            f.rollout = r  # type: ignore[attr-defined]
            self.started(f, r, segment_tokens)
            out.append(f)
        return out

    @abstractmethod
    def started(self, f: Future, r: Rollout, segment_tokens: int | None) -> None:
        """A segment of ``r`` was sent; ``f`` resolves to ``r`` when it is back."""

    def abort_all(self) -> None:
        """Nothing runs anywhere to abort: a fake segment is only a future."""
        return None


class InstantClient(FakeClient):
    """Finishes every sample at once with one token, ``prompt_ids[0]`` (a test's reward
    can read it back), under version 1."""

    def started(self, f: Future, r: Rollout, segment_tokens: int | None) -> None:
        r.append([r.prompt_ids[0]], [-0.1], [1], "stop")
        f.set_result(r)


class SilentClient(FakeClient):
    """Accepts every request and never answers it."""

    def started(self, f: Future, r: Rollout, segment_tokens: int | None) -> None:
        pass


class ScriptedClient(FakeClient):
    """Every segment waits until the test finishes it (``segment``); ``sent`` keeps the
    rollouts of every request, in order."""

    def __init__(self) -> None:
        self.futures: dict[str, Future] = {}  # rid -> its running segment
        self.sent: list[Rollout] = []

    def started(self, f: Future, r: Rollout, segment_tokens: int | None) -> None:
        self.futures[r.rid] = f
        self.sent.append(r)

    def segment(self, r: Rollout, ids: list[int], version: int, reason: str | None) -> None:
        r.append(ids, [-0.5 - i for i in range(len(ids))], [version] * len(ids), reason)
        self.futures.pop(r.rid).set_result(r)
