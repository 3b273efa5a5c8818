"""Misbehaving scorers for the reward executor's tests (imported by worker processes)."""

from __future__ import annotations

import os
import time


def flaky(response: str, answer: str) -> float:
    """Raises on 'boom', hangs on 'hang', kills its process on 'die', else exact match."""
    if response == "boom":
        raise ValueError("scorer exploded")
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os._exit(7)
    return float(response == answer)
