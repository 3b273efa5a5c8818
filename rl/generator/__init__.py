"""The generator executor: SGLang servers producing token-in/token-out rollouts.

* ``server_api``: every HTTP route we call on a server, its body and its errors (blocking
  and asyncio), and the load format of the DDMA receiver the servers start with.
* ``launcher``: start N SGLang servers as subprocesses, health-checked, restartable, never
  orphaned (``cpu_shim`` is what SGLang needs on a CPU-only machine).
* ``client``: many requests in flight over the servers, least-loaded routing, rollouts
  streamed back as they finish; pause/abort/continue, cache flush, and versioned weight
  updates (``weight_payload`` builds SGLang's bucket wire format).
* ``ddma_target``: a server as DDMA feeds it (trainer ranks stage or send their shards,
  the controller brackets each version).
* ``types``: the ``Rollout`` record (per-token log-probs and weight versions, resumable
  segments) and the parsing of results; sampling parameters are rl/config/sampling.py.
  Pure logic.
"""
