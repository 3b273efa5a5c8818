"""The reward executor: rule-based scorers in a pool of worker processes."""
