"""Registration three ways (gymnasium id, package entry point, run-file entry point) and the
scripted-expert lookup that works for all of them."""

from __future__ import annotations

import sys
import textwrap

import gymnasium
import pytest

import envs
from envs.check import list_envs
from envs.registry import RegistrationError, ensure_registered, load_object, register_plugins

ENV_SOURCE = textwrap.dedent(
    '''
    from envs import Outcome, ToolEnv, tool
    from envs.types import assistant, tool_call, user


    class EchoEnv(ToolEnv):
        """Say the word back."""

        expert = "{module}:EchoExpert"

        @tool
        def echo(self, word: str) -> str:
            """Echo a word.

            Args:
                word: The word.
            """
            return word

        def _new_task(self, options):
            self.word = ["red", "green", "blue"][int(self.np_random.integers(3))]
            return [user(f"Echo {{self.word}}, then say it.")]

        def _grade(self, answer):
            return Outcome(success=answer["content"] == self.word)


    class EchoExpert:
        def __init__(self, *, error_rate=0.0, seed=0):
            self.error_rate = error_rate

        def begin(self):
            pass

        def act(self, env, history):
            if history[-1]["role"] == "tool":
                return assistant(history[-1]["content"])
            return assistant("", [tool_call("echo", {{"word": env.unwrapped.word}})])


    class NoExpertEnv(EchoEnv):
        expert = None
    '''
)


@pytest.fixture()
def clean(monkeypatch):
    """Undo what a test adds to sys.path, sys.modules and gymnasium's registry."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before_ids = set(gymnasium.registry)
    yield
    for name in [m for m in sys.modules if m.startswith(("echo_", "acme_envs"))]:
        del sys.modules[name]
    for env_id in set(gymnasium.registry) - before_ids:
        del gymnasium.registry[env_id]


def write_module(directory, name):
    (directory / f"{name}.py").write_text(ENV_SOURCE.format(module=name))


def test_a_gymnasium_id_with_its_expert(clean, tmp_path):
    write_module(tmp_path, "echo_gym")
    sys.path.insert(0, str(tmp_path))
    gymnasium.register(id="demo/EchoGym-v0", entry_point="echo_gym:EchoEnv")
    expert = envs.make_expert("demo/EchoGym-v0", error_rate=0.0, seed=0)
    demo = envs.demonstrate(gymnasium.make("demo/EchoGym-v0"), expert, seed=1)
    assert demo.outcome["success"] is True


def test_an_installed_package_entry_point(clean, tmp_path):
    package = tmp_path / "acme_envs"
    package.mkdir()
    write_module(package, "echo")
    (package / "__init__.py").write_text("")
    (package / "echo.py").write_text(ENV_SOURCE.format(module="acme_envs.echo"))
    info = tmp_path / "acme_envs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-envs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[agentrl.envs]\nacme/Echo-v0 = acme_envs.echo:EchoEnv\nacme/Bad-v0 = not an entry point\n"
    )
    sys.path.insert(0, str(tmp_path))
    with pytest.warns(UserWarning, match="acme/Bad-v0"):
        ids = register_plugins()  # a user's own plugins may be installed too
    assert "acme/Echo-v0" in ids and "acme/Bad-v0" not in ids
    assert "acme_envs.echo" not in sys.modules  # registered lazily
    assert "acme/Echo-v0" in envs.env_ids()
    assert "package acme-envs" in list_envs()
    env = gymnasium.make("acme/Echo-v0")
    expert = envs.make_expert("acme/Echo-v0", seed=0)
    assert envs.demonstrate(env, expert, seed=0).outcome["success"] is True


def test_a_run_file_entry_point_from_the_current_directory(clean, tmp_path, monkeypatch):
    write_module(tmp_path, "echo_local")
    monkeypatch.chdir(tmp_path)
    sys.path[:] = [p for p in sys.path if p not in ("", str(tmp_path))]
    ensure_registered("local/Echo-v0", "echo_local:EchoEnv")
    ensure_registered("local/Echo-v0", "echo_local:EchoEnv")  # idempotent
    env = gymnasium.make("local/Echo-v0")
    assert envs.demonstrate(env, envs.make_expert("local/Echo-v0"), seed=2).outcome["success"]


def test_registration_errors_say_what_is_wrong(clean, tmp_path):
    write_module(tmp_path, "echo_err")
    sys.path.insert(0, str(tmp_path))
    cases = [
        (("agentrl/Calculator-v0", "echo_err:EchoEnv"), "already registered"),
        (("x/Y-v0", "echo_err"), "must look like"),
        (("x/Y-v0", "no_such_module_zz:Env"), "cannot import"),
        (("x/Y-v0", "echo_err:Missing"), "has no attribute"),
        (("x/Y-v0", "echo_err:EchoExpert"), "not a gymnasium.Env"),
        (("x/Unknown-v0", None), "no environment"),
    ]
    for args, fragment in cases:
        with pytest.raises(RegistrationError, match=fragment):
            ensure_registered(*args)
    ensure_registered("x/NoExpert-v0", "echo_err:NoExpertEnv")
    with pytest.raises(KeyError, match="no scripted expert"):
        envs.make_expert("x/NoExpert-v0")


def test_load_object_refuses_garbage():
    for bad in ("", "a:b:c", "../x:y", "os:system; rm"):
        with pytest.raises(RegistrationError):
            load_object(bad)


def test_the_cli_validates_a_run_file_entry_point(clean, tmp_path, monkeypatch, capsys):
    from rl.cli import main

    write_module(tmp_path, "echo_cli")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run.yaml"
    run.write_text("env:\n  id: demo/EchoCli-v0\n  entry_point: echo_cli:EchoEnv\n")
    assert main(["check", str(run)]) == 0
    assert "config ok" in capsys.readouterr().out
    run.write_text("env:\n  entry_point: echo_cli:Missing\n")
    assert main(["check", str(run)]) == 2
    assert "env.entry_point" in capsys.readouterr().err
