"""Parse a model's turn (Hermes / ChatML layout) into an assistant message. Never raises.

    some text<tool_call>
    {"name": "calculate", "arguments": {"expression": "2 + 2"}}
    </tool_call>

A block that cannot be parsed still becomes a tool call (with an empty name, or its raw argument
text), so the env answers it with an error observation and the episode continues.

So does a near miss, which would otherwise end the episode as a final answer: a tag in the
wrong case, with spaces, `-`, no separator or a missing `>` (`<TOOL_CALL>`, `<tool_call >`,
`<tool-call>`, `<toolcall>`, `<tool_calls>`, `<function_call>`), an opening tag cut off at the
end of the turn (`<tool_ca`), a `</tool_call>` with no opening tag, an opening tag never
closed, and, when the turn has no tag at all, a JSON object shaped like a call (an identifier
`"name"` and an `"arguments"` / `"parameters"` object or string, or an OpenAI-style
`{"function": {...}}`) written bare or in a ``` / ```json fence. Each is one call with an empty
name (so the env answers it with an error, never runs it) and its raw text as arguments, and
one entry in `errors` saying what was wrong and how to write it. Words in prose ("a tool
call"), tags quoted in `backticks` and JSON in a ```python fence stay content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from envs.types import Message, ToolCall, tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
EXAMPLE = 'write <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]{1,128})"')
# a tag-like near miss of <tool_call> or </tool_call> (the exact tags match it too); without a
# ">" only when a JSON object or the end of the turn follows; or an opening tag cut off at the end
_TAG = re.compile(
    r"<\s*(?:(/)\s*)?(?:(?:tool|function)[\s_-]*calls?(?![\w-])\s*(?:/\s*)?(?:>|(?=\{|\Z))"
    r"|tool(?:[\s_-]*c(?:a(?:l)?)?)?\s*\Z)",
    re.IGNORECASE,
)
_CALL_OPENER = re.compile(r'\{\s*"(?:name|function|type)"\s*:')
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_CALL_FENCES = {"", "json", "json5", "jsonc", "tool", "tool_call", "tool_code", "function_call"}
_IDENTIFIER = re.compile(r"[A-Za-z_][\w.-]{0,63}")
_CALL_KEYS = {"name", "arguments", "parameters", "type", "id", "function"}
_MAX_JSON_PROBES = 16


@dataclass(slots=True)
class ParsedTurn:
    message: Message
    errors: list[str] = field(default_factory=list)


def parse_turn(text: str) -> ParsedTurn:
    """Split text into content and tool calls; malformed calls and near misses are kept (each as
    an error-bearing call) and reported in `errors`."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    content = _take_tags(text, calls, errors)
    if not calls:
        content = _take_bare_json(content, calls, errors)
    message: Message = {"role": "assistant", "content": content.strip()}
    if calls:
        message["tool_calls"] = calls
    return ParsedTurn(message, errors)


def _take_tags(text: str, calls: list[ToolCall], errors: list[str]) -> str:
    """Take every tag-delimited call, well-formed or near miss, in order; returns the rest."""
    kept: list[str] = []
    pos = 0
    while (tag := _next_tag(text, pos)) is not None:
        kept.append(text[pos : tag.start()])
        pos = _take_block(text, tag, pos, calls, errors)
    kept.append(text[pos:])
    return "".join(kept)


def _take_block(
    text: str, tag: re.Match, pos: int, calls: list[ToolCall], errors: list[str]
) -> int:
    """Take the call that `tag` opens (or, a closing tag with no opening one, ends: the text
    from `pos` is its body); returns where the text after it starts."""
    if tag.group(1):
        errors.append(
            f'malformed tool call: found "{_show(tag)}" without an opening {OPEN}; {EXAMPLE}'
        )
        calls.append(_near_miss(text[pos : tag.end()], errors[-1]))
        return tag.end()
    after = _next_tag(text, tag.end())
    close = after if after is not None and after.group(1) else None
    if tag.group(0) == OPEN:
        end = text.find(CLOSE, tag.end())
        body = text[tag.end() : end]
        if end >= 0 and (close is None or close.start() >= end or _is_json(body)):
            _take_call(body, calls, errors)  # well-formed tags (the body may still be broken)
            return end + len(CLOSE)
    if tag.group(0) != OPEN:
        errors.append(_bad_tag_error(tag))
    elif close is not None:
        errors.append(_bad_tag_error(close))
    else:
        errors.append(f"malformed tool call: unclosed {OPEN} (no {CLOSE} after it); {EXAMPLE}")
    stop = close.end() if close else after.start() if after else len(text)
    calls.append(_near_miss(text[tag.start() : stop], errors[-1]))
    return stop


