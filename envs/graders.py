"""Graders of a task file's answers (envs/dataset.py): `make_grader(spec)` -> `Grader`.

A grader takes the model's final answer text and the task's row and returns an `Outcome` whose
details hold at least `expected` and `given`:

- "exact": equal after normalising both sides (strip, collapse whitespace, casefold, drop a
  trailing period); the reference may be a list of acceptable answers.
- "numeric": the last number in the answer (-12, 3.5, 1,234, 3/4, 1e-3) equals the reference
  number within a relative 1e-6 (absolute 1e-9); a list of references accepts any of them.
- "package.module:function": `function(answer, row)` decides. It returns a bool (success), a
  number in [0, 1] (success when >= 0.5; the number is kept in `details["score"]`) or an
  `envs.Outcome` (used as is). An exception it raises propagates: the rollout counts the
  episode as an env error. Any other return value raises TypeError naming the function.
- "judge": an LLM behind an OpenAI-compatible endpoint reads the question, the reference and the
  answer; success when its reply's first word is YES or CORRECT (see `JudgeGrader`). A busy
  server (HTTP 429 or 5xx) or a refused or dropped connection is asked again (`retries`, default
  2, waiting 0.5 s, 1 s, ... or the server's Retry-After); a request that still fails, or times
  out, raises `JudgeError` naming the URL.
"""

from __future__ import annotations

import http.client
import json
import math
import numbers
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from envs.registry import load_object
from envs.taskset import TaskSet
from envs.types import Outcome

BUILTIN_GRADERS = ("exact", "numeric", "judge")
ALLOWED = 'exact, numeric, judge or "package.module:function"'
JUDGE_KEYS = ("url", "model", "api_key_env", "timeout_s", "retries", "prompt")
RETRIED_HTTP = (429, 500, 502, 503, 504)  # a busy or restarting server: worth asking again
MAX_RETRY_WAIT_S = 10.0  # the longest wait before a retry (a Retry-After is capped to it)
JUDGE_PROMPT = (
    "Grade an answer to a question against the reference answer.\n\n"
    "Question:\n{question}\n\nReference answer:\n{reference}\n\nAnswer to grade:\n{answer}\n\n"
    "Does the answer to grade agree with the reference answer? Reply with one word: YES or NO."
)
_NUMBER = re.compile(
    r"(?P<sign>(?:(?<![\w)\].])[-−])?)"
    r"(?:(?P<num>\d+)/(?P<den>\d+)(?!\d|[.,]\d|/)"
    r"|(?P<dec>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+))"
)
_WORD = re.compile(r"[A-Za-z]+")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


class Grader(Protocol):
    def __call__(self, answer: str, row: dict[str, Any]) -> Outcome: ...


class JudgeError(RuntimeError):
    """The judge could not be asked (HTTP error, timeout, a reply that is not a chat completion)."""


