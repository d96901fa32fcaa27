"""docs/run-files.md is generated from the config models: it names every key with its type,
default and meaning, and the committed file equals what the code generates now."""

from __future__ import annotations

from pathlib import Path

from rl.config.docs import run_file_reference
from rl.config.runfile import RunConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "run-files.md"


def test_the_committed_reference_matches_the_code():
    assert DOC.read_text() == run_file_reference(), (
        "docs/run-files.md is stale: run `agentrl config docs --output docs/run-files.md`"
    )


def test_every_key_is_documented_with_a_meaning():
    text = run_file_reference()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert not [r for r in rows if r.rstrip().endswith("|  |")], "a key without a meaning"
    for name in RunConfig.model_fields:
        assert f"`{name}" in text, name
    for key in ("trainer.max_staleness", "rollout.max_turns", "reward.env_reward"):
        assert f"| `{key}` |" in text
    assert "env.kwargs.max_turns" in text  # how the two turn limits interact
