"""`agentrl serve TARGET`: a frozen policy behind an OpenAI-compatible endpoint.

TARGET is a model directory or a run directory (the model `agentrl eval` would pick:
rl/run/offline_eval.py). The endpoint (envs/endpoint.py without an episode token) serves
`POST /v1/chat/completions` (non-streaming, n=1, with tools) and `GET /v1/models`; any
OpenAI-compatible client can call it, e.g. the LLM judge of a task file (`grader: judge`,
envs/graders.py).

One serving thread takes the requests waiting in the endpoint's inbox (up to `max_batch`),
renders each one's messages and tools with the model's chat template (rollout/render.py) and
samples the requests that share sampling settings in one `policy.generate` call. A request's
`temperature` (absent or 0: greedy), `top_p` and `max_completion_tokens` / `max_tokens`
(capped at the server's `max_tokens` and at what the model's context leaves) are honoured;
the reply is the parsed assistant turn (content and tool calls) with its token counts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from envs.endpoint import Endpoint, Request
from policy.sampling import Completion, SamplingParams
from rl.config.runfile import ConfigError, build_config, run_file_data
from rl.run.offline_eval import MODEL_FILES, TARGET_FIX, EvalModel, eval_model
from rollout.render import ChatRenderer

logger = logging.getLogger(__name__)
MAX_TOKENS = 1024
"""Default server limit on the tokens of one reply (`--max-tokens`)."""
STOP_WAIT_S = 10.0
"""On Ctrl-C, how long the batch being sampled may still finish (its replies are sent)."""
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Model config attributes that give its context length, in order of preference."""


class Policy(Protocol):
    """What the server samples with (policy/engines.py `rollout_policy`)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...


@dataclass(frozen=True, slots=True)
class Job:
    """One request, rendered and checked: its prompt tokens and its sampling settings."""

    request: Request
    prompt: list[int]
    params: SamplingParams


class ModelServer:
    """An endpoint and the thread that answers it with `policy`; `start()`, then `close()`."""

    def __init__(
        self,
        policy: Policy,
        renderer: ChatRenderer,
        *,
        name: str,
        context: int | None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch: int = 16,
        max_tokens: int = MAX_TOKENS,
        reply_timeout_s: float | None = 600.0,
    ):
        if max_batch < 1 or max_tokens < 1:
            raise ValueError(f"max_batch and max_tokens must be >= 1: {max_batch}, {max_tokens}")
        self.policy, self.renderer, self.context = policy, renderer, context
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.endpoint = Endpoint(
            model=name, reply_timeout_s=reply_timeout_s, host=host, port=port, prefix_token=False
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="agentrl-serve", daemon=True)

    @property
    def url(self) -> str:
        return self.endpoint.url

    def start(self) -> ModelServer:
        self._thread.start()
        return self

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the serving thread (waiting up to `timeout_s` for its current batch; None:
        until it ends), close the endpoint (no new connections), refuse what waits with 503."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.endpoint.close()
        while True:
            try:
                self.endpoint.inbox.get_nowait().fail(503, "the server is shutting down")
            except queue.Empty:
                break

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            batch = self._take()
            try:
                self.serve_batch(batch)
            except Exception as exc:  # a bug here must not leave later requests unanswered
                logger.exception("serving a batch failed")
                for request in batch:  # (those already answered keep their answer)
                    request.fail(500, f"the server failed: {type(exc).__name__}: {exc}")

    def _take(self) -> list[Request]:
        """The requests waiting now (at most max_batch); waits up to 0.1 s for the first."""
        try:
            batch = [self.endpoint.inbox.get(timeout=0.1)]
        except queue.Empty:
            return []
        while len(batch) < self.max_batch:
            try:
                batch.append(self.endpoint.inbox.get_nowait())
            except queue.Empty:
                break
        return [request for request in batch if not request.answered]  # 504s: client gone

    def serve_batch(self, requests: list[Request]) -> None:
        """Answer every request: one generate call per distinct set of sampling settings."""
        groups: dict[SamplingParams, list[Job]] = {}
        for request in requests:
            job = self._job(request)
            if job is not None:
                groups.setdefault(job.params, []).append(job)
        for params, jobs in groups.items():
            self._generate(params, jobs)

    def _job(self, request: Request) -> Job | None:
        """The request rendered and its settings checked; None once it was answered with 400."""
        try:
            messages = [_structured_arguments(m) for m in request.messages]
            prompt = self.renderer.prompt(messages, request.tools)
        except Exception as exc:  # the chat template refuses these messages
            request.fail(400, f"the model's chat template cannot render the messages: {exc}")
            return None
        try:
            params = request_params(
                request.options,
                len(prompt),
                context=self.context,
                max_tokens=self.max_tokens,
                stop_token_id=self.renderer.eos_token_id,
            )
        except ValueError as exc:
            request.fail(400, str(exc))
            return None
        return Job(request, prompt, params)

    def _generate(self, params: SamplingParams, jobs: list[Job]) -> None:
        try:
            completions = self.policy.generate([j.prompt for j in jobs], params)
        except Exception as exc:
            logger.exception("generation failed")
            for job in jobs:
                job.request.fail(500, f"generation failed: {type(exc).__name__}: {exc}")
            return
        for job, done in zip(jobs, completions, strict=True):
            self._reply(job, done)

    def _reply(self, job: Job, done: Completion) -> None:
        try:
            message = self.renderer.parse(done.token_ids).message
        except Exception as exc:
            job.request.fail(500, f"cannot decode the model's reply: {exc}")
            return
        usage = {"prompt_tokens": len(job.prompt), "completion_tokens": len(done.token_ids)}
        finish = "length" if done.finish_reason == "length" else None
        job.request.reply(message, usage=usage, finish_reason=finish)


def request_params(
    options: dict[str, Any],
    prompt_tokens: int,
    *,
    context: int | None,
    max_tokens: int,
    stop_token_id: int | None,
) -> SamplingParams:
    """A request's sampling settings (Request.options); ValueError naming the field at fault."""
    if options.get("stop"):
        raise ValueError("stop is not supported: the reply ends at the model's end-of-turn token")
    temperature = _number(options, "temperature", 0.0)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature:g}")
    top_p = _number(options, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p:g}")
    key = "max_completion_tokens" if "max_completion_tokens" in options else "max_tokens"
    wanted = options.get(key, max_tokens)
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise ValueError(f"{key} must be an integer >= 1, got {wanted!r}")
    limit = min(wanted, max_tokens)
    if context is not None:
        if prompt_tokens >= context:
            raise ValueError(
                f"the prompt is {prompt_tokens} tokens, but the model's context is {context} "
                "tokens, which leaves no room for a reply: shorten the messages"
            )
        limit = min(limit, context - prompt_tokens)
    stops = () if stop_token_id is None else (stop_token_id,)
    return SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=limit, stop_token_ids=stops
    )


