"""The K3 rollout engine: fast cached generation from a K3ForCausalLM (the model is policy.k3).

`plan` packs the model's weights once per weight version, `decode` is the fused prefill/decode
forward over a K3Cache, `runner` is K3Policy (chunked prefill, continuous batching, sampling,
routing records) and `session` is K3Session (per-episode caches kept across turns).

Dependency rule: this package imports the model (policy.k3.*); no model module imports it.
K3Cache stays with the model (policy/k3/cache.py) because K3ForCausalLM.forward and its HF
generate() path build and consume it, so moving it here would make the model import the engine.
"""

from policy.k3.engine.runner import K3Policy
from policy.k3.engine.session import K3Session

__all__ = ["K3Policy", "K3Session"]
