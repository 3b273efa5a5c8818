"""Bringing a restarted generator server back: the current weights first, then rollouts.

A generator rank restarts a server that died or stopped answering (rl/serving/watchdog.py)
and reports it. This thread waits for those reports and, for each, keeps the server out of
routing, gives it the version every other server serves through a DDMA re-push from the
trainer ranks (between two training steps, under the weight sync's lock), and only then
routes rollouts to it again. Requests the lost server held were already re-queued by the
client; with no server left they wait, and the rollout stream with them.

If a generator rank gives up (its restart budget is spent) its error reaches every waiting
request, so the controller's loop fails with the server's own log lines.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from rl.generator.service import Down
from rl.threads import named_thread

if TYPE_CHECKING:
    from rl.controller.weight_sync import WeightSync
    from rl.generator.client import GeneratorClient
    from rl.generator.service import GeneratorHandle, Restarted


WAIT_S = 600.0


class ServerRecovery:
    def __init__(self, gen: GeneratorHandle, sync: WeightSync, client: GeneratorClient) -> None:
        self.gen, self.sync, self.client = gen, sync, client
        self.restarts = 0
        self.restart_s = 0.0  # the servers' own restart time plus the re-push
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = named_thread("server-recovery", self._run)

    def start(self) -> ServerRecovery:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop bringing servers back (the thread, blocked on the store, ends with the
        process; a restart reported from now on is ignored)."""
        self._stop.set()

    def stats(self) -> dict[str, float]:
        return {"server_restarts": float(self.restarts), "server_restart_s": self.restart_s,
                **self.client.stats()}  # fmt: skip

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # A long wait: each empty one makes torch's store log a timeout warning.
                event = self.gen.next_event(wait=WAIT_S)
                if event is None or self._stop.is_set():
                    continue
                if isinstance(event, Down):  # no rollouts, no weight pushes until it is back
                    self.client.mark_dead(event.index)
                    what = f"generator server {event.index} ({event.url}) lost ({event.why})"
                    print(f"[controller] {what}: no rollouts or weights until it is back",
                          flush=True)  # fmt: skip
                else:
                    self._bring_back(event)
        except BaseException as e:  # a generator rank failed, or a re-push did
            self.error = e
            self.client.fail(e)

    def _bring_back(self, r: Restarted) -> None:
        t0 = time.perf_counter()
        self.client.mark_dead(r.index)  # it serves its start-up weights until re-pushed
        if r.index in self.sync.repush([r.index]).lost:
            raise RuntimeError(f"generator server {r.index} ({r.url}) was lost again while "
                               "its weights were re-pushed")  # fmt: skip
        self.client.revive(r.index)
        self.restarts += 1
        self.restart_s += r.seconds + time.perf_counter() - t0
        print(
            f"[controller] generator server {r.index} ({r.url}) {r.why}: restarted in "
            f"{r.seconds:.1f}s, given weight version {self.sync.weight_version} in "
            f"{time.perf_counter() - t0:.1f}s, routed to again",
            flush=True,
        )
