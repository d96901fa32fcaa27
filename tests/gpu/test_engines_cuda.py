"""The rollout engines on CUDA: the fused K3 decode forward equals the model's forward, the
engine's logprobs equal the learner's, greedy decoding equals the CPU's (float64: no ties),
weight pushes install onto the GPU, and multi-turn sessions (K3 and any transformers LM) equal
re-prefilling each history."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from policy.engines import open_session
from policy.hf import HFPolicy, checksum, export_weights
from policy.k3 import K3Cache
from policy.k3.engine import K3Policy
from policy.k3.engine.decode import forward_tokens
from policy.k3.engine.plan import build_plan
from policy.logprobs import decoder_hidden, head_logprobs
from policy.sampling import SamplingParams
from tests.policy.k3.test_engine import make_model, prompts
from tests.policy.test_session import k3_model, qwen_model, run_script

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
F64 = torch.float64


def test_fused_forward_equals_the_model_on_cuda():
    """Left-padded chunked prefill then decode steps, fused vs K3ForCausalLM.forward on the
    whole sequences, float64 on the GPU (tests/policy/k3/test_engine.py's CPU test)."""
    model = make_model().to(CUDA)
    plan = build_plan(model)
    tokens = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(1)).to(CUDA)
    mask = torch.ones_like(tokens)
    mask[0, :5], mask[1, :11] = 0, 0
    with torch.no_grad():
        full = model(tokens, attention_mask=mask).logits
        cache = K3Cache.empty(model.config, 3, dtype=F64, device=CUDA)
        for start, end in ((0, 7), (7, 13)):
            logits, _ = forward_tokens(plan, cache, tokens[:, start:end], mask[:, start:end])
            torch.testing.assert_close(logits, full[:, end - 1], atol=1e-10, rtol=0)
        for t in range(13, 16):
            logits, _ = forward_tokens(plan, cache, tokens[:, t : t + 1])
            torch.testing.assert_close(logits, full[:, t], atol=1e-10, rtol=0)


def learner_logprobs(model, prompt, tokens, temperature):
    """What the learner computes (policy/logprobs.py) for the sampled tokens, on the model's
    device; returned on the CPU."""
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        hidden = decoder_hidden(model, ids, torch.ones_like(ids))
        logp, _ = head_logprobs(model, hidden, ids[:, 1:], temperature=temperature or 1.0)
    return logp[0, len(prompt) - 1 :].cpu()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_engine_logprobs_equal_learner_logprobs_on_cuda(temperature):
    model = make_model(dtype=torch.float32).to(CUDA)
    policy = K3Policy(model, seed=3, max_batch=3, record_routing=True)
    assert policy.fused and policy.device.type == CUDA.type
    params = SamplingParams(temperature=temperature, max_new_tokens=12)
    batch = prompts(6, seed=2)
    for prompt, out in zip(batch, policy.generate(batch, params), strict=True):
        assert len(out.token_ids) == 12 and len(out.routed_experts) == len(prompt) + 11
        want = learner_logprobs(model, prompt, out.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-4, rtol=0)


def test_greedy_on_cuda_equals_the_cpu_in_float64():
    cpu = make_model()
    gpu = copy.deepcopy(cpu).to(CUDA)
    batch = prompts(7, seed=4, lengths=(1, 40))
    params = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(7, 77))
    want = K3Policy(cpu, max_batch=3, prefill_chunk=8).generate(batch, params)
    got = K3Policy(gpu, max_batch=3, prefill_chunk=8).generate(batch, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for got_one, want_one in zip(got, want, strict=True):
        np.testing.assert_allclose(got_one.logprobs, want_one.logprobs, atol=1e-8)


@pytest.mark.parametrize("engine", ["k3", "hf"])
def test_weight_push_installs_onto_the_gpu(engine):
    build = k3_model if engine == "k3" else qwen_model
    policy_cls = K3Policy if engine == "k3" else HFPolicy
    policy = policy_cls(build(seed=0).to(CUDA), pad_token_id=0)
    other = build(seed=9)  # the learner's new weights, pushed as numpy arrays
    weights = export_weights(other)
    policy.load_weights(2, weights, checksum(weights))
    assert policy.version == 2
    for name, tensor in policy.model.state_dict().items():
        assert tensor.device.type == CUDA.type, name
        assert torch.equal(tensor.cpu(), other.state_dict()[name]), name
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    batch = prompts(3, seed=5, lengths=(3, 20))
    fresh = policy_cls(copy.deepcopy(other).to(CUDA), pad_token_id=0)
    got = [o.token_ids for o in policy.generate(batch, greedy)]
    assert got == [o.token_ids for o in fresh.generate(batch, greedy)]


@pytest.mark.parametrize("engine", ["k3", "k3-module", "hf"])
def test_multiturn_sessions_on_cuda_equal_reprefill(engine):
    if engine == "hf":
        policy = HFPolicy(qwen_model().to(CUDA), pad_token_id=0)
    else:
        policy = K3Policy(k3_model().to(CUDA), fused=engine == "k3")
    session = open_session(policy)
    done = run_script(session, policy, turns=3)  # greedy, logprobs within 1e-4 of generate
    assert len(done) == 5 and not session.contexts
