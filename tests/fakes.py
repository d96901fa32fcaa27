"""Small fakes of our own interfaces (never of Ray or Redis)."""

from __future__ import annotations

from collections.abc import Callable

from policy.sampling import Completion, SamplingParams


class ScriptedPolicy:
    """Returns canned completions: `script(prompt_ids) -> text`, tokenized with `tokenizer`."""

    def __init__(self, tokenizer, script: Callable[[list[int]], str]):
        self.tokenizer, self.script, self.version = tokenizer, script, 0
        self.calls = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.calls += 1
        out = []
        for prompt in prompts:
            ids = self.tokenizer.encode(self.script(prompt), add_special_tokens=False)
            ids = ids[: params.max_new_tokens]
            stop = bool(ids) and ids[-1] in params.stop_token_ids
            out.append(
                Completion(
                    token_ids=ids,
                    logprobs=[-0.5] * len(ids),
                    finish_reason="stop" if stop else "length",
                )
            )
        return out
