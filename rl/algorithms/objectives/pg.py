"""``pg``: the off-policy-corrected policy gradient ``-stopgrad(w) * A * log pi``, ``w``
the correction's weight (``algorithm=aipo``: with the aipo correction, LlamaRL's AIPO)."""

from __future__ import annotations

from rl.algorithms.losses import pg_loss
from rl.algorithms.registry import Objective

OBJECTIVE = Objective("pg", lambda a, weight: pg_loss(weight, a.kl_coef))
