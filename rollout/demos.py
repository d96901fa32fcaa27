"""Demonstrations (message lists) -> token ids with the loss mask the policy is trained on.

Uses the same renderer as the rollout loop, so a demonstration's tokens are laid out exactly as
the policy's own episodes are: the prompt and tool results with mask 0, assistant turns with 1.
"""

from __future__ import annotations

from envs.types import Message
from rollout.render import ChatRenderer


def render_demonstration(
    renderer: ChatRenderer, messages: list[Message], tools: list[dict]
) -> tuple[list[int], list[int]]:
    first_assistant = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = renderer.prompt(messages[:first_assistant], tools)
    mask = [0] * len(ids)
    i = first_assistant
    while i < len(messages):
        turn = renderer.assistant(messages[:i], messages[i], tools)
        ids += turn
        mask += [1] * len(turn)
        j = i + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j < len(messages):  # the episode continued: append the observations in between
            seg = renderer.observation(messages[: i + 1], messages[i + 1 : j], tools)
            ids += seg
            mask += [0] * len(seg)
        i = j
    return ids, mask
