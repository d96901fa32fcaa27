"""A user's agent (OpenAI Agents SDK, tools from a real MCP server) trained through agentrl's
endpoint, end to end through the CLI: real Redis, real local Ray, a tiny K3 policy, 2 steps."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.rl.test_e2e import ROOT, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_an_agents_sdk_agent_with_mcp_tools_trains_through_the_endpoint(tmp_path):
    args = [
        str(ROOT / "configs/harness.yaml"),
        f"output_dir={tmp_path}",
        "name=harness",
        "policy.vocab_size=512",
        "sft.demonstrations=64",
        "sft.epochs=1",
        "policy.tokenizer_demonstrations=64",
        "trainer.steps=2",
        "trainer.batch_size=16",
        "trainer.group_size=4",
        "eval.tasks=6",
        "eval.samples=2",
        "rollout.max_new_tokens=24",
        "ray.num_cpus=2",
    ]
    proc, _ = run_cli(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.glob("harness-*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and train[-1]["learner/version"] == 2
    assert all(r["rollout/env_error_rate"] == 0.0 for r in train), "every episode ran"
    trajectories = [
        json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()
    ]
    assert len(trajectories) == 32
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "policy-init")
    (_, prompt_length), *_ = trajectories[0]["mask"]
    prompt = tokenizer.decode(trajectories[0]["tokens"][:prompt_length])
    assert "calculate(expression: string)" in prompt, "the MCP server's tool is in the prompt"
    assert "Call calculate with the problem" in prompt, "the agent's own instructions open it"
