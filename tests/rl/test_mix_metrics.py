"""Per-env metrics of a mixture of envs (agentrl/Mix-v0): task ids name the env each seed draws
(sync worker and async serving on a real redis-server), the counters split per env with their
reward, and the split shows in the console line, TensorBoard and `agentrl monitor`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gymnasium
import pytest
from rich.console import Console

import envs  # noqa: F401  (registers agentrl/Mix-v0)
from envs.types import HELDOUT_SEEDS
from policy.sampling import SamplingParams
from reward import build_reward
from rl.config.runfile import load_config
from rl.observe.evaluate import EvalResult, eval_result, mixture_envs
from rl.observe.metrics import MetricsLogger, console_line, eval_record, rollout_metrics
from rl.observe.monitor_state import MonitorState
from rl.observe.monitor_view import envs_tools
from rl.run.offline_eval import EvalModel, EvalReport, _run_mode
from rollout.agent import AgentLoop
from rollout.episode import EpisodeLimits, task_id
from rollout.keys import RunKeys
from rollout.render import ChatRenderer
from rollout.serve import AsyncRollouts, ServeOptions
from rollout.tasks import TaskQueue
from rollout.worker import RolloutWorker, Task
from tests.fakes import ScriptedPolicy, ScriptedSession
from tests.rollout.test_render_and_episode import expert_script

ROOT = Path(__file__).resolve().parents[2]
MIX, CALC, RETR = "agentrl/Mix-v0", "agentrl/Calculator-v0", "agentrl/Retrieval-v0"
ENTRIES = [{"id": CALC, "weight": 1}, {"id": RETR, "weight": 1}]


def make_mix():
    return gymnasium.make(MIX, envs=ENTRIES)


def calculator_only(tokenizer):
    """Solves every Calculator task (the expert's script), answers every Retrieval one wrongly."""
    calc = expert_script(tokenizer)

    def script(prompt_ids):
        question = tokenizer.decode(prompt_ids).rsplit("<|im_start|>user\n", 1)[1]
        return "nobody<|im_end|>" if "documents" in question else calc(prompt_ids)

    return script


def worker(tokenizer, policy=None) -> RolloutWorker:
    return RolloutWorker(
        env_factory=make_mix,
        env_id=MIX,
        policy=policy or ScriptedPolicy(tokenizer, calculator_only(tokenizer)),
        renderer=ChatRenderer(tokenizer),
        scorer=build_reward({"task_completion": 1.0}),
        sink=None,
        limits=EpisodeLimits(max_turns=4, max_seq_len=1024),
    )


@pytest.fixture(scope="module")
def stats(tokenizer) -> dict:
    params = SamplingParams(max_new_tokens=64, stop_token_ids=(tokenizer.eos_token_id,))
    return worker(tokenizer).collect([Task(seed=s, group_id=str(s)) for s in range(8)], 2, params)


def test_task_ids_name_the_env_the_seed_draws():
    mix, alone = make_mix(), gymnasium.make(CALC)
    drawn = {task_id(mix, MIX, s) for s in range(8)}
    assert drawn == {f"{mix.unwrapped.env_id_for(s)}#{s}" for s in range(8)}
    assert {t.split("#")[0] for t in drawn} == {CALC, RETR}  # never the mixture's own id
    assert task_id(alone, CALC, 5) == f"{CALC}#5"


def test_the_worker_splits_the_counters_and_rewards_per_env(stats):
    seeds = [s for s in range(8) for _ in range(2)]
    drawn = [make_mix().unwrapped.env_id_for(s) for s in seeds]
    calc, retr = drawn.count(CALC), drawn.count(RETR)
    assert stats[f"env/{CALC}/episodes"] == calc and stats[f"env/{RETR}/episodes"] == retr
    assert f"env/{MIX}/episodes" not in stats
    m = rollout_metrics([stats])
    assert m[f"env/{CALC}/success_rate"] == 1.0 and m[f"env/{RETR}/success_rate"] == 0.0
    assert m[f"env/{CALC}/reward_mean"] == 1.0 and m[f"env/{RETR}/reward_mean"] == 0.0
    assert m[f"env/{CALC}/episodes"] == calc
    assert m["rollout/success_rate"] == calc / (calc + retr)


def test_async_serving_names_the_env_of_each_group(tokenizer, redis_server):
    client, keys = redis_server.client(), RunKeys("mix")
    renderer = ChatRenderer(tokenizer)
    session = ScriptedSession(tokenizer, calculator_only(tokenizer))
    loop = AgentLoop(session, renderer, EpisodeLimits(), tool_timeout_s=60, deterministic=False)
    queue = TaskQueue(client, keys)
    opts = ServeOptions(consumer="w0", group_size=2, max_episodes=8)
    serve = AsyncRollouts(worker(tokenizer, policy=None), queue, loop, opts)
    queue.issue([(f"g{s}", s) for s in range(6)])
    params = SamplingParams(max_new_tokens=64, stop_token_ids=(renderer.eos_token_id,))
    serve.run(
        params,
        should_stop=lambda: client.xlen(keys.trajectories) >= 6,
        install=lambda: None,
        may_generate=lambda: True,
    )
    finished, _ = serve.drain()
    mix = make_mix().unwrapped
    expected = sorted(f"{mix.env_id_for(s)}#{s}" for s in range(6) for _ in range(2))
    assert sorted(t.task_id for t in finished) == expected
    assert all(t.success == t.task_id.startswith(CALC) for t in finished)


def test_the_console_line_shows_each_env_only_for_a_mix(stats):
    m = rollout_metrics([stats])
    line = console_line(3, 40, m)
    assert "(Calculator 100% Retrieval 0%)" in line
    alone = {k: v for k, v in m.items() if not k.startswith(f"env/{RETR}/")}
    assert "Calculator 100%" not in console_line(3, 40, alone)


def test_tensorboard_has_each_envs_curves(tmp_path, stats):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, client=None, stream="", tensorboard=True)
    log.log(1, rollout_metrics([stats]))
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for env_id in (CALC, RETR):
        assert {f"env/{env_id}/{k}" for k in ("success_rate", "episodes", "reward_mean")} <= tags
    assert events.Scalars(f"env/{CALC}/reward_mean")[0].value == 1.0


