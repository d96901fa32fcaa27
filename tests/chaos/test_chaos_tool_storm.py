"""Chaos: a storm of 10,000 fuzzed tool calls (reliability.md E1) through the parser
(rollout/parse.py) and the envs' tool handling (envs/tools.py) on Calculator-v0 and
Retrieval-v0, without Ray: every call is invalid by construction and must come back as an
`Error: ...` tool observation (UTF-8 encodable), the episode going on; nothing may raise.
tests/rollout/test_parse.py explores the same classes with hypothesis; this is the volume run,
seeded, so a failure names its call."""

from __future__ import annotations

import json
from collections import Counter

import gymnasium
import numpy as np
import pytest

import envs  # noqa: F401  (registers the envs)
from rollout.parse import parse_turn

CALLS = 10_000
ENVS = ["agentrl/Calculator-v0", "agentrl/Retrieval-v0"]
JUNK = ["", "{", '{"a": ', "[1, 2]", "null", "nan", "not json", "\x00\x01", "}{", '"\\ud800"']
WRONG = {  # values of every JSON type but the declared one
    "string": [None, True, 3, -1.5, [1, 2], {"a": {"b": [None]}}, 2**70],
    "integer": [None, True, -1.5, "7", [1, 2], {"a": {"b": [None]}}, 1e308],
}


def _name(rng, tools: list[str]) -> str:
    return tools[int(rng.integers(len(tools)))]


def _bytes(rng, n: int) -> str:
    return bytes(rng.integers(0, 256, n, dtype=np.uint8)).decode("utf-8", "surrogateescape")


def _wrong(rng, kind: str):
    values = WRONG[kind]
    return values[int(rng.integers(len(values)))]


def storm_call(rng, tools: list[str], schema: dict[str, dict[str, str]]) -> tuple[str, str]:
    """(class, assistant turn text) of one invalid tool call."""
    kind = ["json", "types", "huge", "unknown", "utf8", "args", "shape", "envelope", "deep"][
        int(rng.integers(9))
    ]
    name = _name(rng, tools)
    types = schema[name]
    params = list(types)
    good = {p: "1 + 1" if t == "string" else 1 for p, t in types.items()}
    if kind == "json":  # a well-formed call cut short, or junk as the body
        body = json.dumps({"name": name, "arguments": good})
        body = body[: int(rng.integers(1, len(body)))] if rng.random() < 0.7 else rng.choice(JUNK)
    elif kind == "types":  # every declared argument, of a wrong type
        args = {p: _wrong(rng, t) for p, t in types.items()}
        body = json.dumps({"name": name, "arguments": args})
    elif kind == "huge":  # 64 to 256 KiB: as a raw argument string, or an unknown argument
        size = int(2 ** rng.uniform(16, 18))
        if rng.random() < 0.5:
            body = json.dumps({"name": name, "arguments": json.dumps({params[0]: "9" * size})})
        else:
            body = json.dumps({"name": name, "arguments": {"blob": "y" * size}})
    elif kind == "unknown":
        unknown = rng.choice(["nope", "", " ", "calculate ", "SEARCH", "a" * 500, "\x00"])
        body = json.dumps({"name": str(unknown), "arguments": good})
    elif kind == "utf8":  # undecodable bytes as the body or inside the arguments
        raw = _bytes(rng, int(rng.integers(1, 200)))
        body = raw if rng.random() < 0.5 else json.dumps({"name": name, "arguments": raw})
    elif kind == "args":  # a required argument missing, or an extra one
        args = {k: v for k, v in good.items() if rng.random() < 0.5 and k != params[0]}
        if rng.random() < 0.5:
            args = {**good, "unexpected": 1}
        body = json.dumps({"name": name, "arguments": args})
    elif kind == "shape":  # arguments or the call itself not an object
        value = _wrong(rng, "string")
        body = json.dumps(
            {"name": name, "arguments": [value]} if rng.random() < 0.5 else [name, value]
        )
    elif kind == "envelope":  # unclosed block, or no name
        body = json.dumps({"arguments": good}) if rng.random() < 0.5 else None
    else:  # nested far past the recursion limit
        body = json.dumps({"name": name, "arguments": "[" * 5000 + "]" * 5000})
    if body is None:
        return kind, f"<tool_call>{json.dumps({'name': name, 'arguments': good})}"
    return kind, f"{_bytes(rng, int(rng.integers(0, 8)))}<tool_call>{body}</tool_call>"


@pytest.mark.slow
def test_ten_thousand_fuzzed_tool_calls_all_become_error_observations():
    rng = np.random.default_rng(0)
    envs_ = [gymnasium.make(env_id, max_turns=10**6) for env_id in ENVS]
    for env in envs_:
        env.reset(seed=0)
    schema = {
        t["function"]["name"]: {
            p: spec["type"] for p, spec in t["function"]["parameters"]["properties"].items()
        }
        for env in envs_
        for t in env.unwrapped.tools
    }
    tools = [[t["function"]["name"] for t in env.unwrapped.tools] for env in envs_]
    kinds, errors, crashed = Counter(), 0, []
    for i in range(CALLS):
        env = envs_[i % len(envs_)]
        kind, text = storm_call(rng, tools[i % len(envs_)], schema)
        kinds[kind] += 1
        try:
            obs, _, terminated, truncated, info = env.step(parse_turn(text).message)
        except Exception as exc:  # counted, then the test fails naming the call
            crashed.append((i, kind, repr(exc)[:200]))
            env.reset(seed=i)
            continue
        assert not (terminated or truncated), (i, kind, text[:300])
        assert len(obs) == 1 and info["tool_errors"] == 1, (i, kind, text[:300], obs)
        assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("Error: "), (i, kind)
        obs[0]["content"].encode("utf-8")
        errors += 1
        if i % 500 == 499:  # keep each env's transcript short
            env.reset(seed=i)
    print(
        f"[a storm of {CALLS:,} fuzzed tool calls] calls {CALLS} = error observations {errors} "
        f"+ crashed {len(crashed)}; by class {dict(sorted(kinds.items()))}"
    )
    assert not crashed, crashed[:5]
    assert errors == CALLS
