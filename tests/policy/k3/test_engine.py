"""K3Policy: the fused forward against the model (float64), engine logprobs against the
learner's (float32), continuous batching, stop tokens and budgets, routing record and replay."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from policy.hf import HFPolicy, checksum, export_weights
from policy.k3 import K3Cache, K3ForCausalLM, k3_preset
from policy.k3.engine.decode import forward_tokens, kda_factored
from policy.k3.engine.plan import build_plan
from policy.k3.engine.runner import K3Policy, prefill_groups, replay_indices
from policy.k3.kda import kda_gate_lower_bound, kda_recurrent, l2_normalize
from policy.logprobs import decoder_hidden, head_logprobs
from policy.sampling import SamplingParams

F64 = torch.float64


def make_model(dtype=F64, seed=0, preset="k3-debug", **overrides) -> K3ForCausalLM:
    """A model away from its init symmetries (see test_modeling.make_model)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(k3_preset(preset, **overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.normal_(1.0, 0.3)
            elif "res.proj" in name or "A_log" in name:
                param.normal_(0.0, 0.5)
        for layer in model.model.layers:
            if layer.is_sparse:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model


def prompts(n=5, seed=0, vocab=512, lengths=(2, 30)):
    gen = np.random.default_rng(seed)
    return [gen.integers(1, vocab, size=int(gen.integers(*lengths))).tolist() for _ in range(n)]


def learner_logprobs(model, prompt, tokens, temperature):
    """What the learner computes (policy/logprobs.py) for the sampled tokens."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        hidden = decoder_hidden(model, ids, torch.ones_like(ids))
        logp, _ = head_logprobs(model, hidden, ids[:, 1:], temperature=temperature or 1.0)
    return logp[0, len(prompt) - 1 :]


VARIANTS = [
    {},
    {"attn_res_block_size": None, "q_lora_rank": None, "mla_use_output_gate": False},
    {  # Kimi-Linear-48B-style KDA gates, SwiGLU, plain MoE without shared experts
        "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4],
                               "gate_lower_bound": None, "use_full_rank_gate": False},
        "hidden_act": "silu", "routed_expert_hidden_size": None, "num_shared_experts": 0,
    },
]  # fmt: skip


@pytest.mark.parametrize("overrides", VARIANTS)
def test_fused_forward_equals_the_model(overrides):
    """Left-padded chunked prefill then decode steps, fused (plan.py + decode.py) vs
    K3ForCausalLM.forward on the whole sequences, float64."""
    model = make_model(**overrides)
    plan = build_plan(model)
    tokens = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(tokens)
    mask[0, :5], mask[1, :11] = 0, 0
    with torch.no_grad():
        full = model(tokens, attention_mask=mask).logits
        cache = K3Cache.empty(model.config, 3, dtype=F64)
        for start, end in ((0, 7), (7, 13)):
            logits, _ = forward_tokens(plan, cache, tokens[:, start:end], mask[:, start:end])
            torch.testing.assert_close(logits, full[:, end - 1], atol=1e-10, rtol=0)
        for t in range(13, 16):
            logits, _ = forward_tokens(plan, cache, tokens[:, t : t + 1])
            torch.testing.assert_close(logits, full[:, t], atol=1e-10, rtol=0)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_factored_kda_equals_the_recurrent_reference(chunk):
    """The engine's prefill KDA (inference only) vs kda.kda_recurrent: ragged length, masked
    (left-padded) steps, nonzero initial state, gates at the -5 bound; float64."""
    gen = torch.Generator().manual_seed(chunk)
    batch, length, heads, dim = 3, 37, 2, 8
    q = l2_normalize(torch.randn(batch, length, heads, dim, generator=gen, dtype=F64))
    k = l2_normalize(torch.randn(batch, length, heads, dim, generator=gen, dtype=F64))
    v = torch.randn(batch, length, heads, dim, generator=gen, dtype=F64)
    f = 4 * torch.randn(batch, length, heads, dim, generator=gen, dtype=F64)
    g = kda_gate_lower_bound(f, torch.zeros(heads, dtype=F64), torch.zeros(heads * dim, dtype=F64))
    beta = torch.rand(batch, length, heads, generator=gen, dtype=F64)
    state = torch.randn(batch, heads, dim, dim, generator=gen, dtype=F64)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[0, :9], mask[2, :30] = False, False
    want_o, want_s = kda_recurrent(q, k, v, g, beta, scale=1.0, initial_state=state, mask=mask)
    got_o, got_s = kda_factored(q, k, v, g, beta, state, mask, chunk)
    torch.testing.assert_close(got_o, want_o, atol=1e-12, rtol=0)
    torch.testing.assert_close(got_s, want_s, atol=1e-12, rtol=0)


def test_fused_experts_paths_agree_in_float32():
    """The gather / bucket / grouped expert paths (picked by batch size) in float32: as close
    to the float64 model as the float32 model itself is (both round differently)."""
    model = make_model(dtype=torch.float32, preset="k3-tiny")
    plan = build_plan(model)
    exact = copy.deepcopy(model).double()
    for batch in (1, 5, 16, 40):  # 2, 10, 32, 80 assignments for 16 experts, top-2
        tokens = torch.randint(0, 768, (batch, 9), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            want = exact(tokens).logits[:, -1]
            model_err = (model(tokens).logits[:, -1].double() - want).abs().max()
            cache = K3Cache.empty(model.config, batch, dtype=torch.float32)
            forward_tokens(plan, cache, tokens[:, :8])
            logits, _ = forward_tokens(plan, cache, tokens[:, 8:])
        fused_err = (logits.double() - want).abs().max()
        assert fused_err < 1e-4 and fused_err <= 4 * model_err + 1e-6, (fused_err, model_err)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=12),
        SamplingParams(temperature=0.7, max_new_tokens=12),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.8, max_new_tokens=12),
        SamplingParams(temperature=0.0, max_new_tokens=12),
    ],
)
def test_engine_logprobs_equal_learner_logprobs(params):
    model = make_model(dtype=torch.float32)
    policy = K3Policy(model, seed=3, max_batch=3)
    batch = prompts(6, seed=2)
    for prompt, out in zip(batch, policy.generate(batch, params), strict=True):
        assert len(out.token_ids) == len(out.logprobs) == 12 and out.finish_reason == "length"
        want = learner_logprobs(model, prompt, out.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-5, rtol=0)


def test_continuous_batching_gives_each_prompt_its_own_tokens(monkeypatch):
    """Rows join (extend), leave (select) and get compacted mid-generation; greedy tokens equal
    those of each prompt alone, of the module path and of the generic engine."""
    model = make_model()
    batch = [prompts(1, seed=3, lengths=(40, 41))[0], *prompts(6, seed=4, lengths=(1, 12))]
    stops = tuple(range(0, 512, 6))  # rows stop at scattered steps
    params = SamplingParams(temperature=0.0, max_new_tokens=9, stop_token_ids=stops)
    alone = [K3Policy(model).generate([p], params)[0] for p in batch]
    compactions = []
    compact = K3Cache.compact
    monkeypatch.setattr(K3Cache, "compact", lambda self: compactions.append(1) or compact(self))
    for max_batch in (1, 2, 3, 16):
        outs = K3Policy(model, max_batch=max_batch, prefill_chunk=8).generate(batch, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in alone]
    assert compactions
    reference = K3Policy(model, fused=False, max_batch=3).generate(batch, params)
    generic = HFPolicy(model, pad_token_id=0).generate(batch, params)  # policy/generate.py
    assert [o.token_ids for o in reference] == [o.token_ids for o in alone]
    assert [o.token_ids for o in generic] == [o.token_ids for o in alone]


def test_prefill_groups_bound_the_padding():
    lengths = [5, 100, 98, 97, 20, 18, 300, 4, 4, 4]
    groups = prefill_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(10))
    for group in groups:
        sizes = [lengths[i] for i in group]
        assert max(sizes) * len(sizes) <= 1.25 * sum(sizes)
    assert prefill_groups([128] * 16) == [list(range(16))]


def test_transformers_generate_agrees():
    """model.generate (recomputes the prefix each step, no cache) == the engine, greedy."""
    model = make_model(dtype=torch.float32)
    batch = torch.tensor(prompts(3, seed=8, lengths=(9, 10)))
    hf = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=5,
                        do_sample=False, pad_token_id=0)  # fmt: skip
    ours = K3Policy(model).generate(batch.tolist(), SamplingParams(temperature=0, max_new_tokens=5))
    assert hf[:, 9:].tolist() == [o.token_ids for o in ours]


def test_stop_tokens_and_budget():
    model = make_model()
    batch = prompts(6, seed=5)
    free = K3Policy(model).generate(batch, SamplingParams(temperature=0.0, max_new_tokens=10))
    stop = free[0].token_ids[3]
    outs = K3Policy(model, max_batch=2).generate(
        batch, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,))
    )
    for before, out in zip(free, outs, strict=True):
        if stop in before.token_ids:
            cut = before.token_ids.index(stop) + 1
            assert out.token_ids == before.token_ids[:cut] and out.finish_reason == "stop"
        else:
            assert out.token_ids == before.token_ids and out.finish_reason == "length"
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 4
    one = K3Policy(model).generate(batch[:2], SamplingParams(max_new_tokens=1))
    assert [len(o.token_ids) for o in one] == [1, 1]
    with pytest.raises(ValueError):
        K3Policy(model).generate([[]], SamplingParams())


def test_seeds_weights_and_versions():
    model = make_model(dtype=torch.float32)
    batch, params = prompts(4, seed=6), SamplingParams(temperature=1.0, max_new_tokens=8)
    policy = K3Policy(model, seed=1)
    first = [o.token_ids for o in policy.generate(batch, params)]
    policy.reseed(1)
    assert [o.token_ids for o in policy.generate(batch, params)] == first
    other = make_model(dtype=torch.float32, seed=9)
    weights = export_weights(other)
    with pytest.raises(ValueError):
        policy.load_weights(4, weights, checksum(weights) + 1)
    policy.load_weights(4, weights, checksum(weights))
    assert policy.version == 4
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    got = [o.token_ids for o in policy.generate(batch, greedy)]
    assert got == [o.token_ids for o in K3Policy(other).generate(batch, greedy)]
    with torch.no_grad():  # in-place edits are seen too (the packed weights are rebuilt)
        model.lm_head.weight.mul_(-1.0)
    assert [o.token_ids for o in policy.generate(batch, greedy)] != got


def test_routing_is_recorded_and_replays_through_the_model():
    model = make_model()
    batch = prompts(4, seed=7)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    outs = K3Policy(model, record_routing=True, max_batch=2, seed=2).generate(batch, params)
    sparse, top_k = model.config.mlp_types.count("sparse"), model.config.num_experts_per_token
    for prompt, out in zip(batch, outs, strict=True):
        seq = torch.tensor([prompt + out.token_ids])
        length = seq.shape[1]
        assert out.routed_experts.dtype == np.int16
        assert out.routed_experts.shape == (length - 1, sparse, top_k)
        replay = replay_indices(out, length)
        with torch.no_grad():
            live = model(seq, return_routing=True).routed_experts
        assert torch.equal(live[:, :-1].sort(-1).values, replay[:, :-1].sort(-1).values)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_sparse:
                layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
    model.train()
    out = model(seq, replay_experts=replay, return_routing=True)
    assert torch.equal(out.routed_experts, replay)
    out.logits.sum().backward()
    assert all(
        layer.mlp.gate.weight.grad.abs().sum() > 0
        for layer in model.model.layers
        if layer.is_sparse
    )
    assert K3Policy(model).generate(batch[:1], params)[0].routed_experts is None
