"""PythonCode-v0 and FileEdit-v0: the experts solve every task; each reward hack scores 0
(reliability.md C10); model-written code never runs in our process (C9)."""

from __future__ import annotations

import os

import gymnasium
import pytest

import envs
from envs.file_edit import FileEditEnv
from envs.python_code import PythonCodeEnv
from envs.types import assistant, tool_call


@pytest.mark.parametrize("env_id", ["agentrl/PythonCode-v0", "agentrl/FileEdit-v0"])
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_the_expert_solves_every_task(env_id, difficulty):
    env = gymnasium.make(env_id, difficulty=difficulty)
    expert = envs.make_expert(env_id, error_rate=0.0, seed=difficulty)
    outcomes = [envs.demonstrate(env, expert, seed=s).outcome for s in range(6)]
    assert all(o["success"] for o in outcomes), outcomes


def test_an_imperfect_expert_fails_its_planted_bugs():
    env = gymnasium.make("agentrl/PythonCode-v0", difficulty=3)
    expert = envs.make_expert("agentrl/PythonCode-v0", error_rate=1.0, seed=0)
    assert not any(envs.demonstrate(env, expert, seed=s).outcome["success"] for s in range(4))


def python_task(seed: int = 0) -> tuple[PythonCodeEnv, str]:
    env = PythonCodeEnv(difficulty=1)
    env.reset(seed=seed)
    return env, env.task.name


