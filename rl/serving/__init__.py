"""SGLang servers as this project runs them, for every executor that serves a model: the
generator's policy servers and the reward ranks' LLM judge.

* ``server_api``: every HTTP route we call on a server, its body and its errors (blocking
  and asyncio), and the load format of the DDMA receiver the servers start with.
* ``launcher``: start N SGLang servers as subprocesses, health-checked, restartable, never
  orphaned (``server_guard`` leads each server's process group).
* ``watchdog``: notice a dead or unresponsive server and restart it, within a budget.
* ``cpu_shim``: what SGLang needs on a CPU-only machine, loaded into each server by a
  ``sitecustomize``: per-request seeds (``cpu_seeds``), batch-invariant products
  (``cpu_batch_invariant``), no tqdm semaphore (``server_footprint``), forked children
  (``cpu_fork``), routed experts in plain memory (``cpu_routed_experts``), Qwen2-MoE's gated
  shared expert in torch (``cpu_shared_expert_gate``), one attention call per batch rather
  than per request (``cpu_batched_attention``), each a patch applied after its module
  imports (``after_import``).
"""
