"""The generator executor: SGLang servers producing token-in/token-out rollouts.

Its servers are started, watched and restarted by rl/serving (shared with the LLM judge).

* ``service``: the generator ranks (servers up, watched, restarted) and the controller's
  handle.
* ``client``: many requests in flight over the servers, least-loaded routing, rollouts
  streamed back as they finish; pause/abort/continue, cache flush, and versioned weight
  updates (``weight_payload`` builds SGLang's bucket wire format).
* ``ddma_target``: a server as DDMA feeds it (trainer ranks stage or send their shards,
  the controller brackets each version).
* ``types``: the ``Rollout`` record (per-token log-probs and weight versions, resumable
  segments) and the parsing of results; sampling parameters are rl/config/sampling.py.
  Pure logic.
* ``routing``: routing replay's rows (the experts each token was routed to), read from
  replies, checked, and saved with a rollout state.
"""
