from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from envs.calculator import CalculatorEnv
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
