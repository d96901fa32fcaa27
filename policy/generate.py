"""Batched generation for any transformers causal LM (the generic engine).

Letters: B = active sequences, P = padded prompt length, V = vocabulary.

Prompts of different lengths are left-padded and prefilled in one forward; decoding then runs one
token per step over a shared KV cache. A sequence that emits a stop token or reaches its budget
leaves the batch at once (the cache rows are dropped), so long stragglers do not pay for the
finished ones.
"""

from __future__ import annotations

import torch

from policy.sampling import Completion, SamplingParams, left_pad, sample_next


def _forward(model, input_ids, attention_mask, position_ids, cache):
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :], getattr(out, "cache", None) or out.past_key_values


@torch.inference_mode()
def generate(
    model,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> list[Completion]:
    """Sample a completion for every prompt (each a list of token ids)."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    ids_BP, mask_BP = left_pad(prompts, pad_token_id)
    ids_BP, mask_BP = ids_BP.to(device), mask_BP.long().to(device)
    pos_BP = (mask_BP.cumsum(-1) - 1).clamp(min=0)
    logits_BV, cache = _forward(model, ids_BP, mask_BP, pos_BP, None)

    results = [Completion() for _ in prompts]
    active = torch.arange(len(prompts), device=device)  # [B] index into results
    next_pos_B = pos_BP[:, -1] + 1
    stops = torch.tensor(params.stop_token_ids or [-1], device=device)
    for step in range(params.max_new_tokens):
        tokens_B, logp_B = sample_next(logits_BV, params, generator)
        for row, token, logp in zip(
            active.tolist(), tokens_B.tolist(), logp_B.tolist(), strict=True
        ):
            results[row].token_ids.append(token)
            results[row].logprobs.append(logp)
        stopped_B = torch.isin(tokens_B, stops)
        for row in active[stopped_B].tolist():
            results[row].finish_reason = "stop"
        if step == params.max_new_tokens - 1:
            break
        keep_B = ~stopped_B
        if not bool(keep_B.any()):
            break
        if not bool(keep_B.all()):
            cache.batch_select_indices(keep_B.nonzero()[:, 0])
            active, tokens_B, next_pos_B = active[keep_B], tokens_B[keep_B], next_pos_B[keep_B]
            mask_BP = mask_BP[keep_B]
        mask_BP = torch.cat([mask_BP, mask_BP.new_ones((len(active), 1))], dim=1)
        logits_BV, cache = _forward(model, tokens_B[:, None], mask_BP, next_pos_B[:, None], cache)
        next_pos_B = next_pos_B + 1
    return results
