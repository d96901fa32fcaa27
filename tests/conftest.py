"""Shared fixtures: a tokenizer and tiny model built offline, a real redis-server."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
}


@pytest.fixture(scope="session")
def tokenizer():
    import gymnasium

    import envs
    from envs.calculator import CalculatorExpert
    from policy.tokenizer import build_tokenizer, render_conversations

    env = gymnasium.make("agentrl/Calculator-v0")
    expert = CalculatorExpert(error_rate=0.5, seed=0)
    demos = [envs.demonstrate(env, expert, seed=s) for s in range(200)]
    return build_tokenizer(
        render_conversations((d.messages, d.tools) for d in demos), vocab_size=512
    )


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    from policy.hf import build_model

    model = build_model("qwen3", TINY_MODEL, vocab_size=len(tokenizer), seed=0)
    return model.eval()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer, tiny_model):
    path = tmp_path_factory.mktemp("policy")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def redis_server(tmp_path):
    from rl.run.launch import start_redis

    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (tests/gpu/) skip, with the reason, where torch sees no CUDA GPU."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    reason = "needs a CUDA GPU: torch.cuda.is_available() is False"
    if torch.version.cuda is None:
        reason += f" (torch {torch.__version__} is a CPU build)"
    for item in marked:
        item.add_marker(pytest.mark.skip(reason=reason))
