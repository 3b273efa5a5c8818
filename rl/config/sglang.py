"""What SGLang can serve: the device, TP size and dtype limits of one server.

Config validation (``rollout.*``, before launch) and the server launcher (each server,
before it is spawned) refuse the same layouts with the same message, so both ask here.
"""

from __future__ import annotations

from rl.config.dtypes import PARAM_DTYPES

# Where a server's DDMA receiver (rl/ddma/sglang_receiver.py) stages an incoming version:
# rollout.weight_sync.staging.
WEIGHT_STAGINGS = ("device", "host", "none")
# How servers relay DDMA buckets to servers (rl/ddma/relay.py): rollout.weight_sync.relay.
RELAYS = ("none", "chain", "tree")


def layout_problem(device: str, tp: int, dtype: str, where: str) -> str | None:
    """Why SGLang cannot serve ``tp``/``dtype`` on ``device`` (None if it can).

    ``where`` names the section in the message (``rollout`` or ``server``). Weights are
    served in the trainer's dtypes; FP8 is a quantisation of them (GPU only), not a dtype."""
    if device not in ("cpu", "cuda"):
        return f"{where}.device={device!r} must be 'cpu' or 'cuda'"
    if not (isinstance(tp, int) and tp >= 1):
        return f"{where}.tp={tp!r} must be an integer >= 1"
    if dtype not in PARAM_DTYPES:
        return f"{where}.dtype={dtype!r} must be one of {PARAM_DTYPES}"
    if device == "cpu" and tp != 1:
        return f"{where}.tp={tp}: SGLang runs on CPU only at tp=1"
    return None