def test_the_monitor_shows_a_row_per_env(stats):
    state = MonitorState()
    m = rollout_metrics([stats])
    state.add([{"step": s, "phase": "train", **m} for s in (1, 2)], now=0.0)
    console = Console(file=io.StringIO(), width=140, record=True, color_system=None)
    console.print(envs_tools(state))
    out = console.export_text()
    assert "episodes" in out and "reward" in out
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines()]
    rows = {row[0]: row[1:4] for row in cells if row and row[0].startswith("agentrl/")}
    calc = f"{m[f'env/{CALC}/episodes']:.0f}"
    assert rows[CALC] == ["100%", calc, "1.00"] and rows[RETR][0::2] == ["0%", "0.00"]


def test_held_out_evaluation_reports_each_env():
    cfg = load_config(ROOT / "configs/mix.yaml")
    env_of = mixture_envs(cfg)
    assert mixture_envs(load_config(ROOT / "configs/quickstart.yaml")) is None
    seeds = [HELDOUT_SEEDS + i for i in range(60)]
    chunks = [seeds[0::2], seeds[1::2]]  # as rl/run/evals.py splits them over two workers
    counts = dict.fromkeys(
        ("episodes", "tool_calls", "tool_errors", "parse_errors", "truncated"), 1
    )
    answers = [([[env_of(s) == CALC] for s in chunk], counts) for chunk in chunks]
    asked = [s for chunk in chunks for s in chunk]
    result = eval_result("greedy", 60, 1, answers, seeds=asked, env_of=env_of)
    calc = sum(env_of(s) == CALC for s in seeds)
    assert result.success == pytest.approx(calc / 60) and 25 < calc < 55  # weights 2:1
    assert result.per_env[CALC][0] == 1.0 and result.per_env[RETR][0] == 0.0
    record = eval_record("grpo", "greedy", *result.per_env[CALC], per_env=result.per_env)
    assert record[f"eval/grpo/greedy/env/{RETR}/success"] == 0.0
    assert f"eval/grpo/greedy/env/{CALC}/ci_low" in record
    saved = json.loads(json.dumps(result.to_dict()))  # as the run state keeps it
    assert EvalResult(**saved).per_env == result.per_env


def test_agentrl_eval_reports_each_env_like_the_run():
    cfg = load_config(ROOT / "configs/mix.yaml")
    env_of = mixture_envs(cfg)
    counts = dict.fromkeys(
        ("episodes", "tool_calls", "tool_errors", "parse_errors", "truncated"), 1
    )

    class Worker:  # RolloutWorker.evaluate's answer: (per-task successes, counters)
        def evaluate(self, seeds, samples, params):
            return [[env_of(s) == CALC] * samples for s in seeds], counts

    progress: list[str] = []
    result = _run_mode(Worker(), cfg, "greedy", 40, 2, None, progress.append)
    assert progress[-1].startswith("eval greedy: 80/80 episodes")
    assert result.tasks == 40 and result.per_env[CALC][0] == 1.0 and result.per_env[RETR][0] == 0.0
    model = EvalModel(Path("runs/mix/final-model"), "GRPO", "the run's final-model/")
    report = EvalReport("runs/mix", model, 40, {"greedy": result}, {"greedy": 3.0})
    line = report.lines()[1]
    assert line.startswith("eval after GRPO, greedy: ")
    assert "on 40 held-out tasks (3 s); per env: " in line
    assert f"{CALC} 100.0% [" in line and f"{RETR} 0.0% [" in line
    assert report.to_json()["results"]["greedy"]["per_env"] == result.per_env
