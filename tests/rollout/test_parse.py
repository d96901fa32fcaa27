from __future__ import annotations

import json

import gymnasium
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import envs  # noqa: F401  (registers the envs)
from envs.calculator import CalculatorEnv
from envs.tools import ToolError, validate_arguments
from rollout.parse import EXAMPLE, parse_turn


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
    assert len(parsed.errors) == 1 and "unclosed <tool_call>" in parsed.errors[0]
    parsed = parse_turn('<tool_call>{"arguments": {}}</tool_call>')
    assert parsed.errors == ['tool call needs a string "name"']
    assert parsed.message["tool_calls"][0]["function"]["name"] == ""


# --- near misses: a call the model got almost right is an error call, never a final answer ------
CALL = '{"name": "calculate", "arguments": {"expression": "1 + 2"}}'
NEAR_MISSES = [  # (turn, what the error must say)
    (f"{CALL}</tool_call>", 'found "</tool_call>" without an opening <tool_call>'),
    (f"Let me compute.\n{CALL}\n</tool_call>", "without an opening <tool_call>"),
    (f"<TOOL_CALL>{CALL}</TOOL_CALL>", 'found "<TOOL_CALL>"; ' + EXAMPLE + " (lowercase)"),
    (f"<Tool_Call>{CALL}</tool_call>", 'found "<Tool_Call>"; ' + EXAMPLE + " (lowercase)"),
    (f"<tool_call >{CALL}</tool_call>", 'found "<tool_call >"; ' + EXAMPLE + " (no spaces"),
    (f"< tool_call>\n{CALL}\n</tool_call>", "(no spaces inside the tag)"),
    (f"<tool-call>{CALL}</tool-call>", "(the tag is tool_call, not tool-call)"),
    (f"<toolcall>{CALL}</toolcall>", "(the tag is tool_call, not toolcall)"),
    (f"<tool_calls>{CALL}</tool_calls>", "(the tag is tool_call, not tool_calls)"),
    (f"<function_call>{CALL}</function_call>", "(the tag is tool_call, not function_call)"),
    (f"<tool_call{CALL}</tool_call>", 'found "<tool_call"; ' + EXAMPLE + ' (end the tag with ">")'),
    (f"<tool_call/>{CALL}", "(not self-closing)"),
    (f"<tool_call>{CALL}</TOOL_CALL>", 'found "</TOOL_CALL>"; ' + EXAMPLE + " (lowercase)"),
    ("I will use the calculator. <tool_ca", 'found "<tool_ca" cut off at the end'),
    ("<tool", 'found "<tool" cut off at the end'),
    ("<tool_call\n", 'found "<tool_call" cut off at the end'),
    (f"<tool_call>{CALL}</tool_ca", 'found "</tool_ca" cut off at the end'),
    (f"<tool_call>{CALL}", "unclosed <tool_call> (no </tool_call> after it); " + EXAMPLE),
    (f"<tool_call>\n```json\n{CALL}\n```\n</tool_call>", "a ``` code fence inside <tool_call>"),
    (CALL, "found a tool call as bare JSON with no tags; " + EXAMPLE),
    (f"Sure, I'll call it: {CALL}", "found a tool call as bare JSON with no tags"),
    (f"```json\n{CALL}\n```", "found a tool call in a ``` code fence; " + EXAMPLE),
    (f"```\n{CALL}\n```", "found a tool call in a ``` code fence"),
    (
        '{"name": "calculate", "parameters": {"expression": "1 + 2"}}',
        "bare JSON with no tags; " + EXAMPLE + ' (the key is "arguments", not "parameters")',
    ),
    (
        '{"type": "function", "function": {"name": "calculate", "arguments": "{}"}}',
        '(the object itself, not wrapped in "function")',
    ),
]
ORDINARY_ANSWERS = [
    "42",
    "-3.5",
    "The answer is 7.",
    "Ana has 7 pens now.",
    "I would make a tool call here, but it is simple: 3 + 4 = 7.",
    "No tool_call is needed; the result of the tool call above was 12, so the answer is 12.",
    "You could use tool-call syntax or a toolcall, or a TOOL_CALL, but the answer is 5.",
    "Wrap a call in a `<tool_call>` tag and close it with `</tool_call>`. Answer: 9",
    "3 < 4 and 5 > 2, so the answer is 2 <= x.",
    "if a < b and tool > c: return a",
    "<toolbox> is not a tag we use; x <tool> y; answer 1",
    "a <t",
    "<tool_response>\n7\n</tool_response>",
    '{"answer": 42}',
    '{"name": "Bob", "age": 3}',
    '{"name": "Alice Smith", "arguments": ["she was late", "it rained"]}',
    '```python\ndef call(name, args):\n    return {"name": name, "arguments": args}\n```',
    '```python\nCALL = {"name": "calculate", "arguments": {"expression": "1"}}\n```',
    "```\nfor i in range(3):\n    print(i)\n```",
    "Use the function call f(x) = x + 1; f(2) = 3.",
]


@pytest.mark.parametrize(("turn", "says"), NEAR_MISSES)
def test_near_misses_become_one_error_call_with_a_specific_message(turn, says):
    parsed = parse_turn(turn)
    assert len(parsed.errors) == 1, parsed.errors
    assert parsed.errors[0].startswith("malformed tool call: ") and says in parsed.errors[0]
    assert EXAMPLE in parsed.errors[0]  # says how to write it
    (call,) = parsed.message["tool_calls"]
    assert call["function"]["name"] == ""  # never run, whatever the JSON inside says
    raw = call["function"]["arguments"]
    assert isinstance(raw, str) and (raw in turn or raw == "{}")  # what the model wrote, kept
    env = CalculatorEnv()
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(parsed.message)
    assert not (terminated or truncated)  # not graded as a final answer: the episode goes on
    assert info["tool_errors"] == 1 and obs[0]["content"].startswith("Error: malformed tool call")
    assert says in obs[0]["content"] and EXAMPLE in obs[0]["content"]  # the model reads why


@pytest.mark.parametrize("turn", ORDINARY_ANSWERS)
def test_ordinary_answers_stay_final_answers(turn):
    parsed = parse_turn(turn)
    assert parsed.errors == [] and "tool_calls" not in parsed.message
    assert parsed.message["content"] == turn.strip()
    env = CalculatorEnv()
    env.reset(seed=0)
    assert env.step(parsed.message)[2]  # graded: the episode ends


def test_near_misses_and_calls_keep_their_order():
    good = '<tool_call>{"name": "calculate", "arguments": {"expression": "2"}}</tool_call>'
    parsed = parse_turn(f"a <TOOL_CALL>{CALL}</TOOL_CALL> b {good} c <tool-call>{CALL}")
    assert [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["", "calculate", ""]
    assert len(parsed.errors) == 2 and parsed.message["content"] == "a  b  c"


def test_a_json_string_argument_may_mention_a_near_miss_tag():
    body = '{"name": "calculate", "arguments": {"expression": "</TOOL_CALL>"}}'
    parsed = parse_turn(f"<tool_call>{body}</tool_call>")
    assert parsed.errors == []
    assert parsed.message["tool_calls"][0]["function"]["arguments"] == {
        "expression": "</TOOL_CALL>"
    }


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="<{"), max_size=300))
def test_text_without_tags_or_json_is_a_final_answer(text):
    for candidate in (text, f"the tool call gave {text}", f"tool_call: {text}"):
        parsed = parse_turn(candidate)
        assert parsed.errors == [] and "tool_calls" not in parsed.message


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