def make_grader(
    spec: str,
    *,
    judge: dict[str, Any] | None = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> Grader:
    """The grader `spec` names (see the module docstring); ValueError for a bad spec."""
    if not isinstance(spec, str) or not (spec in BUILTIN_GRADERS or ":" in spec):
        raise ValueError(f"env.grader must be {ALLOWED}; got {spec!r}")
    if judge is not None and spec != "judge":
        raise ValueError(f"env.kwargs.judge is set but env.grader is {spec!r}; use grader: judge")
    if spec == "exact":
        return ExactGrader(answer_key)
    if spec == "numeric":
        return NumericGrader(answer_key)
    if spec == "judge":
        return JudgeGrader.from_settings(judge, prompt_key=prompt_key, answer_key=answer_key)
    try:
        fn = load_object(spec)
    except ValueError as exc:  # RegistrationError: a malformed entry point, an import error
        raise ValueError(f"env.grader {spec!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"env.grader {spec!r} is {type(fn).__name__}, not a function")
    return FunctionGrader(fn, spec, answer_key)


def checked_grader(
    spec: str,
    taskset: TaskSet,
    *,
    judge: dict[str, Any] | None = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> Grader:
    """`make_grader`, then the grader's own check of every row of `taskset` (numeric: every
    reference must hold a number), so a bad file fails when the env is built (`agentrl
    check`), not in every episode. The one way envs/dataset.py and envs/harness.py get theirs."""
    grader = make_grader(spec, judge=judge, prompt_key=prompt_key, answer_key=answer_key)
    check_rows = getattr(grader, "check_rows", None)
    if check_rows is not None:
        check_rows(taskset.train + taskset.heldout, taskset.source)
    return grader


def references(row: dict[str, Any], answer_key: str) -> list[Any]:
    """The acceptable answers of a row (its answer, or each item of a list answer)."""
    value = row[answer_key]
    return list(value) if isinstance(value, list | tuple) else [value]


def normalise(text: Any) -> str:
    """strip, collapse whitespace, casefold, drop trailing periods: what "exact" compares. A
    float reference with an integer value reads as the integer (a Parquet or pandas column of
    ints with a missing value holds 42.0 for 42)."""
    if isinstance(text, float) and text.is_integer():
        text = int(text)
    return re.sub(r"\s+", " ", str(text)).strip().casefold().rstrip(".").rstrip()


@dataclass(frozen=True, slots=True)
class ExactGrader:
    answer_key: str = "answer"

    def __call__(self, answer: str, row: dict[str, Any]) -> Outcome:
        expected = row[self.answer_key]
        given = normalise(answer)
        success = any(given == normalise(ref) for ref in references(row, self.answer_key))
        return Outcome(success=success, details={"expected": expected, "given": answer})


def last_number(text: str) -> float | None:
    """The last number in `text` (ints, decimals, negatives, 1,234, a/b, 1e-3), or None."""
    found = None
    for match in _NUMBER.finditer(text):
        if match["den"] is not None:
            if int(match["den"]) == 0:
                continue
            value = int(match["num"]) / int(match["den"])
        else:
            value = float(match["dec"].replace(",", ""))
        found = -value if match["sign"] else value
    return found


def reference_number(value: Any) -> float | None:
    """A reference answer as a number: a JSON number, or the last number in a string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    return last_number(value) if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class NumericGrader:
    answer_key: str = "answer"

    def __call__(self, answer: str, row: dict[str, Any]) -> Outcome:
        given = last_number(answer)
        expected = [reference_number(ref) for ref in references(row, self.answer_key)]
        success = given is not None and any(
            ref is not None and math.isclose(given, ref, rel_tol=1e-6, abs_tol=1e-9)
            for ref in expected
        )
        return Outcome(success=success, details={"expected": row[self.answer_key], "given": given})

    def check_rows(self, rows: tuple[dict[str, Any], ...], source: str) -> None:
        """Raise ValueError for a row whose reference holds no number (at build, not mid-run)."""
        for row in rows:
            for ref in references(row, self.answer_key):
                if reference_number(ref) is None:
                    raise ValueError(
                        f"{source}: the answer {ref!r} (of a task whose {self.answer_key!r} is "
                        f"{row[self.answer_key]!r}) is not a number; env.grader numeric needs one "
                        "in every answer"
                    )


@dataclass(frozen=True, slots=True)
class FunctionGrader:
    fn: Any
    name: str
    answer_key: str = "answer"

    def __call__(self, answer: str, row: dict[str, Any]) -> Outcome:
        value = self.fn(answer, dict(row))  # raising propagates: the rollout counts it
        if isinstance(value, Outcome):
            return value
        details = {"expected": row[self.answer_key], "given": answer}
        if isinstance(value, bool | np.bool_):
            return Outcome(success=bool(value), details={**details, "score": float(value)})
        if isinstance(value, numbers.Real):
            score = float(value)
            if not 0.0 <= score <= 1.0:  # NaN fails this too
                raise ValueError(
                    f"grader {self.name} returned {score!r}; a score must be in [0, 1]"
                )
            return Outcome(success=score >= 0.5, details={**details, "score": score})
        shown = repr(value)[:80]
        raise TypeError(
            f"grader {self.name} returned {type(value).__name__} {shown}; it must return a bool, "
            "a number in [0, 1] or an envs.Outcome"
        )


@dataclass(frozen=True, slots=True)
class JudgeGrader:
    """Asks an LLM behind an OpenAI-compatible URL whether the answer agrees with the reference.

    One POST to `{url}/chat/completions` per answer (temperature 0, a single user message built
    from `prompt`); success when the reply's first word, case and punctuation aside and after any
    `<think>...</think>` block, is YES or CORRECT.
    """

    url: str
    model: str
    prompt: str = JUDGE_PROMPT
    timeout_s: float = 60.0
    api_key: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    retries: int = 2
    """Further tries after a retryable failure (HTTP 429/5xx, a refused or dropped connection)."""
    backoff_s: float = 0.5
    """The wait before the first retry, doubled for each next (unless the server says when)."""

    @staticmethod
    def from_settings(settings: dict[str, Any] | None, **keys: str) -> JudgeGrader:
        """From env.kwargs.judge: {url, model, api_key_env?, timeout_s?, retries?, prompt?}."""
        where = "env.kwargs.judge"
        if not isinstance(settings, dict):
            raise ValueError(f"env.grader judge needs {where}: {{url: ..., model: ...}}")
        unknown = sorted(set(settings) - set(JUDGE_KEYS))
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key; valid: {', '.join(JUDGE_KEYS)}")
        url, model = settings.get("url"), settings.get("model")
        if not isinstance(url, str) or not re.match(r"https?://", url):
            raise ValueError(
                f"{where}.url must be an http(s):// base URL, e.g. http://host:8000/v1"
            )
        if not isinstance(model, str) or not model:
            raise ValueError(f"{where}.model must name the judge's model")
        timeout = settings.get("timeout_s", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"{where}.timeout_s must be a number > 0, got {timeout!r}")
        retries = settings.get("retries", 2)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"{where}.retries must be an integer >= 0, got {retries!r}")
        prompt = settings.get("prompt", JUDGE_PROMPT)
        if not isinstance(prompt, str) or "{answer}" not in prompt:
            raise ValueError(f"{where}.prompt must be a string with an {{answer}} placeholder")
        return JudgeGrader(
            url=url.rstrip("/").removesuffix("/chat/completions"),
            model=model,
            prompt=prompt,
            timeout_s=float(timeout),
            retries=retries,
            api_key=_api_key(settings.get("api_key_env"), where),
            **keys,
        )

    @property
    def endpoint(self) -> str:
        return f"{self.url}/chat/completions"

    def __call__(self, answer: str, row: dict[str, Any]) -> Outcome:
        refs = references(row, self.answer_key)
        reference = str(refs[0]) if len(refs) == 1 else "any of: " + "; ".join(map(str, refs))
        text = (
            self.prompt.replace("{question}", str(row.get(self.prompt_key, "")))
            .replace("{reference}", reference)
            .replace("{answer}", answer)
        )
        reply = self.ask(text)
        words = _WORD.findall(_THINK.sub("", reply))
        success = bool(words) and words[0].upper() in ("YES", "CORRECT")
        details = {"expected": row[self.answer_key], "given": answer, "verdict": reply[:200]}
        return Outcome(success=success, details=details)

    def ask(self, text: str) -> str:
        """The judge's reply to one user message; JudgeError naming the URL when it fails (after
        `retries` more tries when the failure is a busy server or a lost connection)."""
        body = {"model": self.model, "messages": [{"role": "user", "content": text}]}
        body["temperature"] = 0
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.endpoint, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        for attempt in range(self.retries + 1):
            try:
                return self._reply(self._post(request))
            except _Retryable as exc:
                if attempt == self.retries:
                    tries = f" ({attempt + 1} tries)" if attempt else ""
                    raise JudgeError(f"{exc}{tries}") from None
                backoff = min(self.backoff_s * 2**attempt, MAX_RETRY_WAIT_S)
                time.sleep(exc.wait if exc.wait is not None else backoff)
        raise AssertionError("unreachable")

    def _post(self, request: urllib.request.Request) -> Any:
        """One POST's JSON reply; `_Retryable` for a busy server or a lost connection."""
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            said = exc.read(300).decode("utf-8", "replace")
            message = f"judge {self.endpoint} answered HTTP {exc.code}: {said}"
            if exc.code in RETRIED_HTTP:
                raise _Retryable(message, _retry_after(exc.headers.get("Retry-After"))) from None
            raise JudgeError(message) from None
        except (TimeoutError, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):  # already waited timeout_s: not asked again
                why = f"did not answer within {self.timeout_s:g} s"
                raise JudgeError(f"judge {self.endpoint} {why}") from None
            raise _Retryable(f"cannot reach judge {self.endpoint}: {reason}") from None
        except ValueError as exc:  # a reply that is not JSON
            raise JudgeError(f"judge {self.endpoint}: bad reply ({exc})") from None
        except (OSError, http.client.HTTPException) as exc:  # a connection dropped mid-reply
            raise _Retryable(f"judge {self.endpoint}: bad reply ({exc!r})") from None

    def _reply(self, payload: Any) -> str:
        try:
            content = payload["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise JudgeError(
                f"judge {self.endpoint}: not a chat completion: {json.dumps(payload)[:200]}"
            ) from None
        return content if isinstance(content, str) else ""


class _Retryable(Exception):
    """A failure worth asking again; `wait`: the server's Retry-After in seconds, if any."""

    def __init__(self, message: str, wait: float | None = None):
        super().__init__(message)
        self.wait = wait


def _retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (capped at MAX_RETRY_WAIT_S); None when absent or a date."""
    try:
        seconds = float(value) if value else math.nan
    except ValueError:
        seconds = math.nan
    return min(max(seconds, 0.0), MAX_RETRY_WAIT_S) if math.isfinite(seconds) else None


def _api_key(name: Any, where: str) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.api_key_env must name an environment variable")
    key = os.environ.get(name)
    if not key:
        raise ValueError(f"{where}.api_key_env: the environment variable {name} is not set")
    return key
