"""Our envs as TRL environments: the adapter follows TRL 1.16's contract, and GRPOTrainer trains a
tiny model a few steps with `environment_factory` (offline, CPU)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import gymnasium
import pytest
from transformers.utils import get_json_schema

import envs
from envs.interop import TRLEnvironment, trl_environment


def tools_as_trl_sees_them(instance) -> dict:
    """What GRPOTrainer does: public functions of the class, except reset/get_reward, keyed by
    each function's `__name__` (the name the model must call)."""
    methods = [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]
    return {method.__name__: method for method in methods}


def test_every_env_tool_becomes_a_trl_tool_with_the_same_schema():
    for env_id in envs.env_ids():
        if env_id == "agentrl/Harness-v0":  # its tools come from the user's agent at run time
            continue
        factory = trl_environment(env_id)
        tools = tools_as_trl_sees_them(factory())
        ours = {t["function"]["name"]: t for t in gymnasium.make(env_id).unwrapped.tools}
        assert set(ours) <= set(tools) and "answer" in tools
        for name, schema in ours.items():
            assert get_json_schema(tools[name]) == schema


def test_an_episode_through_the_adapter():
    factory = trl_environment("agentrl/Calculator-v0", difficulty=2)
    env = factory()
    prompt = env.reset(seed=3)
    problem = env._env.unwrapped.problem
    assert prompt == problem.text
    assert env.calculate(expression=problem.expression) == str(problem.answer)
    with pytest.raises(ValueError, match="cannot parse"):
        env.calculate(expression="2 +")  # TRL counts it in tools/failure_frequency
    assert env.get_reward() == 0.0
    env.answer(answer=str(problem.answer))
    assert env.get_reward() == 1.0
    with pytest.raises(RuntimeError, match="episode is over"):
        env.calculate(expression="1")
    assert factory()._index == env._index + 1  # each instance draws its own tasks


def test_an_answer_tool_of_the_env_is_used_as_is():
    env = trl_environment("agentrl/Retrieval-v0")()
    env.reset()
    inner = env._env.unwrapped
    assert env.answer(answer=inner.target) == "Answer submitted."
    assert env.get_reward() == 1.0 and isinstance(env, TRLEnvironment)


def tiny_tokenizer_and_model():
    import trl

    from policy.hf import build_model
    from policy.tokenizer import build_tokenizer, render_conversations

    env = gymnasium.make("agentrl/Calculator-v0")
    expert = envs.make_expert("agentrl/Calculator-v0", error_rate=0.5, seed=0)
    demos = [envs.demonstrate(env, expert, seed=s) for s in range(60)]
    tokenizer = build_tokenizer(
        render_conversations((d.messages, d.tools) for d in demos), vocab_size=400
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<think>", "</think>"]}, replace_extra_special_tokens=False
    )
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates/qwen3.jinja").read_text()
    config = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
    }
    model = build_model("qwen3", config, vocab_size=len(tokenizer), seed=0)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return tokenizer, model


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' gradient_checkpointing rename
def test_trl_grpo_trains_a_tiny_model_on_our_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    tokenizer, model = tiny_tokenizer_and_model()
    assert supports_tool_calling(tokenizer)
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    parsed = add_response_schema(tokenizer).parse_response(call + "<|im_end|>", prefix="")
    args = parsed["tool_calls"][0]["function"]["arguments"]
    env = trl_environment("agentrl/Calculator-v0")()
    env.reset()
    assert env.calculate(**args) == "5"  # what TRL's tool loop calls with the parsed arguments
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=24,
        max_tool_calling_iterations=2,
        logging_steps=1,
        learning_rate=1e-3,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        environment_factory=trl_environment("agentrl/Calculator-v0"),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2 and all("tools/call_frequency" in h for h in logs)
    assert trainer.state.global_step == 2 and os.path.isdir(tmp_path)
