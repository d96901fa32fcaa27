"""An OpenAI-compatible chat endpoint whose replies come from the env's caller (the policy).

`Endpoint` serves `POST <base>/chat/completions` (non-streaming, with tools) and
`GET <base>/models` on 127.0.0.1 at a free port, stdlib only. It answers nothing itself: each
request becomes a `Request` in `inbox`, and the thread that owns the endpoint (a
`HarnessEnv` episode, envs/harness.py) answers it with `Request.reply` (an assistant message)
or `Request.fail`. The base URL carries a per-episode token (`open(token)`); a request under
an older token (a harness of an earlier episode still running) is refused with 409, so a
stale agent can never write into the current episode.

With `prefix_token=False` there is no token: `POST /v1/chat/completions` and `GET /v1/models`
are served at `url` (`http://HOST:PORT/v1`) for any caller, on the `host` and `port` given
(`agentrl serve`, rl/run/serve_model.py). A request's sampling settings (`temperature`,
`top_p`, `max_tokens`, ...) are kept, unchecked, in `Request.options` for its owner to honour.

    endpoint = Endpoint()
    base_url = endpoint.open("ep-1")           # http://127.0.0.1:PORT/ep-1/v1
    request = endpoint.inbox.get(timeout=60)   # what an `openai` client sent there
    request.reply({"role": "assistant", "content": "4"})
    endpoint.close()
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from envs.types import Message

MAX_BODY = 64 * 2**20
"""Largest request body accepted (bytes)."""
OPTION_KEYS = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed")
"""The request body's sampling settings kept in `Request.options` (when not null)."""


