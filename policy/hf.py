"""Any transformers causal LM as the policy: build from a config, load from a local directory,
move weights as numpy arrays with a version and a checksum.

No downloads: `from_pretrained` is called with `local_files_only=True`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import policy.k3  # noqa: F401  (registers agentrl_k3 with transformers' Auto classes)
from policy.generate import generate
from policy.model_config import model_config
from policy.sampling import Completion, SamplingParams


def build_model(model_type: str, config: dict[str, Any], *, vocab_size: int, seed: int = 0):
    """A freshly initialised causal LM of `model_type` (e.g. "qwen3", "llama", "agentrl_k3")
    with `config`; for agentrl_k3, `config["preset"]` names a K3 preset and the other keys
    override its fields."""
    hf_config = model_config(model_type, config, vocab_size=vocab_size)
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


class Checksum(int):
    """The checksum of a set of weights (an int) that also keeps each tensor's digest
    (`digests`: name -> int), so a weight push derives its per-bucket checksums from it instead
    of reading every byte again. Arithmetic on it gives a plain int."""

    digests: dict[str, int]

    def __new__(cls, value: int, digests: dict[str, int] | None = None):
        self = super().__new__(cls, value)
        self.digests = digests or {}
        return self


def as_bytes(array: np.ndarray) -> np.ndarray:
    """An array's bytes in C order as a flat uint8 array (a view unless it is not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def tensor_digest(name: str, array: np.ndarray) -> int:
    """xxh3-64 of one tensor's bytes (through a memoryview, no copy), seeded by its name, shape
    and dtype."""
    header = xxhash.xxh3_64_intdigest(f"{name}:{array.shape}:{array.dtype.str}".encode())
    return xxhash.xxh3_64_intdigest(memoryview(as_bytes(array)), seed=header)


def combine(digests: Iterable[int]) -> int:
    """One xxh3-64 over a sequence of digests (a bucket's, or a whole push's, in name order)."""
    return xxhash.xxh3_64_intdigest(np.fromiter(digests, dtype=np.uint64).tobytes())


def checksum(weights: Mapping[str, np.ndarray]) -> Checksum:
    """xxh3-64 over names, shapes, dtypes and bytes, in a fixed (sorted) order: one digest per
    tensor, combined. A bucket's checksum is `combine` of its tensors' digests, so the digests
    kept in the result give every bucket's checksum without another pass over the bytes."""
    digests = {name: tensor_digest(name, weights[name]) for name in sorted(weights)}
    return Checksum(combine(digests.values()), digests)


class VerifiedWeights(Mapping):
    """Read-only weights whose every tensor was hashed on arrival and whose digests combine to
    `checksum`; `import_verified` trusts it instead of hashing all the bytes a second time.
    Make one with `verified()`."""

    __slots__ = ("_weights", "checksum")

    def __init__(self, weights: dict[str, np.ndarray], total: int):
        self._weights, self.checksum = weights, int(total)

    def __getitem__(self, name: str) -> np.ndarray:
        return self._weights[name]

    def __iter__(self):
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def verified(
    version: int, weights: dict[str, np.ndarray], digests: dict[str, int], expected: int
) -> VerifiedWeights:
    """Weights whose tensors were hashed into `digests` as they arrived (each exactly once), after
    checking that those digests cover exactly these names and combine to `expected`."""
    if digests.keys() != weights.keys():
        raise ValueError(f"weights for version {version} are corrupt: digests do not cover them")
    got = combine(digests[name] for name in sorted(weights))
    if got != expected:
        raise ValueError(f"weights for version {version} are corrupt: checksum {got} != {expected}")
    return VerifiedWeights(weights, expected)


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


ADOPTED = "_agentrl_adopted_weights"
"""Attribute a model carries while some of its CPU tensors use adopted (read-only) memory."""


def import_weights(model: torch.nn.Module, weights: Mapping[str, np.ndarray]) -> None:
    """Install arrays as the model's tensors, all or nothing (names and shapes are checked first).

    `VerifiedWeights` are immutable once verified, so a CPU tensor of the same dtype takes the
    array's memory itself, with no copy: a worker then serves straight from the bytes it hashed
    (for an object-store push, the one copy in Ray's shared memory that every worker on the node
    maps; the previous version's memory is freed when nothing holds it any more). Anything else
    is copied: in place into tensors that own their memory (on an accelerator, or dtypes that
    differ), into fresh tensors where the model holds adopted read-only memory."""
    state = model.state_dict(keep_vars=True)  # the parameters and buffers themselves
    missing = sorted(set(state) - set(weights))
    unexpected = sorted(set(weights) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the model: missing={missing[:5]}, unexpected={unexpected[:5]}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays: nothing writes to them
        sources = {name: torch.from_numpy(np.asarray(weights[name])) for name in state}
    for name, tensor in state.items():
        if sources[name].shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(sources[name].shape)} != {tuple(tensor.shape)}")
    adopt = isinstance(weights, VerifiedWeights)
    adopted_before = getattr(model, ADOPTED, False)
    with torch.no_grad():
        for name, tensor in state.items():
            source, on_cpu = sources[name], tensor.device.type == "cpu"
            if adopt and on_cpu and tensor.dtype == source.dtype:
                tensor.data = source  # zero copy: the parameter now uses the verified bytes
            elif adopted_before and on_cpu:  # never write into memory that may be read-only
                tensor.data = source.to(tensor.dtype, copy=True)
            else:
                tensor.copy_(source)
    setattr(model, ADOPTED, adopt)


def import_verified(model, version: int, weights: Mapping[str, np.ndarray], expected: int) -> None:
    """import_weights after checking the push's checksum; corrupt weights are never installed.
    `VerifiedWeights` (a receiver hashed every tensor on arrival) are not hashed again."""
    if not (isinstance(weights, VerifiedWeights) and weights.checksum == expected):
        got = checksum(weights)
        if got != expected:
            raise ValueError(
                f"weights for version {version} are corrupt: checksum {got} != {expected}"
            )
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
