"""Any of our tool envs in TRL: `GRPOTrainer(environment_factory=trl_environment(env_id))`.

TRL 1.16's contract (trl/trainer/grpo_trainer.py): the factory is called with no arguments; every
public method of the instance's class becomes a tool (its schema from type hints and a
Google-style docstring, as ours); `reset(**row)` returns text appended to the last user message;
`get_reward()` scores the finished rollout. TRL ends an episode when the model stops calling
tools and never shows that last message to the environment, so the adapter adds an
`answer(answer)` tool when the env has none: the answer is graded as the env's final message.

    from trl import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model=..., args=GRPOConfig(..., max_steps=10), processing_class=tok,
                          environment_factory=trl_environment("agentrl/Calculator-v0"))

A tool call that fails (bad arguments, a tool error) raises, so TRL counts it in
`tools/failure_frequency` and shows the model our error text.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import gymnasium

from envs.tools import Tool, resolved_hints
from envs.types import assistant, tool_call

SEED_STRIDE = 1_000_003


class TRLEnvironment:
    """Base of the generated classes; public methods are added per env (one per tool)."""

    env_id: str = ""
    env_kwargs: dict[str, Any] = {}  # noqa: RUF012  (replaced per generated class)
    seed: int = 0
    _instances: itertools.count

    def __init__(self) -> None:
        self._env = gymnasium.make(self.env_id, **self.env_kwargs)
        self._index = next(type(self)._instances)
        self._episodes = 0
        self._outcome: dict[str, Any] | None = None
        self._done = True

    def reset(self, **row: Any) -> str:
        """Start an episode (a `seed` column in the dataset picks the task); returns its prompt."""
        seed = row.get("seed")
        if not isinstance(seed, int):
            seed = self.seed + self._index * SEED_STRIDE + self._episodes
        self._episodes += 1
        opening, _ = self._env.reset(seed=seed)
        self._outcome, self._done = None, False
        return "\n\n".join(m["content"] for m in opening)

    def get_reward(self) -> float:
        """1.0 if the episode ended with the task solved, else 0.0."""
        return float(bool(self._outcome and self._outcome.get("success")))

    def _step(self, action: dict[str, Any]) -> str:
        if self._done:
            raise RuntimeError("the episode is over; no more tool calls")
        observation, _, terminated, truncated, info = self._env.step(action)
        if terminated or truncated:
            self._done, self._outcome = True, info.get("outcome")
        content = observation[0]["content"] if observation else "Episode finished."
        if content.startswith("Error:"):
            raise ValueError(content.removeprefix("Error:").strip())
        return content

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        return self._step(assistant("", [tool_call(name, arguments)]))


def _method_for(tool: Tool) -> Any:
    name = tool.name

    def method(self, **kwargs: Any) -> str:
        return self._call(name, kwargs)

    _copy_signature(method, tool.fn, name)
    return method


def _copy_signature(method: Any, fn: Any, name: str) -> None:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    method.__signature__ = sig.replace(parameters=params, return_annotation=str)
    hints = resolved_hints(fn)
    method.__annotations__ = {k: v for k, v in hints.items() if k != "self"} | {"return": str}
    method.__name__ = method.__qualname__ = name
    method.__doc__ = fn.__doc__


def answer(self, answer: str) -> str:  # no hint on self: TRL builds the schema from hints
    """Give the final answer and end the episode.

    Args:
        answer: The final answer to the user's question.
    """
    return self._step(assistant(answer))


def trl_environment(env_id: str, *, seed: int = 0, **kwargs: Any) -> type[TRLEnvironment]:
    """A class to pass as `environment_factory`: each instance wraps `gymnasium.make(env_id,
    **kwargs)`; episode i of instance k uses seed `seed + k * 1000003 + i` (or the row's seed)."""
    inner = gymnasium.make(env_id, **kwargs).unwrapped
    tools = {name: inner.toolbox.get(name).tool for name in inner.toolbox.names}
    inner.close()
    namespace: dict[str, Any] = {name: _method_for(t) for name, t in tools.items()}
    clash = {"reset", "get_reward"} & set(namespace)
    if clash:
        raise ValueError(f"{env_id}: tool names {sorted(clash)} clash with TRL's reserved methods")
    if "answer" not in namespace:
        namespace["answer"] = answer  # TRL names a tool by its __name__, so it must be "answer"
    namespace.update(
        env_id=env_id, env_kwargs=dict(kwargs), seed=seed, _instances=itertools.count()
    )
    class_name = "".join(ch for ch in env_id.split("/")[-1] if ch.isalnum()) + "TRL"
    return type(class_name, (TRLEnvironment,), namespace)