@dataclass(slots=True)
class Request:
    """One chat request waiting for its answer."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    model: str
    token: str = ""
    """The episode token of the URL it came in under."""
    options: dict[str, Any] = field(default_factory=dict)
    """The body's OPTION_KEYS as sent (not checked here)."""
    _done: threading.Event = field(default_factory=threading.Event)
    _answer: tuple[int, dict[str, Any]] | None = None

    def reply(
        self,
        message: Message,
        *,
        usage: dict[str, int] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        """Answer with an assistant message (its tool calls in our format, see envs/types.py);
        returns the `chat.completion` sent (its tool calls carry the ids the agent will cite).
        `usage` and `finish_reason` as in `completion`."""
        body = completion(message, self.model, usage=usage, finish_reason=finish_reason)
        self._finish(200, body)
        return body

    def repeat(self, body: dict[str, Any]) -> None:
        """Answer with a `chat.completion` sent before (to the request this one repeats: the same
        tool call ids)."""
        self._finish(200, body)

    def fail(self, status: int, text: str) -> None:
        self._finish(status, {"error": {"message": text, "type": "agentrl_error"}})

    def _finish(self, status: int, body: dict[str, Any]) -> None:
        if not self._done.is_set():
            self._answer = (status, body)
            self._done.set()

    @property
    def answered(self) -> bool:
        """Answered already (a reply, a failure or, past its wait, a 504): nothing to sample."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None) -> tuple[int, dict[str, Any]]:
        """The answer, or 504 after `timeout_s`; the request then counts as answered, so a
        server still holding it skips it instead of sampling for a client that has gone."""
        if not self._done.wait(timeout_s):
            self.fail(504, "no reply from the policy in time")
        assert self._answer is not None
        return self._answer


def completion(
    message: Message,
    model: str,
    *,
    usage: dict[str, int] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """An OpenAI `chat.completion` object for our assistant message; `usage` holds
    prompt_tokens and completion_tokens (zeros when None); `finish_reason` defaults to
    "tool_calls" for a message with tool calls, else "stop"."""
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:12]}",
            "type": "function",
            "function": {
                "name": c["function"]["name"],
                "arguments": _arguments_text(c["function"].get("arguments", {})),
            },
        }
        for c in message.get("tool_calls") or []
    ]
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if calls:
        out["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": out,
                "finish_reason": finish_reason or ("tool_calls" if calls else "stop"),
                "logprobs": None,
            }
        ],
        "usage": _usage(usage or {}),
    }


def _usage(counts: dict[str, int]) -> dict[str, int]:
    prompt, done = counts.get("prompt_tokens", 0), counts.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


class Endpoint:
    """The HTTP server of one env instance; see the module docstring."""

    def __init__(
        self,
        *,
        model: str = "agentrl",
        reply_timeout_s: float | None = 600.0,
        host: str = "127.0.0.1",
        port: int = 0,
        prefix_token: bool = True,
    ):
        """Listen on `host`:`port` (0: a free port; OSError when it cannot bind); with
        `prefix_token` routes live under a token (`open`), without it under `/v1` directly."""
        self.model, self.reply_timeout_s = model, reply_timeout_s
        self.host, self.prefix_token = host, prefix_token
        self.inbox: queue.Queue[Request] = queue.Queue()
        self._token: str | None = None
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="agentrl-endpoint", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The base URL without a token (what a `prefix_token=False` endpoint serves)."""
        return f"http://{self.host}:{self.port}/v1"

    def open(self, token: str) -> str:
        """Accept requests under `token` only (earlier tokens get 409); returns the base URL."""
        self._token = token
        return f"http://{self.host}:{self.port}/{token}/v1"

    def accepts(self, token: str) -> bool:
        return not self.prefix_token or (bool(token) and token == self._token)

    def close(self) -> None:
        self._token = None
        self._server.shutdown()
        self._server.server_close()


def _handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._send(*answer_get(endpoint, self.path))

        def do_POST(self) -> None:
            said = self.headers.get("Content-Length") or "0"
            length = _byte_count(said)
            if length < 0:  # unreadable: never read to the end of a kept-alive connection
                self.close_connection = True
                self._send(400, _problem(f"Content-Length must be a byte count, got {said!r}"))
                return
            if length > MAX_BODY:
                self.close_connection = True
                self._send(413, _problem(f"request body of {length} bytes exceeds {MAX_BODY}"))
                return
            raw = self.rfile.read(length)
            try:
                answer = answer_post(endpoint, self.path, raw)
            except Exception as exc:  # a bug of ours: the client gets an answer, not a hang-up
                answer = 500, _problem(f"internal error: {type(exc).__name__}: {exc}")
            try:
                self._send(*answer)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (its own
                self.close_connection = True  # timeout; it may send the request again)

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _byte_count(said: str) -> int:
    """A Content-Length value as an int; -1 when it is not a plain decimal count."""
    text = said.strip()
    if not (text.isascii() and text.isdecimal()) or len(text) > 18:
        return -1
    return int(text)


def answer_get(endpoint: Endpoint, url: str) -> tuple[int, dict[str, Any]]:
    token, path = _split(url, endpoint.prefix_token)
    if path == "/v1/models" and endpoint.accepts(token):
        model = {"id": endpoint.model, "object": "model", "created": 0, "owned_by": "agentrl"}
        return 200, {"object": "list", "data": [model]}
    return 404, _problem(f"no route {url}")


def answer_post(endpoint: Endpoint, url: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    """Queue a chat request for the episode's owner and wait for its answer."""
    token, path = _split(url, endpoint.prefix_token)
    if path != "/v1/chat/completions":
        return 404, _problem(f"no route {url}")
    if not endpoint.accepts(token):
        return 409, _problem("this episode is over")
    try:
        request = parse_request(_json_object(raw), endpoint.model)
    except ValueError as exc:
        return 400, _problem(str(exc))
    request.token = token
    endpoint.inbox.put(request)
    return request.wait(endpoint.reply_timeout_s)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def _problem(text: str) -> dict[str, Any]:
    return {"error": {"message": text, "type": "invalid_request_error"}}


def _split(path: str, prefix_token: bool = True) -> tuple[str, str]:
    """'/<token>/v1/chat/completions?x' -> ('<token>', '/v1/chat/completions');
    without `prefix_token`, '/v1/chat/completions?x' -> ('', '/v1/chat/completions')."""
    path = path.split("?", 1)[0]
    if not prefix_token:
        return "", "/" + path.lstrip("/")
    token, _, rest = path.lstrip("/").partition("/")
    return token, "/" + rest


def parse_request(body: dict[str, Any], model: str) -> Request:
    """Check what we support and return the request; ValueError says what is not."""
    if body.get("stream"):
        raise ValueError("stream=true is not supported; call with stream=false")
    if body.get("n", 1) != 1:
        raise ValueError("n must be 1: agentrl samples one completion per request")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    tools = _list(body.get("tools") or [], "tools")
    return Request(
        messages=[normal_message(m) for m in messages],
        tools=[_tool_schema(t) for t in tools],
        model=str(body.get("model") or model),
        options={k: body[k] for k in OPTION_KEYS if body.get(k) is not None},
    )


def normal_message(message: Any) -> dict[str, Any]:
    """An OpenAI message in our shape: content as text, tool calls' arguments kept as text."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"each message needs a role: got {str(message)[:80]}")
    out: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [_tool_call(c) for c in _list(calls, "a message's tool_calls")]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _tool_call(call: Any) -> dict[str, Any]:
    """A sent tool call in our shape; ValueError when it is not {"function": {"name": ...}}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name", ""), str):
        shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}'
        raise ValueError(f"each tool call must be {shape}: got {str(call)[:120]}")
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments", "{}")},
    }


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise ValueError(f"message content must be text or a list of parts, got {type(content)}")


def _tool_schema(tool: Any) -> dict[str, Any]:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        shape = '{"type": "function", "function": {"name": ..., "parameters": ...}}'
        raise ValueError(f"each tool must be {shape}: got {str(tool)[:120]}")
    parameters = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {
            "name": fn["name"],
            "description": fn.get("description") or "",
            "parameters": parameters,
        },
    }
