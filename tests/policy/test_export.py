"""A model users can take away (policy/export.py): a process that cannot import agentrl loads the
exported directory with plain transformers (the K3 policy through `trust_remote_code=True`) and
its greedy generation gives exactly the tokens of agentrl's own rollout engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from policy.engines import rollout_policy
from policy.export import ExportError, export_model, module_sources
from policy.hf import build_model, load_model, load_tokenizer
from policy.sampling import SamplingParams
from policy.tokenizer import build_tokenizer
from tests.conftest import TINY_MODEL

OURS = ("policy", "rl", "rollout", "envs", "reward")
MESSAGES = [
    {"role": "system", "content": "You are a calculator assistant."},
    {"role": "user", "content": "What is 12 + 30 * 7?"},
]
NEW_TOKENS = 24
OUR_IMPORT = re.compile(r"^\s*(from|import)\s+(policy|rl|rollout|envs|reward)\b", re.MULTILINE)
# Runs in a fresh interpreter with our packages made unimportable first (the venv installs
# agentrl editable, so a plain subprocess could still import them).
CLEAN = f"""
import json, sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OURS!r}:
            raise ImportError(f"{{name}} is not importable in this test")
        return None
sys.meta_path.insert(0, Blocked())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, remote = sys.argv[1], sys.argv[2] == "remote"
kwargs = {{"trust_remote_code": True}} if remote else {{}}
tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
prompt = tokenizer.apply_chat_template({MESSAGES!r}, add_generation_prompt=True)["input_ids"]
ids = torch.tensor([prompt])
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens={NEW_TOKENS})
for name in {OURS!r}:
    assert name not in sys.modules, name
print(json.dumps({{"class": type(model).__module__ + "." + type(model).__name__,
                  "prompt": prompt, "tokens": out[0, len(prompt):].tolist()}}))
"""


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [
        "<|im_start|>user\nWhat is 12 + 30 * 7?<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>{"name": "calculate", "arguments": {"expression": "12 + 30 * 7"}}'
        "</tool_call><|im_end|>\n<|im_start|>tool\n222<|im_end|>\nThe answer is 222."
    ] * 20
    return build_tokenizer(corpus, vocab_size=320)


def clean_generate(path: Path, tmp_path: Path, *, remote: bool) -> dict:
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf-modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", CLEAN, str(path), "remote" if remote else "local"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Do you wish to run the custom code" not in proc.stderr  # never an interactive prompt
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engine_tokens(path: Path) -> tuple[list[int], list[int]]:
    """(prompt, greedy tokens) of agentrl's rollout engine on the exported directory."""
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    policy = rollout_policy(load_model(path), pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(
        temperature=0.0, max_new_tokens=NEW_TOKENS, stop_token_ids=(tokenizer.eos_token_id,)
    )
    (completion,) = policy.generate([prompt], params)
    return prompt, completion.token_ids


@pytest.mark.slow
def test_k3_loads_with_remote_code_in_a_clean_process_and_generates_like_the_engine(
    tmp_path, tokenizer
):
    model = build_model("agentrl_k3", {"preset": "k3-debug"}, vocab_size=len(tokenizer), seed=3)
    out = export_model(model, tokenizer, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration.K3Config",
        "AutoModel": "modeling.K3Model",
        "AutoModelForCausalLM": "modeling.K3ForCausalLM",
    }
    assert config["architectures"] == ["K3ForCausalLM"]
    code = {p.name for p in out.glob("*.py")}
    assert {"configuration.py", "modeling.py", "kda.py", "mla.py", "moe.py"} <= code
    assert not code & {"runner.py", "engine.py", "logprobs.py"}  # the engine is not the model
    for name in code:
        assert not OUR_IMPORT.search((out / name).read_text()), name

    clean = clean_generate(out, tmp_path, remote=True)
    assert clean["class"].startswith("transformers_modules.") and clean["class"].endswith(
        "modeling.K3ForCausalLM"
    )
    prompt, tokens = engine_tokens(out)  # our own loader still reads the directory
    assert clean["prompt"] == prompt
    assert len(tokens) > 1
    assert clean["tokens"] == tokens


@pytest.mark.slow
def test_a_dense_transformers_model_exports_without_code(tmp_path, tokenizer):
    model = build_model("qwen3", TINY_MODEL, vocab_size=len(tokenizer), seed=0)
    out = export_model(model, tokenizer, tmp_path / "export")
    assert not list(out.glob("*.py"))
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    clean = clean_generate(out, tmp_path, remote=False)
    prompt, tokens = engine_tokens(out)
    assert clean["prompt"] == prompt and clean["tokens"] == tokens


def test_the_code_is_generated_from_our_source_with_relative_imports():
    sources = module_sources(["policy.k3.modeling"])
    assert "modeling.py" in sources and "precision.py" in sources  # transitive
    assert "from .attn_res import AttnRes" in sources["modeling.py"]
    header = "# Generated by agentrl export from policy/k3/modeling.py"
    assert sources["modeling.py"].startswith(header)
    with pytest.raises(ExportError, match="not a module file"):
        module_sources(["policy.nothing_here"])
