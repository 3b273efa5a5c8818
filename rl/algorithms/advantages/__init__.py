"""One module per advantage estimator, each defining ``ESTIMATOR``
(rl/algorithms/estimator.py; found by rl/algorithms/registry.py)."""
