"""The single controller: it drives the executors (trainer, generator, reward) through
their handles and holds the RL loop's state.

- rl/controller/loop.py: the controller rank's entry: handles, the trainer's warm-up, then
  the RL stage (:class:`~rl.controller.run.RLRun`), plots and the final line.
- rl/controller/run.py: one RL step as calls in order (its docstring lists them), and the
  listeners that run beside the steps (``LISTENERS``); the threads are named in
  rl/threads.py (``THREADS``).
- The pieces a step calls: the rollout stream (rollouts.py, lockstep.py, episodes.py)
  under the staleness bound (staleness.py), the next batch taken ahead (prefetch.py) and
  assembled (batch.py), the weight sync (weight_sync.py), server recovery (recovery.py),
  evaluation (evaluate.py), the rollout state saved for resume (rollout_state.py).

Each rank's entry into the job is rl.runtime.job.
"""
