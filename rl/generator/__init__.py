"""The generator executor: SGLang servers producing token-in/token-out rollouts.

* ``launcher``: start N SGLang servers as subprocesses, health-checked, restartable, never
  orphaned (``cpu_shim`` is what SGLang needs on a CPU-only machine).
* ``client``: many requests in flight over the servers, least-loaded routing, rollouts
  streamed back as they finish; pause/abort/continue, cache flush, and versioned weight
  updates (``weight_payload`` builds SGLang's bucket wire format).
* ``types``: sampling parameters, request checks and the ``Rollout`` record (per-token
  log-probs and weight versions, resumable segments). Pure logic.
* ``hf_reference``: Hugging Face transformers as the reference generator, for tests.
"""
