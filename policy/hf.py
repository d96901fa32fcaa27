"""Any transformers causal LM as the policy: build from a config, load from a local directory,
move weights as numpy arrays with a version and a checksum.

No downloads: `from_pretrained` is called with `local_files_only=True`.
"""

from __future__ import annotations

import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from policy.generate import generate
from policy.k3 import K3Config, k3_preset
from policy.sampling import Completion, SamplingParams


def build_model(model_type: str, config: dict[str, Any], *, vocab_size: int, seed: int = 0):
    """A freshly initialised causal LM of `model_type` (e.g. "qwen3", "llama", "agentrl_k3")
    with `config`; for agentrl_k3, `config["preset"]` names a K3 preset and the other keys
    override its fields."""
    config = dict(config)
    preset = config.pop("preset", None)
    if model_type == K3Config.model_type:
        if preset is None:
            raise ValueError("an agentrl_k3 policy needs config.preset (k3-debug, k3-tiny or k3)")
        hf_config = k3_preset(preset, vocab_size=vocab_size, **config)
    elif preset is not None:
        raise ValueError(f"presets exist for {K3Config.model_type} only, not {model_type!r}")
    else:
        hf_config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **config)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def load_model(path: str | Path):
    return AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, dtype=torch.float32
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def export_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's state as contiguous numpy arrays (what the Ray object store shares zero-copy)."""
    return {
        name: tensor.detach().to("cpu").contiguous().numpy().copy()
        for name, tensor in model.state_dict().items()
    }


def checksum(weights: dict[str, np.ndarray]) -> int:
    """CRC32 over names, shapes, dtypes and bytes, in a fixed order."""
    crc = 0
    for name in sorted(weights):
        array = weights[name]
        crc = zlib.crc32(f"{name}:{array.shape}:{array.dtype}".encode(), crc)
        crc = zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"), crc)
    return crc


def bucketize(weights: dict[str, np.ndarray], bucket_bytes: int) -> list[list[str]]:
    """Group parameter names (in a fixed order) into buckets of about `bucket_bytes` each, so a
    push streams bounded chunks instead of one object the size of the model."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name in sorted(weights):
        nbytes = weights[name].nbytes
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def import_weights(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Copy arrays into the model in place (strict: names and shapes must match)."""
    state = model.state_dict()
    missing = sorted(set(state) - set(weights))
    unexpected = sorted(set(weights) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the model: missing={missing[:5]}, unexpected={unexpected[:5]}"
        )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only object-store arrays: we only read
        for name, tensor in state.items():
            source = torch.from_numpy(np.asarray(weights[name]))
            if source.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(source.shape)} != {tuple(tensor.shape)}")
            tensor.copy_(source)


def import_verified(model, version: int, weights: dict[str, np.ndarray], expected: int) -> None:
    """import_weights after checking the push's checksum; corrupt weights are never installed."""
    got = checksum(weights)
    if got != expected:
        raise ValueError(f"weights for version {version} are corrupt: checksum {got} != {expected}")
    import_weights(model, weights)


class HFPolicy:
    """The rollout side of a causal LM: batched sampling with the weights of `version`."""

    def __init__(self, model, *, pad_token_id: int, seed: int = 0):
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.version = 0
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    def reseed(self, seed: int) -> None:
        """Make the next draws a function of `seed` alone (exact resume needs no sampler state)."""
        self.generator.manual_seed(seed)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return generate(
            self.model, prompts, params, pad_token_id=self.pad_token_id, generator=self.generator
        )

    def load_weights(self, version: int, weights: dict[str, np.ndarray], expected: int) -> None:
        """Install `weights` as `version` after verifying their checksum."""
        import_verified(self.model, version, weights, expected)
        self.version = version
