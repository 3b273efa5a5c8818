"""One module per off-policy correction, each defining ``CORRECTION``
(rl/algorithms/weights.py; found by rl/algorithms/registry.py)."""
