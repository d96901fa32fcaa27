"""The graders of a task file (envs/graders.py): exact, numeric, "module:function", and an LLM
judge asked over HTTP (a tiny OpenAI-compatible server written here with the stdlib)."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from envs.graders import JudgeError, last_number, make_grader
from envs.types import Outcome

ROW = {"prompt": "What is 6 x 7?", "answer": 42}


# --- exact ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "reference", "success"),
    [
        ("Paris", "Paris", True),
        ("  paris. ", "Paris", True),
        ("New   York\n", "new york", True),
        ("PARIS", ["Lyon", "paris"], True),
        ("Paris, France", "Paris", False),
        ("42", 42, True),
        ("", "Paris", False),
    ],
)
def test_exact_normalises_both_sides(given, reference, success):
    outcome = make_grader("exact")(given, {"prompt": "?", "answer": reference})
    assert outcome.success is success
    assert outcome.details == {"expected": reference, "given": given}


# --- numeric ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("The answer is 42.", 42.0),
        ("-5 degrees", -5.0),
        ("It is −7", -7.0),
        ("5-3 gives 2", 2.0),
        ("from 5-3", 3.0),  # a minus after a digit is an operator, not a sign
        ("x = -3.5", -3.5),
        ("1,234 apples", 1234.0),
        ("$1,000,000.50", 1000000.5),
        ("3/4.", 0.75),
        ("-1/2", -0.5),
        ("1/0, so 7", 7.0),
        ("1.5e3", 1500.0),
        (".5", 0.5),
        ("1,2,3", 3.0),
        ("no number here", None),
    ],
)
def test_last_number(text, value):
    assert last_number(text) == value


@pytest.mark.parametrize(
    ("given", "reference", "success"),
    [
        ("So 6 x 7 = 42", 42, True),
        ("42.0000001", 42, True),  # within rel 1e-6
        ("42.001", 42, False),
        ("0.75", "3/4", True),
        ("3/4", 0.75, True),
        ("1,234", "1234", True),
        ("0.0000000001", 0, True),  # within abs 1e-9
        ("0.001", 0, False),
        ("about 41 or 43", [43, 44], True),
        ("I don't know", 42, False),
    ],
)
def test_numeric_compares_the_last_number(given, reference, success):
    outcome = make_grader("numeric")(given, {"prompt": "?", "answer": reference})
    assert outcome.success is success
    assert outcome.details["expected"] == reference


def test_numeric_refuses_a_reference_without_a_number():
    grader = make_grader("numeric")
    with pytest.raises(ValueError, match=r"'many' .* is not a number; env.grader numeric"):
        grader.check_rows(({"prompt": "?", "answer": "many"},), "tasks.jsonl")


def test_exact_reads_an_integer_valued_float_reference_as_the_integer():
    """pandas stores an int column with a missing value as floats: 42 became 42.0, and "42"
    never matched."""
    grader = make_grader("exact")
    assert grader("42", {"prompt": "q", "answer": 42.0}).success
    assert not grader("42", {"prompt": "q", "answer": 42.5}).success


def test_custom_answer_key():
    grader = make_grader("numeric", answer_key="solution")
    assert grader("42", {"q": "?", "solution": "42"}).success


# --- module:function ----------------------------------------------------------------------------
def by_bool(answer: str, row: dict) -> bool:
    return answer.strip() == str(row["answer"])


def by_score(answer: str, row: dict) -> float:
    return len(set(answer) & set(str(row["answer"]))) / len(set(str(row["answer"])))


def by_outcome(answer: str, row: dict) -> Outcome:
    return Outcome(success=True, details={"mine": answer})


def by_numpy(answer: str, row: dict):
    return np.bool_(answer == "42")


def wrong_type(answer: str, row: dict):
    return "yes"


def out_of_range(answer: str, row: dict) -> float:
    return 2.0


def raises(answer: str, row: dict) -> bool:
    raise RuntimeError("grader bug")


def mutates(answer: str, row: dict) -> bool:
    row["answer"] = "changed"
    return True


HERE = __name__


def test_function_grader_return_values():
    assert make_grader(f"{HERE}:by_bool")("42", ROW).success
    assert not make_grader(f"{HERE}:by_bool")("41", ROW).success
    half = make_grader(f"{HERE}:by_score")("4", ROW)
    assert half.success and half.details == {"expected": 42, "given": "4", "score": 0.5}
    assert not make_grader(f"{HERE}:by_score")("x", ROW).success
    assert make_grader(f"{HERE}:by_outcome")("a", ROW).details == {"mine": "a"}
    assert make_grader(f"{HERE}:by_numpy")("42", ROW).details["score"] == 1.0


def test_function_grader_errors_name_the_function():
    with pytest.raises(TypeError, match=rf"grader {HERE}:wrong_type returned str 'yes'"):
        make_grader(f"{HERE}:wrong_type")("42", ROW)
    with pytest.raises(ValueError, match=r"out_of_range returned 2.0; a score must be in \[0, 1\]"):
        make_grader(f"{HERE}:out_of_range")("42", ROW)
    with pytest.raises(RuntimeError, match="grader bug"):  # propagates: an env error
        make_grader(f"{HERE}:raises")("42", ROW)


def test_function_grader_gets_a_copy_of_the_row():
    row = dict(ROW)
    make_grader(f"{HERE}:mutates")("42", row)
    assert row == ROW


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fuzzy", 'env.grader must be exact, numeric, judge or "package.module:function"'),
        (3, "env.grader must be"),
        ("nowhere_at_all:fn", "env.grader 'nowhere_at_all:fn': cannot import 'nowhere_at_all'"),
        (f"{HERE}:missing", "has no attribute 'missing'"),
        (f"{HERE}:HERE", "is str, not a function"),
        ("judge", "env.grader judge needs env.kwargs.judge"),
    ],
)
def test_bad_specs_name_env_grader(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_grader(spec)


def test_judge_settings_without_the_judge_grader_are_refused():
    with pytest.raises(ValueError, match=r"env.kwargs.judge is set but env.grader is 'exact'"):
        make_grader("exact", judge={"url": "http://x/v1", "model": "m"})


# --- judge --------------------------------------------------------------------------------------
class JudgeHandler(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint: YES when the answer equals the reference it finds in
    the prompt. Model "broken" answers HTTP 500, model "slow" takes 60 s, model "odd" answers
    something that is not a chat completion."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(
            {"path": self.path, "body": body, "headers": dict(self.headers)}
        )
        model = body["model"]
        if model == "broken":
            return self._send(500, {"error": {"message": "out of memory"}})
        if model == "cut-1" and len(self.server.requests) == 1:  # the reply cut off midway
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"choices": ')
            self.close_connection = True
            return None
        if model == "cut-1":
            model = "m"
        busy = model.startswith("busy-")  # busy-N: HTTP 429 (Retry-After: 0.2) to its first N asks
        if busy and len(self.server.requests) <= int(model.split("-")[1]):
            return self._send(429, {"error": {"message": "rate limited"}}, retry_after="0.2")
        if model == "unauthorised":
            return self._send(401, {"error": {"message": "bad key"}})
        if model == "slow":
            time.sleep(60.0)  # on a daemon thread (daemon_threads): nothing waits for it
        if model == "odd":
            return self._send(200, {"result": "YES"})
        text = body["messages"][-1]["content"]
        reference = re.search(r"Reference answer:\n(.*?)\n\n", text, re.S)[1]
        answer = re.search(r"Answer to grade:\n(.*?)\n\n", text, re.S)[1]
        verdict = "**Yes.** They agree." if answer.strip() == reference else "NO"
        return self._send(
            200, {"choices": [{"message": {"role": "assistant", "content": verdict}}]}
        )

    def _send(self, code, payload, retry_after=None):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        if retry_after is not None:
            self.send_header("Retry-After", retry_after)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), JudgeHandler)
    server.daemon_threads = True
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1", server.requests
    server.shutdown()
    server.server_close()


def test_judge_asks_over_http(judge_url, monkeypatch):
    url, requests = judge_url
    monkeypatch.setenv("JUDGE_KEY", "sekrit")
    grader = make_grader("judge", judge={"url": url, "model": "m", "api_key_env": "JUDGE_KEY"})
    yes = grader("42", ROW)
    assert yes.success and yes.details["verdict"].startswith("**Yes.**")
    assert not grader("41", ROW).success
    sent = requests[0]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["temperature"] == 0 and sent["body"]["model"] == "m"
    assert "What is 6 x 7?" in sent["body"]["messages"][0]["content"]
    assert sent["headers"]["Authorization"] == "Bearer sekrit"


def test_judge_prompt_template_and_list_references(judge_url):
    url, requests = judge_url
    template = "Q: {question}\nReference answer:\n{reference}\n\nAnswer to grade:\n{answer}\n\n"
    grader = make_grader("judge", judge={"url": url + "/", "model": "m", "prompt": template})
    row = {"prompt": "Capital?", "answer": ["Paris", "paris"]}
    assert not grader("Paris", row).success  # the reference it sees is "any of: Paris; paris"
    assert requests[0]["body"]["messages"][0]["content"].startswith("Q: Capital?\n")
    assert "any of: Paris; paris" in requests[0]["body"]["messages"][0]["content"]


def test_judge_failures_raise_naming_the_url(judge_url):
    url, _ = judge_url
    broken = make_grader("judge", judge={"url": url, "model": "broken"})
    with pytest.raises(JudgeError, match=rf"judge {url}/chat/completions answered HTTP 500"):
        broken("42", ROW)
    slow = make_grader("judge", judge={"url": url, "model": "slow", "timeout_s": 0.3})
    start = time.perf_counter()
    with pytest.raises(JudgeError, match=r"did not answer within 0.3 s"):
        slow("42", ROW)
    # nominal 0.3 s (timeout_s); far under the 60 s the judge takes when nothing cuts it
    assert time.perf_counter() - start < 10
    odd = make_grader("judge", judge={"url": url, "model": "odd"})
    with pytest.raises(JudgeError, match="not a chat completion"):
        odd("42", ROW)


def test_a_busy_judge_is_asked_again_after_its_retry_after(judge_url):
    url, requests = judge_url
    grader = make_grader("judge", judge={"url": url, "model": "busy-2"})
    start = time.perf_counter()
    assert grader("42", ROW).success  # 429, 429, then the answer: the default 2 retries
    assert len(requests) == 3 and time.perf_counter() - start >= 0.4  # waited 0.2 s twice
    requests.clear()
    once = make_grader("judge", judge={"url": url, "model": "busy-5", "retries": 1})
    with pytest.raises(JudgeError, match=r"answered HTTP 429: .*rate limited.* \(2 tries\)"):
        once("42", ROW)
    assert len(requests) == 2
    requests.clear()
    never = make_grader("judge", judge={"url": url, "model": "busy-5", "retries": 0})
    with pytest.raises(JudgeError, match=r"answered HTTP 429"):
        never("42", ROW)
    assert len(requests) == 1


def test_a_reply_cut_off_midway_is_asked_again(judge_url):
    """http.client's IncompleteRead is no OSError: before, it escaped unnamed and unretried."""
    url, requests = judge_url
    assert make_grader("judge", judge={"url": url, "model": "cut-1"})("42", ROW).success
    assert len(requests) == 2


