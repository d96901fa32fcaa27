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


class ScriptedSession:
    """A DecodeSession fake: each key's next turn is `script(context) -> text`, emitted one token
    per step (the sampled token is fed lazily, like the real sessions)."""

    def __init__(self, tokenizer, script: Callable[[list[int]], str]):
        self.tokenizer, self.script, self.version = tokenizer, script, 0
        self.context: dict = {}
        self.queued: dict = {}
        self.pending: dict = {}
        self.steps: list[list] = []  # the keys of every step() call

    def add(self, keys, token_ids):
        for key, ids in zip(keys, token_ids, strict=True):
            self.context.setdefault(key, []).extend(self.pending.pop(key, []) + list(ids))
            self.queued.pop(key, None)
        return [None] * len(keys)

    def step(self, keys, params: SamplingParams):
        from types import SimpleNamespace

        self.steps.append(list(keys))
        out = []
        for key in keys:
            self.context[key].extend(self.pending.pop(key, []))
            if key not in self.queued:
                text = self.script(self.context[key])
                self.queued[key] = self.tokenizer.encode(text, add_special_tokens=False)
            token = self.queued[key].pop(0)
            if not self.queued[key]:
                del self.queued[key]
            self.pending[key] = [token]
            out.append(SimpleNamespace(token=token, logprob=-0.5, routes=None))
        return out

    def bytes_for(self, tokens):
        return 100 * tokens  # a made-up cache model: 100 bytes per token

    def reserve_for(self, tokens):
        return 2 * self.bytes_for(tokens)  # as a cache that grows by doubling

    def drop(self, keys):
        for key in keys:
            for store in (self.context, self.queued, self.pending):
                store.pop(key, None)
