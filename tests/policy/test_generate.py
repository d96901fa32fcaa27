from __future__ import annotations

import numpy as np
import pytest
import torch

from policy.hf import HFPolicy, checksum, export_weights, import_weights
from policy.logprobs import token_logprobs
from policy.sampling import SamplingParams, sample_next


def prompts(n=6, vocab=300, seed=0):
    gen = np.random.default_rng(seed)
    return [gen.integers(10, vocab, size=int(gen.integers(5, 40))).tolist() for _ in range(n)]


def learner_logprobs(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)
    return logp[0, len(prompt) - 1 :]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_rollout_logprobs_equal_learner_logprobs(tiny_model, temperature):
    policy = HFPolicy(tiny_model, pad_token_id=0, seed=1)
    params = SamplingParams(temperature=temperature, max_new_tokens=12, stop_token_ids=(7, 9))
    batch = prompts()
    outs = policy.generate(batch, params)
    for prompt, out in zip(batch, outs, strict=True):
        assert len(out.token_ids) == len(out.logprobs) <= 12
        assert out.finish_reason == ("stop" if out.token_ids[-1] in (7, 9) else "length")
        ref = learner_logprobs(tiny_model, prompt, out.token_ids, temperature or 1.0)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5), (out.logprobs, ref)


def test_batched_greedy_equals_one_at_a_time(tiny_model):
    policy = HFPolicy(tiny_model, pad_token_id=0)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    batch = prompts(5)
    together = [o.token_ids for o in policy.generate(batch, params)]
    alone = [policy.generate([p], params)[0].token_ids for p in batch]
    assert together == alone


def test_chunked_logprobs_equal_full_logits(tiny_model):
    ids = torch.tensor(prompts(3, seed=4)[0:1] * 2)
    mask = torch.ones_like(ids)
    logits = tiny_model(input_ids=ids, attention_mask=mask).logits
    full = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    probs = torch.softmax(logits[:, :-1].float(), -1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    for chunk in (1, 7, 1024):
        got, ent = token_logprobs(tiny_model, ids, mask, chunk=chunk)
        assert torch.allclose(got, full, atol=1e-5) and torch.allclose(ent, entropy, atol=1e-4)


def test_chunked_gradients_equal_full_logits(tiny_model):
    ids = torch.tensor(prompts(2, seed=5)[:1])
    mask = torch.ones_like(ids)
    params = [p for p in tiny_model.parameters() if p.requires_grad]
    got, _ = token_logprobs(tiny_model, ids, mask, chunk=5)
    grads = torch.autograd.grad(got.sum(), params)
    logits = tiny_model(input_ids=ids, attention_mask=mask).logits
    full = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum()
    ref = torch.autograd.grad(full, params)
    for a, b in zip(grads, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_top_k_and_top_p_restrict_the_draw():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logp = sample_next(logits, SamplingParams(top_k=2), gen)
    assert set(tokens.tolist()) == {2, 3}
    assert torch.allclose(logp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])
    tokens, _ = sample_next(logits, SamplingParams(top_p=0.5), gen)
    assert set(tokens.tolist()) == {3}  # p(3) = 0.64 already covers 0.5


def test_weights_round_trip_with_checksum(tiny_model, tokenizer):
    from policy.hf import build_model
    from tests.conftest import TINY_MODEL

    weights = export_weights(tiny_model)
    other = build_model("qwen3", TINY_MODEL, vocab_size=len(tokenizer), seed=123)
    policy = HFPolicy(other, pad_token_id=0)
    bad = dict(weights)
    bad["lm_head.weight"] = bad["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="corrupt"):
        policy.load_weights(5, bad, checksum(weights))
    policy.load_weights(5, weights, checksum(weights))
    assert policy.version == 5
    assert checksum(export_weights(other)) == checksum(weights)
    with pytest.raises(ValueError, match="missing"):
        import_weights(other, {})