def test_judge_errors_that_would_fail_again_are_not_retried(judge_url):
    url, requests = judge_url
    for model, message in (("unauthorised", "answered HTTP 401"), ("odd", "not a chat")):
        requests.clear()
        with pytest.raises(JudgeError, match=message):
            make_grader("judge", judge={"url": url, "model": model})("42", ROW)
        assert len(requests) == 1, model


def test_judge_unreachable_raises_naming_the_url():
    with ThreadingHTTPServer(("127.0.0.1", 0), JudgeHandler) as server:
        port = server.server_port  # closed again: nothing listens there
    grader = make_grader("judge", judge={"url": f"http://127.0.0.1:{port}/v1", "model": "m"})
    start = time.perf_counter()
    with pytest.raises(
        JudgeError, match=rf"cannot reach judge http://127.0.0.1:{port}/v1.*3 tries"
    ):
        grader("42", ROW)
    assert time.perf_counter() - start >= 1.5  # asked again after 0.5 s, then after 1 s


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"url": "ftp://x", "model": "m"}, "env.kwargs.judge.url must be an http(s):// base URL"),
        ({"url": "http://x/v1"}, "env.kwargs.judge.model must name"),
        ({"url": "http://x/v1", "model": "m", "timeout_s": 0}, "timeout_s must be a number > 0"),
        ({"url": "http://x/v1", "model": "m", "prompt": "no slot"}, "{answer} placeholder"),
        ({"url": "http://x/v1", "model": "m", "temp": 1}, "env.kwargs.judge.temp: unknown key"),
        ({"url": "http://x/v1", "model": "m", "retries": -1}, "retries must be an integer >= 0"),
        (
            {"url": "http://x/v1", "model": "m", "api_key_env": "AGENTRL_NO_SUCH_VAR"},
            "the environment variable AGENTRL_NO_SUCH_VAR is not set",
        ),
    ],
)
def test_judge_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_grader("judge", judge=settings)
