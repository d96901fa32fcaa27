from __future__ import annotations

import json

import gymnasium
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs  # noqa: F401  (registers the envs)
from envs.calculator import CalculatorEnv
from envs.tools import ToolError, validate_arguments
from rollout.parse import parse_turn


def test_plain_answer_has_no_tool_calls():
    parsed = parse_turn("42")
    assert parsed.message == {"role": "assistant", "content": "42"}
    assert parsed.errors == []


def test_well_formed_call():
    parsed = parse_turn(
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 + 2"}}\n</tool_call>'
    )
    assert parsed.errors == []
    assert parsed.message["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "calculate", "arguments": {"expression": "1 + 2"}},
        }
    ]


def test_two_calls_and_text():
    text = (
        'thinking <tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{}"}</tool_call>'
    )
    parsed = parse_turn(text)
    assert parsed.message["content"] == "thinking"
    assert [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["a", "b"]


def test_broken_json_keeps_the_name_and_reports():
    parsed = parse_turn(
        '<tool_call>{"name": "calculate", "arguments": {"expression": "1 +</tool_call>'
    )
    assert parsed.errors == ["tool call is not valid JSON"]
    call = parsed.message["tool_calls"][0]["function"]
    assert call["name"] == "calculate" and isinstance(call["arguments"], str)


def test_unclosed_block_and_missing_name():
    parsed = parse_turn('<tool_call>{"name": "calculate"')
    assert "unclosed <tool_call>" in parsed.errors
    parsed = parse_turn('<tool_call>{"arguments": {}}</tool_call>')
    assert parsed.errors == ['tool call needs a string "name"']
    assert parsed.message["tool_calls"][0]["function"]["name"] == ""


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("utf-8", "replace")))
def test_any_text_parses_and_the_env_answers_without_raising(text):
    for candidate in (text, f"<tool_call>{text}</tool_call>", f"<tool_call>{text}"):
        parsed = parse_turn(candidate)
        env = CalculatorEnv()
        env.reset(seed=0)
        obs, _, terminated, _, _ = env.step(parsed.message)
        if parsed.message.get("tool_calls"):
            assert obs and all(m["role"] == "tool" for m in obs)
        else:
            assert terminated


# --- hostile tool calls, end to end: parse_turn -> env.step (reliability.md E1) -------------
CHEAP_ENVS = ["agentrl/Calculator-v0", "agentrl/Retrieval-v0"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def invalid_utf8(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")  # undecodable bytes become lone surrogates


@st.composite
def hostile_turns(draw):
    names = st.sampled_from(["calculate", "search", "open", "answer", "nope", "", "calculate\x00"])
    name = draw(names | st.text(max_size=30))
    args = draw(
        st.dictionaries(st.sampled_from(["expression", "query", "doc_id", "x"]), JSON_VALUES)
        | JSON_VALUES
    )
    body = json.dumps({"name": name, "arguments": args})
    kind = draw(st.sampled_from(["whole", "truncated", "huge", "bytes", "raw_args"]))
    if kind == "truncated":
        body = body[: draw(st.integers(0, max(len(body) - 1, 0)))]
    elif kind == "huge":
        body = json.dumps({"name": name, "arguments": {"expression": "1+" * 400_000 + "1"}})
    elif kind == "bytes":
        body = invalid_utf8(draw(st.binary(max_size=200)))
    elif kind == "raw_args":
        body = json.dumps({"name": name, "arguments": invalid_utf8(draw(st.binary(max_size=60)))})
    closed = draw(st.booleans())
    return f"{draw(st.text(max_size=20))}<tool_call>{body}" + ("</tool_call>" if closed else "")


@pytest.mark.parametrize("env_id", CHEAP_ENVS)
@settings(max_examples=150, deadline=None)
@given(turn=hostile_turns())
def test_hostile_tool_calls_get_error_observations_and_the_episode_continues(env_id, turn):
    parsed = parse_turn(turn)
    env = gymnasium.make(env_id, max_turns=3)
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(parsed.message)
    if terminated:  # only a valid `answer` call may end the episode
        assert info["outcome"]["success"] in (True, False)
        return
    assert obs and all(m["role"] == "tool" for m in obs)
    for m in obs:
        m["content"].encode("utf-8")  # always encodable text for the tokenizer
    if parsed.errors:
        assert info["tool_errors"] >= 1 and obs[0]["content"].startswith("Error: ")
    assert not truncated
    env.step({"role": "assistant", "content": "still here"})  # the episode goes on


@settings(max_examples=300, deadline=None)
@given(arguments=JSON_VALUES | st.binary(max_size=300).map(invalid_utf8))
def test_argument_validation_never_raises_anything_but_tool_error(arguments):
    for schema in CalculatorEnv().tools:
        try:
            validate_arguments(schema, arguments)
        except ToolError as exc:
            assert str(exc)
