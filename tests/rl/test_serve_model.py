"""`agentrl serve`: a tiny model behind the OpenAI-compatible endpoint, called by the real
`openai` client and by the judge grader; requests batched; bad requests refused with 400."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from envs.graders import JudgeGrader
from envs.types import Outcome
from policy.engines import rollout_policy
from policy.hf import load_model, load_tokenizer
from policy.sampling import Completion, SamplingParams
from rl.cli import main
from rl.config.runfile import ConfigError
from rl.run.serve_model import ModelServer, model_context, request_params, served_model
from rollout.render import ChatRenderer

ROOT = Path(__file__).resolve().parents[2]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}


class Counting:
    """The real engine, recording how many prompts each generate call got."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.calls.append(len(prompts))
        return self.policy.generate(prompts, params)


class Scripted:
    """A policy of ours that writes `text` (then end-of-turn) for every prompt."""

    def __init__(self, renderer: ChatRenderer, text: str):
        self.ids = [*renderer.encode(text), renderer.eos_token_id]
        self.prompts: list[list[int]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.prompts += prompts
        return [Completion(token_ids=list(self.ids), finish_reason="stop") for _ in prompts]


@pytest.fixture(scope="module")
def loaded(model_dir):
    renderer = ChatRenderer(load_tokenizer(model_dir))
    model = load_model(model_dir)
    policy = rollout_policy(model, pad_token_id=renderer.pad_token_id, seed=0)
    return Counting(policy), renderer, model_context(model)


def make_server(policy, renderer, context=1024, **kw) -> ModelServer:
    return ModelServer(policy, renderer, name="tiny", context=context, max_tokens=12, **kw)


@pytest.fixture(scope="module")
def served(loaded):
    policy, renderer, context = loaded
    with make_server(policy, renderer, context) as server:
        yield server


def client(server: ModelServer) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_openai_client_gets_greedy_replies_with_usage(served, loaded):
    assert loaded[2] == 1024  # the tiny model's max_position_embeddings
    openai = client(served)
    assert [m.id for m in openai.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    first, second = (
        openai.chat.completions.create(model="tiny", messages=messages, temperature=0, tools=[ADD])
        for _ in range(2)
    )
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].message.role == "assistant"
    usage = first.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    short = openai.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert short.usage.completion_tokens <= 3
    if short.usage.completion_tokens == 3:
        assert short.choices[0].finish_reason == "length"


def test_tool_calls_come_back_and_tools_reach_the_template(loaded):
    _, renderer, _ = loaded
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    policy = Scripted(renderer, "Let me add." + call)
    history = [
        {"role": "user", "content": "2 + 3 and 1 + 1?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    with make_server(policy, renderer) as server:
        reply = client(server).chat.completions.create(model="m", messages=history, tools=[ADD])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me add."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "add" and tool_call.id.startswith("call_")
    assert json.loads(tool_call.function.arguments) == {"a": 2, "b": 3}
    assert reply.usage.completion_tokens == len(policy.ids)
    prompt = renderer.decode(policy.prompts[0])
    assert "Add two integers." in prompt  # the tool's schema was rendered
    assert '"arguments": {}' in prompt  # the history's call, its arguments as an object


def test_judge_grader_through_the_served_model(served, loaded):
    row = {"prompt": "What is 2 + 2?", "answer": "4"}
    outcome = JudgeGrader(url=served.url, model="tiny", timeout_s=60)("4", row)
    assert isinstance(outcome, Outcome) and outcome.details["expected"] == "4"
    _, renderer, _ = loaded
    with make_server(Scripted(renderer, "YES, it agrees."), renderer) as server:
        verdict = JudgeGrader(url=server.url, model="judge", timeout_s=60)("4", row)
    assert verdict.success and verdict.details["verdict"] == "YES, it agrees."


def test_waiting_requests_are_sampled_together(loaded):
    policy, renderer, context = loaded
    server = make_server(policy, renderer, context, max_batch=8)
    url = server.url + "/chat/completions"
    bodies = [
        {"messages": [{"role": "user", "content": f"{i} + {i}?"}], "temperature": t}
        for i, t in enumerate([0, 0, 0, 0.7, 0.7])
    ]
    answers: list[tuple[int, dict] | None] = [None] * len(bodies)

    def ask(i: int) -> None:
        answers[i] = post(url, bodies[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while server.endpoint.inbox.qsize() < len(bodies) and time.monotonic() < deadline:
        time.sleep(0.01)
    before = len(policy.calls)
    with server:  # started once every request waits: one batch, one call per temperature
        for thread in threads:
            thread.join(60)
    assert [a[0] for a in answers] == [200] * len(bodies), answers
    assert sorted(policy.calls[before:]) == [2, 3]


def test_bad_requests_get_400_with_the_reason(served):
    url = served.url + "/chat/completions"
    hello = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": hello, "stream": True}, "stream=true is not supported"),
        ({"messages": hello, "n": 2}, "n must be 1"),
        ({"messages": [{"role": "user", "content": "1 + 2 = 3. " * 600}]}, "model's context is"),
        ({"messages": hello, "temperature": -1}, "temperature must be >= 0"),
        ({"messages": hello, "top_p": 0}, "top_p must be in (0, 1]"),
        ({"messages": hello, "max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"messages": hello, "stop": ["\n"]}, "stop is not supported"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": hello, "tools": "search"}, "tools must be a list"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}, "each tool"),
        ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, "tool_calls must be a list"),
    ]
    for body, reason in cases:
        status, answer = post(url, body)
        assert status == 400 and reason in answer["error"]["message"], (body, answer)
    assert post(served.url + "/completions", {"prompt": "x"})[0] == 404


@pytest.mark.parametrize("length", ["abc", "-5", "\u00b2", "9" * 5000])
def test_an_unreadable_content_length_gets_400_not_a_hang_up(served, length):
    """Before, int("abc") raised in the handler (the connection dropped, no answer) and a
    negative length read to the end of a kept-alive connection (the client waited forever)."""
    host, port = served.url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", length)
    conn.endheaders(b'{"messages": []}')
    response = conn.getresponse()
    answer = json.loads(response.read())
    assert response.status == 400 and "Content-Length must be a byte count" in str(answer)
    conn.close()


def test_request_params_caps_the_reply():
    params = request_params({"max_tokens": 500}, 1000, context=1024, max_tokens=64, stop_token_id=7)
    assert params.max_new_tokens == 24 and params.greedy and params.stop_token_ids == (7,)
    params = request_params(
        {"max_completion_tokens": 5, "max_tokens": 50, "temperature": 0.5, "top_p": 0.9},
        10,
        context=None,
        max_tokens=64,
        stop_token_id=None,
    )
    assert (params.max_new_tokens, params.temperature, params.top_p) == (5, 0.5, 0.9)


def test_target_is_a_model_dir_or_a_run_dir(model_dir, tmp_path):
    with served_model(model_dir) as chosen:
        assert chosen.path == model_dir
    run = tmp_path / "run"
    shutil.copytree(model_dir, run / "final-model")
    (run / "config.yaml").write_text("seed: 3\n")
    with served_model(run) as chosen:
        assert chosen.path == run / "final-model"
    for where, reason in ((tmp_path / "missing", "does not exist"), (tmp_path, "neither")):
        with pytest.raises(ConfigError, match=reason), served_model(where):
            pass
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert main(["serve", str(model_dir), "--device", "tpu"]) == 2
    with socket.create_server(("127.0.0.1", 0)) as taken:  # refused before the model loads
        port = str(taken.getsockname()[1])
        assert main(["serve", str(model_dir), "--port", port, "--device", "cpu"]) == 2
    assert main(["serve", str(model_dir), "--port", "70000", "--device", "cpu"]) == 2


@pytest.mark.slow
def test_agentrl_serve_prints_its_url_and_stops_on_ctrl_c(model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl.cli", "serve", str(model_dir), "--port", "0", "--device", "cpu"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # the one line it prints, once it listens
        assert line.startswith(f"serving {model_dir} at http://127.0.0.1:"), line
        assert line.rstrip().endswith("(OpenAI-compatible: POST /v1/chat/completions)")
        url = line.split(" at ", 1)[1].split()[0]
        hello = {"messages": [{"role": "user", "content": "hi"}]}
        status, answer = post(url + "/chat/completions", hello)
        assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_ctrl_c_handed_to_another_thread_still_stops_serving():
    """The kernel may give a process's SIGINT to any thread that does not block it. Before, the
    main thread's untimed Event().wait() then never woke: `agentrl serve` ignored the Ctrl-C
    (seen once in a test run: no exit within 30 s)."""
    code = (
        "import signal, threading, time\n"
        "from rl.run.serve_model import wait_for_ctrl_c\n"
        "def other():\n"
        "    time.sleep(0.5)\n"
        "    signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
        "threading.Thread(target=other).start()\n"
        "try:\n"
        "    wait_for_ctrl_c(poll_s=0.2)\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout.strip() == "stopped", proc.stderr


def test_close_refuses_what_still_waits(loaded):
    _, renderer, _ = loaded
    server = make_server(Scripted(renderer, "never"), renderer)  # never started
    answers = []
    hello = {"messages": [{"role": "user", "content": "hi"}]}
    asker = threading.Thread(
        target=lambda: answers.append(post(server.url + "/chat/completions", hello))
    )
    asker.start()
    deadline = time.monotonic() + 30
    while server.endpoint.inbox.qsize() < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.close()
    asker.join(30)
    assert answers[0][0] == 503 and "shutting down" in answers[0][1]["error"]["message"]


def test_a_request_answered_504_is_not_sampled_later(loaded):
    """A request that waited past the server's reply timeout got its 504 (the client has gone
    on); when the server reaches it in its queue it skips it instead of sampling a reply that
    nobody reads ahead of the live requests."""
    policy, renderer, context = loaded
    server = make_server(policy, renderer, context, reply_timeout_s=0.3)  # not started yet
    hello = {"messages": [{"role": "user", "content": "hi"}]}
    status, body = post(server.url + "/chat/completions", hello)
    assert status == 504 and "no reply from the policy in time" in body["error"]["message"]
    assert server.endpoint.inbox.qsize() == 1  # still queued, answered
    before = len(policy.calls)
    with server:
        deadline = time.monotonic() + 10
        while server.endpoint.inbox.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
    assert server.endpoint.inbox.qsize() == 0 and policy.calls[before:] == []
