"""Library code logs through `logging`; the CLI shows it as `[agentrl] ...` lines at the level
its --verbose / --quiet flags choose."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rl import cli
from rl.observe.console import LEVEL_ENV, configure, level_from_flags

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch):
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level) for n in ("rl",)}
    yield
    for name, (handlers, level) in saved.items():
        logging.getLogger(name).handlers[:] = handlers
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize(
    ("level", "shown"),
    [
        ("INFO", ["info", "warning"]),
        ("DEBUG", ["debug", "info", "warning"]),
        ("WARNING", ["warning"]),
    ],
)
def test_levels_and_the_console_format(capsys, monkeypatch, level, shown):
    configure(level)
    log = logging.getLogger("rl.run.weights")
    log.debug("pushed version 3")
    log.info("step 1 done")
    log.warning("worker-1 restarted")
    out = capsys.readouterr().out.splitlines()
    expected = {
        "debug": "[agentrl] debug rl.run.weights: pushed version 3",
        "info": "[agentrl] step 1 done",
        "warning": "[agentrl] warning: worker-1 restarted",
    }
    assert out == [expected[k] for k in shown]
    assert os.environ[LEVEL_ENV] == level  # Ray actors started later log at the same level


def test_the_cli_flags_choose_the_level(capsys):
    assert level_from_flags(False, False) == "INFO"
    assert level_from_flags(True, False) == "DEBUG"
    assert level_from_flags(False, True) == "WARNING"
    assert cli.main(["check", QUICKSTART, "--quiet"]) == 0
    assert capsys.readouterr().out == "config ok\n"  # the CLI's own lines stay
    assert logging.getLogger("rl").level == logging.WARNING
    assert cli.main(["check", QUICKSTART, "--verbose"]) == 0
    assert logging.getLogger("rl").level == logging.DEBUG
    with pytest.raises(SystemExit):
        cli.main(["check", QUICKSTART, "--verbose", "--quiet"])
