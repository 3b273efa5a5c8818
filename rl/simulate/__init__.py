"""The step-time simulator (``python -m rl.simulate``): one RL step of a GPU preset,
synchronous and asynchronous, from the planner's layout and a hardware profile
(``cluster.hardware``); and its calibration against this machine's benchmark
(rl/simulate/calibrate.py). Pure logic."""

from rl.simulate.simulation import PAPER, Simulation, simulate
from rl.simulate.step import Phases, async_step, sync_step

__all__ = ["PAPER", "Phases", "Simulation", "async_step", "simulate", "sync_step"]
