"""docs/environments.md's example, exactly as written: the env passes `agentrl envs check`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "environments.md"


def doc_files() -> dict[str, str]:
    """The doc's code blocks whose first line is `# <file name>`, by file name."""
    files = {}
    for body in re.findall(r"```\w*\n(.*?)```", DOC.read_text(), re.DOTALL):
        first = body.splitlines()[0] if body.strip() else ""
        match = re.fullmatch(r"# ([\w.-]+\.(?:py|yaml))", first)
        if match:
            files[match.group(1)] = body
    return files


def write_doc_files(directory: Path) -> dict[str, str]:
    files = doc_files()
    for name, body in files.items():
        (directory / name).write_text(body)
    return files


def test_the_doc_has_the_env_and_the_run_file():
    assert set(doc_files()) == {"my_envs.py", "capitals.yaml"}
    assert "agentrl envs check my_envs:CapitalsEnv" in DOC.read_text()
    assert "agentrl train capitals.yaml" in DOC.read_text()


def test_the_doc_example_passes_agentrl_envs_check(tmp_path):
    write_doc_files(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "rl.cli", "envs", "check", "my_envs:CapitalsEnv"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASSED: 8/8 checks passed" in proc.stdout


def test_the_doc_run_file_validates(tmp_path):
    write_doc_files(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "rl.cli", "check", "capitals.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert proc.returncode == 0 and "config ok" in proc.stdout, proc.stderr