def _number(options: dict[str, Any], key: str, default: float) -> float:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def _structured_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose tool calls' JSON-object argument texts are objects again (our format,
    envs/types.py), so a chat template that writes `arguments | tojson` does not quote them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        text = call["function"]["arguments"]
        try:
            value = json.loads(text) if isinstance(text, str) else text
        except ValueError:
            value = text
        arguments = value if isinstance(value, dict) else text
        out.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": out}


def model_context(model: Any) -> int | None:
    """The model's context length from its config (None when it names none)."""
    config = getattr(model, "config", None)
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@contextlib.contextmanager
def served_model(target: Path) -> Iterator[EvalModel]:
    """The model `agentrl eval` would pick for TARGET (a run's checkpoint is exported to a
    temporary directory, removed afterwards); a ConfigError for a TARGET that has none."""
    if not target.is_dir():
        why = "does not exist" if not target.exists() else "is a file"
        raise ConfigError("TARGET", f"{target} {why}; {TARGET_FIX}")
    is_model = all((target / name).is_file() for name in MODEL_FILES)
    if is_model or not (target / "config.yaml").is_file():
        if not is_model:
            raise ConfigError(
                "TARGET", f"{target} has neither config.yaml nor config.json; {TARGET_FIX}"
            )
        yield EvalModel(target, target.name, "a model directory")
        return
    cfg = build_config(run_file_data(target / "config.yaml"))
    with eval_model(target, cfg) as model:
        yield model


def _check_port(host: str, port: int) -> None:
    """A ConfigError now when `host`:`port` cannot be listened on (in use, not this machine's)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server does
            probe.bind((host, port))
    except (OSError, OverflowError) as exc:
        raise _port_error(host, port, exc) from None


def _port_error(host: str, port: int, exc: Exception) -> ConfigError:
    why = getattr(exc, "strerror", None) or str(exc)
    return ConfigError(
        "--port", f"cannot listen on {host}:{port}: {why}; pick another --port (0: any free one)"
    )


def wait_for_ctrl_c(poll_s: float = 1.0) -> None:
    """Block until KeyboardInterrupt. Timed waits: an untimed one in the main thread never wakes
    for a SIGINT the kernel handed to another thread (the HTTP server's, torch's), so the
    Python handler would not run until something else woke it."""
    never = threading.Event()
    while not never.wait(poll_s):
        pass


def serve(
    target: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 16,
    max_tokens: int = MAX_TOKENS,
    device: str = "auto",
    seed: int = 0,
) -> None:
    """`agentrl serve`: load TARGET's model, print where it is served, answer until Ctrl-C."""
    from policy.engines import rollout_policy
    from policy.hf import load_model, load_tokenizer
    from rl.run.devices import torch_device
    from rl.run.export import quiet_transformers

    if max_batch < 1:
        raise ConfigError("--max-batch", f"must be at least 1, got {max_batch}")
    if max_tokens < 1:
        raise ConfigError("--max-tokens", f"must be at least 1, got {max_tokens}")
    try:
        on = torch_device(device)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError("--device", f"{exc}; pass --device cpu, cuda or auto") from None
    _check_port(host, port)  # before the model loads (seconds to minutes)
    quiet_transformers()
    with served_model(target) as chosen:
        logger.debug("loading %s (%s) on %s", chosen.name, chosen.source, on)
        renderer = ChatRenderer(load_tokenizer(chosen.path))
        model = load_model(chosen.path).to(on)
        pad = renderer.pad_token_id
        pad = pad if pad is not None else (renderer.eos_token_id or 0)
        policy = rollout_policy(model, pad_token_id=pad, seed=seed, max_batch=max_batch)
        try:  # (the port may have been taken while the model loaded)
            server = ModelServer(
                policy,
                renderer,
                name=target.resolve().name,
                context=model_context(model),
                host=host,
                port=port,
                max_batch=max_batch,
                max_tokens=max_tokens,
            )
        except OSError as exc:
            raise _port_error(host, port, exc) from None
        server.start()
        print(
            f"serving {chosen.name} at {server.url} (OpenAI-compatible: POST /v1/chat/completions)",
            flush=True,
        )
        try:
            wait_for_ctrl_c()
        except KeyboardInterrupt:
            logger.info("stopping: the batch being sampled gets up to %g s", STOP_WAIT_S)
        finally:
            server.close(STOP_WAIT_S)
