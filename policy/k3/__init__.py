"""Kimi-K3-style policy components: plain torch modules and functions (single device).

Attention half: `kda` (Kimi Delta Attention), `mla` (gated NoPE MLA), `attn_res` (Attention
Residuals). The MoE half lives in sibling modules of this package. `modeling` assembles them
into a transformers model (registered as model_type "agentrl_k3" on import of this package);
`cache` is its decode-time state (K3Cache). The subpackage `engine` is the model's fast cached
generation engine for rollouts (K3Policy, K3Session); it imports the model, never the reverse.
"""

from policy.k3.attn_res import AttnRes, AttnResState, attn_res, attn_res_layer, num_stored_sources
from policy.k3.cache import K3Cache
from policy.k3.configuration import K3Config, count_parameters, k3_preset
from policy.k3.kda import KDACache, KimiDeltaAttention, kda_chunked, kda_recurrent
from policy.k3.mla import GatedMLA, MLACache
from policy.k3.modeling import K3ForCausalLM, K3Model, K3PreTrainedModel, register

register()

__all__ = [
    "AttnRes",
    "AttnResState",
    "GatedMLA",
    "K3Cache",
    "K3Config",
    "K3ForCausalLM",
    "K3Model",
    "K3PreTrainedModel",
    "KDACache",
    "KimiDeltaAttention",
    "MLACache",
    "attn_res",
    "attn_res_layer",
    "count_parameters",
    "k3_preset",
    "kda_chunked",
    "kda_recurrent",
    "num_stored_sources",
    "register",
]
