"""One module per RL objective, each defining ``OBJECTIVE``
(rl/algorithms/registry.py)."""
