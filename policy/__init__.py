"""The policy: models, tokenizer, generation engines. Knows torch and transformers only."""

from policy.hf import HFPolicy, build_model, checksum, export_weights, import_weights, load_model
from policy.logprobs import token_logprobs
from policy.sampling import Completion, SamplingParams
from policy.tokenizer import build_tokenizer

__all__ = [
    "Completion",
    "HFPolicy",
    "SamplingParams",
    "build_model",
    "build_tokenizer",
    "checksum",
    "export_weights",
    "import_weights",
    "load_model",
    "token_logprobs",
]
