"""The reward executor: reward functions (rl/reward/functions.py) in worker processes."""
