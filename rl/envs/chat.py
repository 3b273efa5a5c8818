"""A conversation's tokens, turn by turn, as the chat template renders them, without ever
re-tokenizing what the model generated.

The prompt is the template's rendering of the first messages with the assistant turn
opened. After each response (the sampled ids, kept as they are), the observation's tokens
are the template's text between the end of that response and the next opened assistant
turn: render the conversation with and without the observation messages, take the
difference, and prepend what the template writes after an assistant turn's end token
(ChatML's newline). Tokenizing that text alone gives the ids the full rendering has,
because an end-of-turn token is a special token that no merge crosses.

So the ids equal ``apply_chat_template`` of the final conversation wherever the template
renders earlier turns unchanged as turns are added, and the model's tokens are the
tokenizer's own for its text. It cannot where a template rewrites history (Qwen3 drops
earlier turns' ``<think>`` blocks): :class:`ChatRenderer` raises rather than guess, and the
trajectory keeps the sampled tokens, which are what the policy was trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

Message = dict[str, Any]
TEMPLATES = Path(__file__).with_name("templates")


class ChatError(ValueError):
    """A template that cannot carry a multi-turn, tool-using conversation (one line)."""


class ChatTokenizer(Protocol):
    """What this needs from a Hugging Face tokenizer. Its own signatures are far wider
    (batches, tensors); these are the calls made here, and what is read back is checked
    or cast where it is used."""

    def apply_chat_template(self, conversation: list[Message], **kwargs: object) -> object: ...

    def convert_ids_to_tokens(self, ids: int) -> object: ...

    def __call__(self, text: str, add_special_tokens: bool) -> Mapping[str, list[int]]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool) -> object: ...


def template_text(name_or_path: str) -> str:
    """A template shipped here by name (``chatml_tools``) or a Jinja file by path."""
    shipped = TEMPLATES / f"{name_or_path}.jinja"
    path = shipped if shipped.is_file() else Path(name_or_path)
    if not path.is_file():
        known = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))
        raise ChatError(f"env.chat_template={name_or_path!r}: not one of {known} nor a file")
    return path.read_text()


class ChatRenderer:
    """Render a conversation's prompt and observations as token ids."""

    def __init__(
        self,
        tok: ChatTokenizer,
        end_id: int,
        tools: Sequence[Mapping[str, Any]] = (),
        template: str | None = None,
    ):
        self.tok, self.end_id = tok, end_id
        self.tools = [dict(t) for t in tools] or None
        self.template = template  # None: the tokenizer's own
        self.end_text = cast(str, tok.convert_ids_to_tokens(end_id))
        self._check()

    def text(self, messages: Sequence[Message], opened: bool) -> str:
        return cast(
            str,
            self.tok.apply_chat_template(
                list(messages),
                tools=self.tools,
                chat_template=self.template,
                add_generation_prompt=opened,
                tokenize=False,
            ),
        )

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"]]

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        return self.encode(self.text(messages, opened=True))

    def decode(self, ids: Sequence[int]) -> str:
        """A turn's text as the environment reads it: special tokens kept, since a format's
        call markers may be special tokens."""
        return cast(str, self.tok.decode(list(ids), skip_special_tokens=False))

    def observation_ids(self, before: Sequence[Message], added: Sequence[Message]) -> list[int]:
        """The ids after an assistant turn's end token (``before`` ends with that turn) up
        to the next opened assistant turn, ``added`` in between."""
        head = self.text(before, opened=False)
        full = self.text([*before, *added], opened=True)
        if not full.startswith(head):
            raise ChatError(
                "the chat template renders earlier turns differently once turns are added; "
                "its tokens cannot be extended turn by turn"
            )
        cut = head.rfind(self.end_text)
        if cut < 0:
            raise ChatError(f"the chat template does not end a turn with {self.end_text!r}")
        return self.encode(head[cut + len(self.end_text) :] + full[len(head) :])

    def demonstration(
        self, start: Sequence[Message], turns: Sequence[Message]
    ) -> tuple[list[int], list[bool]]:
        """A demonstrated continuation of ``start`` (a warm-up's target) as an episode
        would hold it: each assistant turn's tokens (its text, then the end token), trained
        on, and what the template writes between turns (the tool results), not. ``turns``:
        assistant turns, each but the last answered by one or more other messages."""
        ids: list[int] = []
        trained: list[bool] = []
        conv, answers = list(start), []
        for m in turns:
            if m.get("role") != "assistant":
                answers.append(m)
                continue
            if answers:
                obs = self.observation_ids(conv, answers)
                ids, trained = ids + obs, trained + [False] * len(obs)
                conv, answers = conv + answers, []
            elif len(conv) > len(start):
                raise ChatError("a demonstration has two assistant turns in a row")
            turn = [*self.encode(str(m.get("content", ""))), self.end_id]
            ids, trained = ids + turn, trained + [True] * len(turn)
            conv.append(m)
        if answers or len(conv) == len(start):
            raise ChatError("a demonstration must end with an assistant turn")
        return ids, trained

    def _check(self) -> None:
        probe: list[Message] = [{"role": "user", "content": "hi"}]
        try:
            with_tools = self.text(probe, opened=True)
        except Exception as e:  # no template, or Jinja's errors: the message says which
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ChatError(f"the chat template does not render a conversation: {first}") from None
        names = [str(t.get("function", t).get("name", "")) for t in self.tools or ()]
        missing = [n for n in names if n not in with_tools]
        if missing:
            raise ChatError(
                f"the chat template does not render tools (no {missing[0]!r} in its prompt); "
                "set env.chat_template=chatml_tools or a template file that does"
            )
