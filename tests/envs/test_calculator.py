from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.calculator import CalculatorEnv, CalculatorExpert, evaluate_expression
from envs.tools import ToolError
from envs.types import assistant, tool_call


@pytest.mark.parametrize("difficulty", [1, 2, 3, 4])
def test_check_env_passes(difficulty):
    env = gymnasium.make("agentrl/Calculator-v0", difficulty=difficulty)
    check_env(env.unwrapped)


def test_reset_is_deterministic_under_a_seed():
    env = CalculatorEnv(difficulty=3)
    first, _ = env.reset(seed=11)
    second, _ = env.reset(seed=11)
    assert first == second
    assert env.reset(seed=12)[0] != first


def test_expert_solves_every_task_when_perfect():
    env = gymnasium.make("agentrl/Calculator-v0", difficulty=4)
    expert = CalculatorExpert(error_rate=0.0, seed=0)
    results = [envs.demonstrate(env, expert, seed=s).outcome["success"] for s in range(200)]
    assert all(results)


def test_imperfect_expert_fails_at_about_its_error_rate():
    env = gymnasium.make("agentrl/Calculator-v0")
    expert = CalculatorExpert(error_rate=0.3, seed=1)
    failures = sum(
        not envs.demonstrate(env, expert, seed=s).outcome["success"] for s in range(1000)
    )
    assert 240 <= failures <= 360


def test_tool_call_then_answer_succeeds_and_terminates():
    env = CalculatorEnv()
    env.reset(seed=3)
    expr = env.problem.expression
    obs, reward, terminated, truncated, info = env.step(
        assistant("", [tool_call("calculate", {"expression": expr})])
    )
    assert obs == [{"role": "tool", "name": "calculate", "content": str(env.problem.answer)}]
    assert (reward, terminated, truncated, info["tool_calls"], info["tool_errors"]) == (
        0.0,
        False,
        False,
        1,
        0,
    )
    obs, reward, terminated, truncated, info = env.step(assistant(f"It is {env.problem.answer}."))
    assert terminated and not truncated and reward == 1.0
    assert info["outcome"]["success"] is True


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (tool_call("calc", {"expression": "1+1"}), "unknown tool 'calc'"),
        (tool_call("calculate", '{"expression": '), "not valid JSON"),
        (tool_call("calculate", {}), "missing required argument 'expression'"),
        (tool_call("calculate", {"expression": 5}), "must be string"),
        (tool_call("calculate", {"expression": "1+1", "x": 1}), "no argument 'x'"),
        (tool_call("calculate", {"expression": "__import__('os')"}), "only numbers"),
        (tool_call("", "garbage"), "malformed tool call"),
    ],
)
def test_bad_tool_calls_become_error_observations(call, fragment):
    env = CalculatorEnv()
    env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(assistant("", [call]))
    assert not terminated and not truncated
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("Error: ")
    assert fragment in obs[0]["content"]
    assert info["tool_errors"] == 1


def test_running_out_of_turns_truncates_without_terminating():
    env = CalculatorEnv(max_turns=2)
    env.reset(seed=0)
    call = assistant("", [tool_call("calculate", {"expression": "1"})])
    assert env.step(call)[2:4] == (False, False)
    _, _, terminated, truncated, info = env.step(call)
    assert truncated and not terminated
    assert info["outcome"]["success"] is False


def test_expression_evaluator_is_safe():
    assert evaluate_expression("(12 + 7) * 3") == 57
    assert evaluate_expression("-4 / 2") == -2
    for bad in ["2 ** 10", "x + 1", "().__class__", "1/0", "9" * 300]:
        with pytest.raises(ToolError):
            evaluate_expression(bad)


def test_tool_schema_comes_from_the_docstring():
    schema = CalculatorEnv().tools[0]["function"]
    assert schema["name"] == "calculate"
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
