"""An LLM judge on a reward rank (``reward.fn=judge``): SGLang servers of the judge model,
started, watched and restarted here, and the scorer that asks them.

Scoring an item fills the judge prompt (rl/tasks/judging.py), renders it as the judge's
user turn through the judge's own chat template, sends the ids to a server (round robin;
token in, token out, greedy, like the policy's servers), decodes the answer and parses it.
An answer the parser cannot read, a server that refuses or is gone, and an overrun of
``reward.judge.timeout_s`` each give a failed score of 0 and a counter, as the rule
function's worker pool does; the job goes on. A judge server that dies or stops answering
is restarted on its port by the watchdog the policy's servers have (rl/serving/watchdog.py);
items sent meanwhile fail and are counted. One that cannot stay up ends the rank.

The scorer has the worker pool's interface (``submit``, ``stats``, ``close``), so the
reward rank serves either the same way.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rl.reward.executor import RewardStats
from rl.serving import server_api as api
from rl.serving.launcher import ServerConfig, ServerLauncher
from rl.serving.watchdog import Watchdog
from rl.tasks import judging
from rl.tasks.scoring import ScoreItem, ScoreResult
from rl.tasks.tokenizer import HFCodec

if TYPE_CHECKING:
    from rl.config.schema import JudgeConfig
    from rl.serving.server_api import ServerKeys

WATCH_S = 2.0  # how often the judge servers are checked
HEALTH_TIMEOUT_S, HEALTH_FAILURES = 10.0, 3


class JudgeScorer:
    """``submit(item)`` -> Future[ScoreResult], scored by the judge's servers."""

    def __init__(self, cfg: JudgeConfig, keys: ServerKeys | None, log_dir: Path):
        assert cfg.model_path is not None, "checked before launch"
        self.cfg = cfg
        self.template = judging.prompt_template(cfg.prompt)
        self.parse = judging.load_parser(cfg.parser)
        self.codec = HFCodec(cfg.model_path, "reward.judge.model_path")  # ends at every EOS
        self.sampling = {"temperature": 0.0, "max_new_tokens": cfg.max_new_tokens,
                         "stop_token_ids": list(self.codec.eos_ids)}  # fmt: skip
        server = ServerConfig(model_path=cfg.model_path, dtype=cfg.dtype, threads=cfg.threads,
                              max_total_tokens=cfg.max_total_tokens,
                              context_length=cfg.context_length,
                              startup_timeout=cfg.startup_timeout, keys=keys)  # fmt: skip
        self.launcher = ServerLauncher(server, n=cfg.servers, log_dir=log_dir)
        self.stats = RewardStats()
        self._next = itertools.cycle(range(cfg.servers))
        self._pool = cf.ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="judge")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_servers, name="judge-watch",
                                       daemon=True)  # fmt: skip

    def start(self) -> JudgeScorer:
        self.launcher.start()
        self._watch.start()
        return self

    def __enter__(self) -> JudgeScorer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prompt_ids(self, item: ScoreItem) -> list[int]:
        """The judge's user turn, its assistant turn opened (its own chat template; the
        text alone for a model without one)."""
        text = judging.render(self.template, item.prompt, item.response, item.label,
                              item.metadata)  # fmt: skip
        message = {"role": "user", "content": text}
        return self.codec.render([message], chat=self.codec.has_chat_template)[0]

    def submit(self, item: ScoreItem) -> cf.Future[ScoreResult]:
        return self._pool.submit(self._score, item)

    def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        return [f.result() for f in [self.submit(i) for i in items]]

    def _score(self, item: ScoreItem) -> ScoreResult:
        t0 = time.perf_counter()
        with self._lock:
            url = self.launcher.servers[next(self._next)].url
        try:
            call = api.generate([self.prompt_ids(item)], [self.sampling])
            reply = api.call(url, call, self.launcher.keys, timeout=self.cfg.timeout_s)
            ids = [int(t) for t in api.generate_results(reply, 1)[0]["output_ids"]]
        except api.CallError as e:
            return self._failed(f"judge {e}", timeout="timed out" in e.detail)
        except (ValueError, TypeError, KeyError) as e:  # a reply that is not a generation
            return self._failed(f"judge reply: {type(e).__name__}: {e}")
        answer = self.codec.response_text(ids)
        try:  # the parser may be the user's: whatever it raises is a failed score
            score = float(self.parse(answer))
        except Exception as e:
            return self._failed(f"judge answer {answer[:60]!r}: {type(e).__name__}: {e}")
        if not math.isfinite(score):
            return self._failed(f"judge answer {answer[:60]!r}: parsed as {score}")
        with self._lock:
            self.stats.scored += 1
        return ScoreResult(score, {"judge_s": time.perf_counter() - t0})

    def _failed(self, why: str, timeout: bool = False) -> ScoreResult:
        with self._lock:
            if timeout:
                self.stats.timeouts += 1
            else:
                self.stats.failures += 1
            self.stats.last_error = why
        return ScoreResult(0.0, {}, failed=True)

    def _watch_servers(self) -> None:
        """Restart a judge server that died or stopped answering; raising (one that cannot
        stay up) ends the rank (rl/runtime/launch.py install_thread_hook)."""
        c = self.cfg
        watch = Watchdog(
            self.launcher,
            c.max_restarts,
            c.restart_window_s,
            HEALTH_TIMEOUT_S,
            health_failures=HEALTH_FAILURES,
            who="judge",
            fields="reward.judge",
        )
        while not self._stop.wait(WATCH_S):
            try:
                watch.check()  # it says what it restarted
            except Exception:
                if self._stop.is_set():  # closing: a restart under way lost its server
                    return
                raise

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.launcher.stop(grace=0)