def _next_tag(text: str, pos: int) -> re.Match | None:
    """The next tag from `pos`, skipping tags quoted in backticks (prose about the tag)."""
    while (tag := _TAG.search(text, pos)) is not None:
        quoted = text[tag.start() - 1 : tag.start()] == "`" == text[tag.end() : tag.end() + 1]
        if not quoted:
            return tag
        pos = tag.end()
    return None


def _bad_tag_error(tag: re.Match) -> str:
    raw = tag.group(0)
    if not raw.rstrip().endswith(">") and not tag.string[tag.end() :].strip():
        return f'malformed tool call: found "{_show(tag)}" cut off at the end; {EXAMPLE}'
    return f'malformed tool call: found "{_show(tag)}"; {EXAMPLE} ({_tag_hint(raw)})'


def _tag_hint(raw: str) -> str:
    hints = []
    if raw != raw.lower():
        hints.append("lowercase")
    if any(ch.isspace() for ch in raw.strip()):
        hints.append("no spaces inside the tag")
    word = re.sub(r"[</>]", "", raw).strip().lower()
    if word != "tool_call":
        hints.append(f"the tag is tool_call, not {word}")
    if not raw.rstrip().endswith(">"):
        hints.append('end the tag with ">"')
    elif raw.rstrip()[:-1].rstrip().endswith("/"):
        hints.append("not self-closing")
    return ", ".join(hints)


def _show(tag: re.Match) -> str:
    return tag.group(0).strip()[:40]


def _is_json(body: str) -> bool:
    try:
        json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def _take_bare_json(text: str, calls: list[ToolCall], errors: list[str]) -> str:
    """In a turn with no tags: take each JSON object shaped like a tool call (bare, or in a ```
    or ```json fence; never in a ```python one) as a near miss; returns the rest."""
    fences = [(m.start(), m.end(), m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    spans: list[tuple[int, int]] = []
    decoder = json.JSONDecoder()
    for probe, opener in enumerate(_CALL_OPENER.finditer(text)):
        start = opener.start()
        if probe >= _MAX_JSON_PROBES:
            break
        if spans and start < spans[-1][1]:
            continue
        fence = next((f for f in fences if f[0] < start < f[1]), None)
        if fence is not None and fence[2] not in _CALL_FENCES:
            continue
        try:
            data, end = decoder.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):
            continue
        hint = _call_hint(data)
        if hint is None:
            continue
        where = "in a ``` code fence" if fence else "as bare JSON with no tags"
        errors.append(f"malformed tool call: found a tool call {where}; {EXAMPLE}{hint}")
        calls.append(_near_miss(text[start:end], errors[-1]))
        whole = fence is not None and fence[3].strip() == text[start:end]
        spans.append((fence[0], fence[1]) if whole else (start, end))
    for start, end in reversed(spans):
        text = text[:start] + text[end:]
    return text


def _call_hint(data: object) -> str | None:
    """None unless `data` is clearly a tool call; else what to fix besides the tags."""
    if not isinstance(data, dict) or not set(data) <= _CALL_KEYS:
        return None
    function = data.get("function")
    if isinstance(function, dict) and _named(function) and "arguments" in function:
        return ' (the object itself, not wrapped in "function")'
    if not _named(data):
        return None
    if isinstance(data.get("arguments"), dict | str):
        return ""
    if isinstance(data.get("parameters"), dict | str):
        return ' (the key is "arguments", not "parameters")'
    return None


def _named(data: dict) -> bool:
    name = data.get("name")
    return isinstance(name, str) and _IDENTIFIER.fullmatch(name) is not None


def _take_call(body: str, calls: list[ToolCall], errors: list[str]) -> str:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        if body.strip().startswith("```"):
            errors.append(f"malformed tool call: a ``` code fence inside {OPEN}; {EXAMPLE}")
            calls.append(_near_miss(body, errors[-1]))
            return ""
        errors.append("tool call is not valid JSON")
        calls.append(_malformed(body))
        return ""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        errors.append('tool call needs a string "name"')
        calls.append(_malformed(body))
        return ""
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict | str):
        errors.append("tool call arguments must be an object")
        arguments = json.dumps(arguments)
    calls.append(tool_call(data["name"], arguments))
    return ""


def _malformed(body: str) -> ToolCall:
    """Keep what can be recovered: the name if visible, the raw text as arguments."""
    match = _NAME.search(body)
    raw = body.strip()[:2000]
    return tool_call(match.group(1) if match else "", raw or "{}")


def _near_miss(raw: str, error: str) -> ToolCall:
    """A call the env must refuse (no name) that keeps what the model wrote, for the logs, and
    says what was wrong (`error`: the env's observation for it, envs/tools.py Toolbox.call)."""
    call = tool_call("", raw.strip()[:2000] or "{}")
    call["error"] = error
    return call
