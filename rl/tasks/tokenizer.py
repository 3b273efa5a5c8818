"""A Hugging Face tokenizer from a local model directory, offline, as the loop needs it.

The servers run token-in/token-out (``--skip-tokenizer-init``), so the tokenizer lives on
the controller: it renders prompts (chat template included) into ids once, and turns
response ids back into the text the reward function scores. Every end-of-response id of
the model (``generation_config.json``'s ``eos_token_id``, which chat models give as a
list, plus the tokenizer's own EOS) ends a response.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from rl.tasks.common import TaskError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _ids(value: Any) -> list[int]:  # a JSON value: an id, a list of ids or null
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def check_tokenizer_dir(path: str, field: str) -> Path:
    """The directory, or a TaskError naming ``field`` when it cannot hold a tokenizer."""
    p = Path(path)
    if not p.is_dir():
        raise TaskError(f"{field}={path!r} is not a directory")
    if not any((p / f).exists() for f in _TOKENIZER_FILES):
        raise TaskError(
            f"{field}={path!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)})"
        )
    return p


class HFCodec:
    """Render prompts and decode responses with a local HF tokenizer."""

    def __init__(self, path: str, field: str = "task.tokenizer"):
        p = check_tokenizer_dir(path, field)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # transformers raises many types; the message is what helps
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TaskError(f"{field}={path!r}: the tokenizer does not load: {first}") from None
        eos = _ids(self.tok.eos_token_id)
        gen = p / "generation_config.json"
        if gen.exists():
            eos += _ids(json.loads(gen.read_text()).get("eos_token_id"))
        if not eos:
            raise TaskError(f"{field}={path!r}: no EOS token id (tokenizer or generation_config)")
        self.eos_ids = tuple(dict.fromkeys(eos))  # ordered, unique
        # The token a supervised target ends with: the one that closes a chat turn.
        self.end_id = (
            _ids(self.tok.eos_token_id)[0] if self.tok.eos_token_id is not None else eos[0]
        )
        pad = self.tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def render(self, messages: list[dict[str, Any]], chat: bool) -> tuple[list[int], str]:
        """Prompt ids and text: the chat template with the assistant turn opened, or the
        contents joined by blank lines and tokenized plainly."""
        if chat:
            out = self.tok.apply_chat_template(messages, add_generation_prompt=True)
            # A BatchEncoding when the tokenizer returns dicts. One conversation, tokenized,
            # is a list of ids (transformers' return type also covers text and batches).
            ids = cast("list[int]", out["input_ids"] if isinstance(out, Mapping) else out)
            text = self.tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return [int(i) for i in ids], str(text)
        text = "\n\n".join(m["content"] for m in messages)
        return list(self.tok(text)["input_ids"]), text

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def response_text(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        for i, t in enumerate(ids):
            if t in self.eos_ids:
                ids = ids[:i]
                break
        # One sequence of ids decodes to one string (the return type also covers batches).
        return cast(str, self.tok.decode(ids, skip_special_tokens=True))


def vocab_mismatch(a: str, b: str) -> str | None:
    """Why the tokenizers of the directories ``a`` and ``b`` give tokens other ids (the first
    token that differs), or None when their vocabularies are the same."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    va, vb = (AutoTokenizer.from_pretrained(p, local_files_only=True).get_vocab() for p in (a, b))
    if len(va) != len(vb):
        return f"{len(va)} tokens against {len(vb)}"
    for token, i in sorted(va.items(), key=lambda kv: kv[1]):
        if vb.get(token) != i:
            return f"token {token!r} is id {i} against {vb.get(token)}"
    return None
