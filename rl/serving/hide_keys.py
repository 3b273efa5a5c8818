"""A server's ``/server_info`` without its keys.

Why: SGLang's ``/server_info`` (and ``/get_server_info``, and gRPC's GetServerInfo) answers
any holder of the API key with the server's resolved arguments, ``admin_api_key``
included, both at its top level and in ``internal_states``. Every client of a job holds
the API key; the admin key alone allows weight updates, pause and abort. So the API key
was as good as the admin key.

What it replaces: nothing is rewritten. SGLang already passes every such answer (and its
request and config dumps) through ``redact_watermark_secrets``, which puts
``<redacted>`` in place of any field named in ``WATERMARK_SECRET_FIELD_NAMES``, at any
depth. This adds ``api_key`` and ``admin_api_key`` to that set, in
``sglang.srt.sampling.watermarking.core``, right after it is imported
(rl/serving/after_import.py), in every server process on every device (the
``sitecustomize`` that rl/serving/cpu_shim.py writes). The server's own arguments keep
their keys: the set is read only by the redaction. And ``redact_watermark_command_line``,
which makes the ``launch_command`` these answers carry (the keys our launcher passes in a
``--config`` file are merged into it), is wrapped to redact ``--api-key`` and
``--admin-api-key`` too. Versions: sglang 0.5.23.

Standard library only at import time: it runs before anything else in the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from rl.serving.after_import import patch_on_import

CORE = "sglang.srt.sampling.watermarking.core"
KEYS = frozenset({"api_key", "admin_api_key"})
FLAGS = ("--api-key", "--admin-api-key")
REDACTED = "<redacted>"  # SGLang's word


def redact_flags(command: str) -> str:
    """``command`` with each key flag's value redacted (``--api-key K``, ``--api-key=K``)."""
    words, out = command.split(" "), []
    for i, w in enumerate(words):
        if i and words[i - 1] in FLAGS:
            w = REDACTED
        for flag in FLAGS:
            if w.startswith(flag + "="):
                w = f"{flag}={REDACTED}"
        out.append(w)
    return " ".join(out)


def patch_core(module: ModuleType) -> None:
    """Redact the keys wherever SGLang redacts a watermark's secrets (idempotent)."""
    names = vars(module)["WATERMARK_SECRET_FIELD_NAMES"]
    vars(module)["WATERMARK_SECRET_FIELD_NAMES"] = frozenset(names) | KEYS
    line = vars(module)["redact_watermark_command_line"]
    if getattr(line, "_msrl_keys", False):
        return

    def redact_watermark_command_line(
        argv: Sequence[str], watermark_config: str | None = None
    ) -> str:  # SGLang's signature
        return redact_flags(line(argv, watermark_config))

    redact_watermark_command_line._msrl_keys = True  # type: ignore[attr-defined]
    vars(module)["redact_watermark_command_line"] = redact_watermark_command_line


def install() -> None:
    patch_on_import({CORE: patch_core})