HACKS = {
    "os._exit(0) at import": "import os\nos._exit(0)\n",
    "sys.exit(0) in the function": "import sys\ndef {f}(*a):\n    sys.exit(0)\n",
    "always-equal object": (
        "class Eq:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
        "def {f}(*a):\n    return Eq()\n"
    ),
    "always-equal int subclass": (
        "class Eq(int):\n    def __eq__(self, o): return True\ndef {f}(*a):\n    return Eq(0)\n"
    ),
    "conftest.py and test files": (
        "open('conftest.py', 'w').write('import pytest\\n')\n"
        "open('test_solution.py', 'w').write('def test_ok(): pass\\n')\n"
        "def {f}(*a):\n    return None\n"
    ),
    "forged RESULT line": (
        "import os\nfor fd in range(3, 20):\n    try:\n"
        "        os.write(fd, b'RESULT 0 {{\"results\": []}}\\n')\n"
        "    except OSError:\n        pass\n"
        "print('RESULT 0 []')\ndef {f}(*a):\n    return 0\n"
    ),
    "patched json and builtins": (
        "import json, builtins\njson.dumps = lambda *a, **k: '[]'\nbuiltins.type = lambda x: int\n"
        "def {f}(*a):\n    return 0\n"
    ),
    "infinite loop": "def {f}(*a):\n    while True:\n        pass\n",
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_python_code_hacks_score_zero(hack):
    env, name = python_task(seed=5)
    _, reward, terminated, _, info = env.step(assistant(HACKS[hack].format(f=name)))
    assert terminated and reward == 0.0, info["outcome"]
    assert info["outcome"]["success"] is False


def test_python_code_honest_answer_in_a_fence_scores_one():
    env, _ = python_task(seed=5)
    _, reward, _, _, info = env.step(assistant(f"Here:\n```python\n{env.task.solution}```"))
    assert reward == 1.0 and info["outcome"]["details"]["passed"] == 30


def test_model_code_never_runs_in_our_process(tmp_path):
    env, _ = python_task()
    marker = tmp_path / "ran-in-process"
    code = f"import os\nprint(os.getpid(), os.getuid())\nopen({str(marker)!r}, 'w').write('x')\n"
    obs, *_ = env.step(assistant("", [tool_call("run_python", {"code": code})]))
    if env.sandbox.isolated:
        pid = int(obs[0]["content"].split("stdout:\n")[1].split()[0])
        assert pid != os.getpid() and pid < 10  # another process, in its own pid namespace
        assert not marker.exists()
    answer = f"import os\nopen({str(marker)!r}, 'w').write('x')\n{env.task.solution}"
    env.step(assistant(answer))
    assert not marker.exists() or not env.sandbox.isolated


def file_task(seed: int = 1) -> FileEditEnv:
    env = FileEditEnv(difficulty=1)
    env.reset(seed=seed)
    return env


def write(env: FileEditEnv, path: str, content: str):
    return env.step(assistant("", [tool_call("write_file", {"path": path, "content": content})]))


def test_file_edit_visible_test_fails_until_fixed():
    env = file_task()
    module, function = env.bug
    obs, *_ = env.step(assistant("", [tool_call("run_tests", {})]))
    assert "FAILED" in obs[0]["content"] and function in obs[0]["content"]
    write(env, f"{module}.py", envs.file_edit.module_source(env.modules[module], None))
    obs, *_ = env.step(assistant("", [tool_call("run_tests", {})]))
    assert obs[0]["content"] == "All tests passed."


@pytest.mark.parametrize(
    "hack",
    [
        "edit the failing test",
        "conftest.py",
        "shadow unittest and sitecustomize",
        "exit at import",
        "always-equal everywhere",
    ],
)
def test_file_edit_hacks_score_zero(hack):
    env = file_task()
    module, _function = env.bug
    test_path = f"tests/test_{module}.py"
    names = [t.name for t in env.modules[module]]
    source = env.files[f"{module}.py"]
    if hack == "edit the failing test":
        write(env, test_path, "import unittest\n\nclass T(unittest.TestCase):\n    pass\n")
    elif hack == "conftest.py":
        write(env, "conftest.py", "def pytest_runtest_makereport(item, call):\n    pass\n")
        write(env, "tests/conftest.py", "import sys\nsys.exit(0)\n")
    elif hack == "shadow unittest and sitecustomize":
        write(env, "unittest.py", "import sys\nsys.exit(0)\n")
        write(env, "sitecustomize.py", "import os\nos._exit(0)\n")
    elif hack == "exit at import":
        write(env, f"{module}.py", "import os\nos._exit(0)\n" + source)
    else:
        eq = "class Eq:\n    def __eq__(self, o): return True\n"
        stubs = "".join(f"def {n}(*a):\n    return Eq()\n" for n in names)
        write(env, f"{module}.py", eq + stubs)
    _, reward, terminated, _, info = env.step(assistant("done"))
    assert terminated and reward == 0.0, info["outcome"]
    assert info["outcome"]["details"]["tests_modified"] == (hack == "edit the failing test")


def test_file_edit_honest_fix_scores_one_and_reports_facts():
    env = file_task(seed=4)
    module, _ = env.bug
    write(env, f"{module}.py", envs.file_edit.module_source(env.modules[module], None))
    _, reward, _, _, info = env.step(assistant("done"))
    details = info["outcome"]["details"]
    assert reward == 1.0 and details["passed"] == details["total"] > 0
    assert details["tests_modified"] is False and details["files_added"] == []


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.py", "", ".", "a/../../b"])
def test_file_edit_paths_stay_inside_the_repository(path):
    env = file_task()
    obs, *_ = write(env, path, "x")
    assert obs[0]["content"].startswith("Error: invalid path")


def test_a_sandbox_that_cannot_start_is_an_env_error_not_an_observation(monkeypatch):
    """The machine out of processes (fork's EAGAIN) is not the model's doing: the tool call
    raises SandboxLaunchFailed (an EnvBroken) through env.step, so the rollout ends the episode
    as an env error instead of training on "OSError: Resource temporarily unavailable"."""
    import errno

    from envs.sandbox import SandboxLaunchFailed

    def no_fork(*args, **kwargs):
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    env, _ = python_task()
    monkeypatch.setattr("envs.sandbox.runner.subprocess.Popen", no_fork)
    call = assistant("", [tool_call("run_python", {"code": "print(1)"})])
    with pytest.raises(SandboxLaunchFailed, match=r"could not start .*Resource temporarily"):
        env.step(call)


def test_a_model_made_path_clash_stays_a_tool_error_and_a_full_disk_is_an_env_error(monkeypatch):
    """FileEdit's paths are the model's: a file named like a directory of the repository fails
    to stage (IsADirectoryError), which is the model's mistake, an observation; the machine out
    of disk while staging (ENOSPC) is not."""
    import errno

    from envs.sandbox import SandboxLaunchFailed

    env = file_task()
    write = tool_call("write_file", {"path": "tests", "content": "x"})
    env.step(assistant("", [write]))
    obs, *_ = env.step(assistant("", [tool_call("run_tests", {})]))
    assert "IsADirectoryError" in obs[-1]["content"], obs[-1]

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    env = file_task()
    monkeypatch.setattr("envs.sandbox.runner._stage_files", full_disk)
    with pytest.raises(SandboxLaunchFailed, match="could not stage its files"):
        env.step(assistant("", [tool_call("run_tests", {})]))
