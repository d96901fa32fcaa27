"""`agentrl check` imports the env and binds its kwargs: each mistake a user made with a new env
(a kwarg typo, a plugin that cannot be imported, a typo in a run-file entry point's submodule, a
module that fails on import, a typo in a curriculum stage's env settings) is a config error that
names the key, in seconds, before anything starts. Each case runs the CLI in a fresh process with
a third-party package on its path (installed as a distribution: a dist-info with entry points)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.envs.test_registry import ENV_SOURCE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A directory holding the package `acme_pkg` (a good env, and one whose import fails) and
    its dist-info declaring both as `agentrl.envs` plugins."""
    package = tmp_path / "acme_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "echo.py").write_text(ENV_SOURCE.format(module="acme_pkg.echo"))
    (package / "broken.py").write_text("import acme_dependency_not_installed\n")
    info = tmp_path / "acme_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[agentrl.envs]\nacme/Echo-v0 = acme_pkg.echo:EchoEnv\n"
        "acme/Broken-v0 = acme_pkg.broken:BrokenEnv\n"
    )
    return tmp_path


def check(site: Path, *overrides: str, run_file: str | None = None) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl.cli",
            "check",
            run_file or "configs/quickstart.yaml",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])},
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


CASES = [
    (
        ["env.kwargs.difficuly=2"],
        "env.kwargs.difficuly: agentrl/Calculator-v0 (envs.calculator:CalculatorEnv) takes no "
        "argument 'difficuly'; did you mean 'difficulty'?",
    ),
    (
        ["env.id=acme/Echo-v0", "env.kwargs={max_turn: 3}"],
        "env.kwargs.max_turn: acme/Echo-v0 (acme_pkg.echo:EchoEnv) takes no argument "
        "'max_turn'; did you mean 'max_turns'?",
    ),
    (
        ["env.id=acme/Broken-v0", "env.kwargs={}"],
        "env.kwargs: cannot import 'acme_pkg.broken': ModuleNotFoundError: No module named "
        "'acme_dependency_not_installed'",
    ),
    (
        ["env.id=acme/Mine-v0", "env.entry_point=acme_pkg.ecoh:EchoEnv", "env.kwargs={}"],
        "env.entry_point: cannot import 'acme_pkg.ecoh': ModuleNotFoundError",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), CASES)
def test_env_mistakes_are_config_errors_naming_the_key(site, overrides, message):
    code, out, seconds = check(site, *overrides)
    assert code == 2, out
    assert f"agentrl: config error: {message}" in out
    assert "Traceback" not in out
    # "in seconds": a regression bound, not a benchmark: ~4 s on an idle 2-core machine (the
    # torch import dominates); only a 10x+ slowdown breaks it (the subprocess's limit is 120 s)
    assert seconds < 60, f"took {seconds:.1f} s"


def test_a_curriculum_stage_env_kwarg_typo(site):
    text = (ROOT / "configs/long_context.yaml").read_text()
    assert "{hops: 3," in text
    run_file = site / "typo.yaml"
    run_file.write_text(text.replace("{hops: 3,", "{hopz: 3,"))
    code, out, _ = check(site, run_file=str(run_file))
    assert code == 2 and "config error: curriculum.1.env_kwargs.hopz:" in out, out
    assert "did you mean 'hops'?" in out


def test_good_plugin_settings_pass(site):
    code, out, _ = check(site, "env.id=acme/Echo-v0", "env.kwargs={max_turns: 3}")
    assert code == 0 and "config ok" in out, out
