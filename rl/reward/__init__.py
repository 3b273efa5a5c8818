"""The reward executor: reward functions (rl/tasks/scoring.py) in worker processes."""
