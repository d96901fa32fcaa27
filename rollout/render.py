"""Token-in, token-out rendering of conversations with the tokenizer's own chat template.

History is never re-tokenized: the trajectory is the prompt's tokens, then exactly the tokens the
policy sampled, then the tokens of each new observation segment. A segment is found by rendering
the conversation with and without the new messages and taking the text after the assistant's
end-of-turn token, so any prefix-preserving chat template works unchanged.
"""

from __future__ import annotations

from typing import Any

from envs.types import Message
from rollout.parse import ParsedTurn, parse_turn


class TemplateError(ValueError):
    """The chat template does not extend the rendered history (it is not prefix-preserving)."""


class ChatRenderer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id

    def text(self, messages: list[Message], tools: list[dict] | None, *, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        """Tokens of the opening messages followed by the assistant's generation prompt."""
        return self.encode(self.text(messages, tools, generation=True))

    def assistant(self, history: list[Message], message: Message, tools) -> list[int]:
        """Tokens the template gives an assistant turn (through its end-of-turn token)."""
        before = self.text(history, tools, generation=True)
        after = self.text([*history, message], tools, generation=False)
        _check_prefix(before, after)
        end = after.rfind(self.eos) + len(self.eos)
        return self.encode(after[len(before) : end])

    def observation(self, history: list[Message], new: list[Message], tools) -> list[int]:
        """Tokens that follow the last assistant turn's end-of-turn token: `new`, then the next
        generation prompt. `history` ends with that assistant message."""
        before = self.text(history, tools, generation=False)
        after = self.text([*history, *new], tools, generation=True)
        _check_prefix(before, after)
        start = before.rfind(self.eos) + len(self.eos)
        return self.encode(after[start:])

    def parse(self, completion_ids: list[int]) -> ParsedTurn:
        text = self.decode(completion_ids)
        text = text.removesuffix(self.eos) if text.endswith(self.eos) else text
        return parse_turn(text)


def _check_prefix(before: str, after: str) -> None:
    if not after.startswith(before):
        raise TemplateError(
            "the chat template re-renders earlier turns differently when a message is added; "
            "token-in/token-out rendering needs a prefix-preserving template"
        )
