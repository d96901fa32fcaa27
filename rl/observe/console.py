"""Console output. Library code logs through `logging`, each module to the logger named after
it (`logging.getLogger(__name__)`, under the packages rl, rollout, policy, envs and reward); the
CLI shows INFO records as the familiar `[agentrl] ...` lines on stdout, DEBUG records too with
`--verbose`, and only warnings and errors with `--quiet`.

    configure("DEBUG")        # the CLI does this once; it also exports AGENTRL_LOG_LEVEL
    configure_from_env()      # what Ray actors call, so their records follow the same level
"""

from __future__ import annotations

import logging
import os
import sys

PACKAGES = ("rl", "rollout", "policy", "envs", "reward")
LEVEL_ENV = "AGENTRL_LOG_LEVEL"


class _Formatter(logging.Formatter):
    """INFO: `[agentrl] text`; DEBUG: `[agentrl] debug rl.run.weights: text`; WARNING and above:
    `[agentrl] warning: text`."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        if record.levelno == logging.INFO:
            return f"[agentrl] {text}"
        if record.levelno < logging.INFO:
            return f"[agentrl] debug {record.name}: {text}"
        return f"[agentrl] {record.levelname.lower()}: {text}"


def configure(level: int | str = "INFO") -> None:
    """Send our packages' records at `level` and above to stdout (idempotent); child processes
    started afterwards (Ray's workers) find the level in AGENTRL_LOG_LEVEL."""
    level = logging.getLevelName(level) if isinstance(level, int) else level.upper()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Formatter())
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
    os.environ[LEVEL_ENV] = level


def configure_from_env() -> None:
    """In a Ray actor: the level the CLI chose, if it chose one (else leave logging alone)."""
    level = os.environ.get(LEVEL_ENV)
    if level:
        configure(level)


def level_from_flags(verbose: bool, quiet: bool) -> str:
    """--verbose -> DEBUG, --quiet -> WARNING, neither -> INFO."""
    if verbose and quiet:
        raise ValueError("--verbose and --quiet exclude each other")
    return "DEBUG" if verbose else "WARNING" if quiet else "INFO"
