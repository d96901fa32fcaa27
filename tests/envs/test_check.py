"""`check_env` and `agentrl envs check` over every registered env, and what a failure looks like."""

from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs import Outcome, ToolEnv, tool
from envs.check import check_tool_env
from envs.types import user
from rl.cli import main

ALL = [e for e in envs.env_ids() if e != "agentrl/Harness-v0"]
"""Every env that works with no kwargs. agentrl/Harness-v0 needs the user's agent (its tools
and its expert come from there): tests/envs/test_harness.py checks it, check_env included."""


def test_every_builtin_env_is_registered():
    assert {id for id, _, _ in envs.BUILTIN} <= set(envs.env_ids())


@pytest.mark.parametrize("env_id", ALL)
def test_gymnasium_check_env(env_id):
    check_env(gymnasium.make(env_id).unwrapped)


@pytest.mark.parametrize("env_id", ALL)
def test_agentrl_envs_check(env_id):
    report = check_tool_env(env_id, episodes=2, long_steps=12)
    assert report.passed, report.format()
    assert [r.name for r in report.results][-1] == "save and continue"


def test_the_cli_prints_pass_fail_and_sets_the_exit_code(capsys):
    assert main(["envs", "check", "agentrl/Calculator-v0", "difficulty=2", "--episodes=2"]) == 0
    out = capsys.readouterr().out
    assert "PASS  gymnasium check_env" in out and "PASSED: 8/8" in out
    assert main(["envs", "check", "nobody/Nothing-v0"]) == 2  # a usage error: one line
    assert "envs check: no environment 'nobody/Nothing-v0' is registered" in capsys.readouterr().err
    report = check_tool_env("agentrl/Calculater-v0")  # the library call: a failed make
    assert not report.passed and "did you mean 'agentrl/Calculator-v0'?" in report.format()
    assert main(["envs", "list"]) == 0
    listing = capsys.readouterr().out
    assert all(env_id in listing for env_id in ALL) and "expert" in listing


class FlakyEnv(ToolEnv):
    """Passes gymnasium's one-step checker, breaks on the third step."""

    @tool
    def poke(self) -> str:
        """Poke the env."""
        if self._turn >= 3:
            raise RuntimeError("boom")
        return "ok"

    def _new_task(self, options):
        return [user("poke me")]

    def _grade(self, answer):
        return Outcome(success=False)

    def step(self, action):
        if self._turn >= 2:
            raise RuntimeError("step 3 always fails")
        return super().step(action)


def test_a_broken_env_fails_with_reasons(monkeypatch):
    gymnasium.register(id="test/Flaky-v0", entry_point=FlakyEnv)
    try:
        check_env(gymnasium.make("test/Flaky-v0").unwrapped)  # gymnasium's checker passes it
        report = check_tool_env("test/Flaky-v0", episodes=1, long_steps=8)
    finally:
        del gymnasium.registry["test/Flaky-v0"]
    failed = {r.name: r.detail for r in report.results if not r.passed}
    assert not report.passed and "FAILED" in report.format()
    assert "step 3 always fails" in failed["long episode"]
    assert "no scripted expert" in failed["expert episodes"]
