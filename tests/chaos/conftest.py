"""Fixtures of the chaos suite."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_MODEL


@pytest.fixture(scope="session")
def stopping_policy(tmp_path_factory, tokenizer):
    """A tiny qwen3 policy (a `policy.path` directory) that ends each turn after about two
    random tokens, so every few tokens reach `env.step`. An untrained policy almost never
    samples its stop token within `rollout.max_new_tokens`, and a turn cut at that limit ends
    the episode without an env step, so tools would never run. Crafted: the layers add nothing
    (o_proj and down_proj zero), every embedding has a large first component, and the untied
    head scores only the stop token, on that component: P(stop) is about 0.35 at every
    position whatever the context."""
    from policy.hf import build_model

    config = {**TINY_MODEL, "tie_word_embeddings": False}
    model = build_model("qwen3", config, vocab_size=len(tokenizer), seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 0.7
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    path = tmp_path_factory.mktemp("stopping-policy")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
