"""Per-token logprobs and entropy of a causal LM, computed in chunks.

Letters: B = batch, T = sequence length, D = hidden size, V = vocabulary, C = chunk length.

Never materialises `[B, T, V]` float32 logits: the decoder's hidden states are projected through
the LM head `chunk` positions at a time, and each chunk is recomputed in the backward pass
(activation checkpointing), so peak memory is `[B, C, V]` whatever T is.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_stats(hidden_BCD, targets_BC, head, temperature: float):
    logits_BCV = head(hidden_BCD).float() / temperature
    logp_BCV = torch.log_softmax(logits_BCV, -1)
    token_logp_BC = logp_BCV.gather(-1, targets_BC[..., None])[..., 0]
    entropy_BC = -(logp_BCV.exp() * logp_BCV).sum(-1)
    return token_logp_BC, entropy_BC


def decoder_hidden(
    model, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> torch.Tensor:
    """[B, T-1, D]: the final hidden state at every position that predicts a next token."""
    position_ids_BT = (attention_mask_BT.cumsum(-1) - 1).clamp(min=0)
    return model.get_decoder()(
        input_ids=input_ids_BT,
        attention_mask=attention_mask_BT,
        position_ids=position_ids_BT,
        use_cache=False,
    ).last_hidden_state[:, :-1]


def head_logprobs(model, hidden_BTD, targets_BT, *, temperature: float = 1.0, chunk: int = 1024):
    """logprob of each target and the entropy, through the LM head `chunk` positions at a time."""
    temperature = temperature or 1.0
    head = model.get_output_embeddings()
    logps, entropies = [], []
    for start in range(0, targets_BT.shape[1], chunk):
        hidden = hidden_BTD[:, start : start + chunk]
        targets = targets_BT[:, start : start + chunk]
        if torch.is_grad_enabled():
            logp, ent = checkpoint(
                _chunk_stats, hidden, targets, head, temperature, use_reentrant=False
            )
        else:
            logp, ent = _chunk_stats(hidden, targets, head, temperature)
        logps.append(logp)
        entropies.append(ent)
    return torch.cat(logps, 1), torch.cat(entropies, 1)


def token_logprobs(
    model,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of token t given tokens < t, for t >= 1: returns ([B, T-1], entropy [B, T-1])."""
    hidden_BTD = decoder_hidden(model, input_ids_BT, attention_mask_BT)
    return head_logprobs(
        model, hidden_BTD, input_ids_BT[:, 1:], temperature=temperature, chunk=chunk
    )


class TokenLogprobs(torch.nn.Module):
    """`policy` as one module whose forward returns (logprobs, entropy, hidden) for every next
    token. Sharded training wraps this module, not the bare causal LM: calling the decoder and
    the LM head separately would bypass the root's all-gather of the embedding and head."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids_BT, attention_mask_BT, temperature: float = 1.0, chunk: int = 1024):
        hidden_BTD = decoder_hidden(self.policy, input_ids_BT, attention_mask_BT)
        logp_BT, entropy_BT = head_logprobs(
            self.policy, hidden_BTD, input_ids_BT[:, 1:], temperature=temperature, chunk=chunk
        )
        return logp_BT, entropy_BT, hidden_BTD
