"""Kimi-K3-style policy components: plain torch modules and functions (single device).

Attention half: `kda` (Kimi Delta Attention), `mla` (gated NoPE MLA), `attn_res` (Attention
Residuals). The MoE half lives in sibling modules of this package.
"""

from policy.k3.attn_res import AttnRes, AttnResState, attn_res, attn_res_layer, num_stored_sources
from policy.k3.kda import KDACache, KimiDeltaAttention, kda_chunked, kda_recurrent
from policy.k3.mla import GatedMLA, MLACache

__all__ = [
    "AttnRes",
    "AttnResState",
    "GatedMLA",
    "KDACache",
    "KimiDeltaAttention",
    "MLACache",
    "attn_res",
    "attn_res_layer",
    "kda_chunked",
    "kda_recurrent",
    "num_stored_sources",
]
