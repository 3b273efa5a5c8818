"""The servers' keys join what SGLang redacts (rl/serving/hide_keys.py)."""

from __future__ import annotations

from types import ModuleType

from rl.serving.hide_keys import KEYS, patch_core, redact_flags


def test_the_keys_join_the_secret_fields_and_the_command_line_once():
    core = ModuleType("core")
    core.WATERMARK_SECRET_FIELD_NAMES = frozenset({"watermark_key"})  # type: ignore[attr-defined]
    core.redact_watermark_command_line = lambda argv, cfg=None: " ".join(argv)  # type: ignore[attr-defined]
    patch_core(core)
    wrapped = core.redact_watermark_command_line  # type: ignore[attr-defined]
    patch_core(core)  # idempotent
    assert {"watermark_key", *KEYS} == core.WATERMARK_SECRET_FIELD_NAMES  # type: ignore[attr-defined]
    assert core.redact_watermark_command_line is wrapped  # type: ignore[attr-defined]
    argv = ["serve", "--api-key", "a1", "--admin-api-key=b2", "--port", "1"]
    assert wrapped(argv) == "serve --api-key <redacted> --admin-api-key=<redacted> --port 1"
    assert redact_flags("serve --port 1") == "serve --port 1"
