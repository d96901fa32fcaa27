"""Released Kimi K3 checkpoints: name/layout map, strict loading, config.json, MLA norm eps, and
parity with transformers' KimiLinearForCausalLM on the subset both implement."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from policy.k3 import K3Config, K3ForCausalLM, k3_preset
from policy.k3.released import (
    ReleasedCheckpointError,
    checkpoint_plan,
    from_released,
    load_released,
    save_released,
    to_released,
)
from policy.k3.released_config import config_from_released, config_to_released

F64 = torch.float64


def released_layout(c: K3Config) -> dict[str, tuple[int, ...]]:
    """Released tensor names and shapes, written out by hand from the reference (Moonshot's
    modeling_kimi_linear.py names), independently of policy.k3.released."""
    d, la = c.hidden_size, c.linear_attn_config
    hk, k, conv = la["num_heads"] * la["head_dim"], la["head_dim"], la["short_conv_kernel_size"]
    out = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,),
           "lm_head.weight": (c.vocab_size, d), "model.output_attn_res_proj.weight": (1, d),
           "model.output_attn_res_norm.weight": (d,)}  # fmt: skip
    for i, kind in enumerate(c.layer_types):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        out |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
        for site in ("self_attention_res", "mlp_res"):
            out |= {p + f"{site}_proj.weight": (1, d), p + f"{site}_norm.weight": (d,)}
        if kind == "linear_attention":
            out |= {a + f"{x}_proj.weight": (hk, d) for x in "qkv"}
            out |= {a + f"{x}_conv1d.weight": (hk, 1, conv) for x in "qkv"}
            out |= {a + "A_log": (128,), a + "dt_bias": (hk,), a + "f_a_proj.weight": (k, d),
                    a + "f_b_proj.weight": (hk, k), a + "b_proj.weight": (la["num_heads"], d),
                    a + "g_proj.weight": (hk, d), a + "o_norm.weight": (k,),
                    a + "o_proj.weight": (d, hk)}  # fmt: skip
        else:
            h, qk = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
            out |= {a + "q_a_proj.weight": (c.q_lora_rank, d),
                    a + "q_a_layernorm.weight": (c.q_lora_rank,),
                    a + "q_b_proj.weight": (h * qk, c.q_lora_rank),
                    a + "kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.qk_rope_head_dim, d),
                    a + "kv_a_layernorm.weight": (c.kv_lora_rank,),
                    a + "kv_b_proj.weight": (h * (c.qk_nope_head_dim + c.v_head_dim),
                                             c.kv_lora_rank),
                    a + "g_proj.weight": (h * c.v_head_dim, d),
                    a + "o_proj.weight": (d, h * c.v_head_dim)}  # fmt: skip
        if c.mlp_types[i] == "dense":
            f = c.intermediate_size
            out |= {p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f)}  # fmt: skip
            continue
        m, lat, f = p + "block_sparse_moe.", c.routed_expert_hidden_size, c.moe_intermediate_size
        s = c.num_shared_experts * f
        out |= {m + "gate.weight": (c.num_experts, d),
                m + "gate.e_score_correction_bias": (c.num_experts,),
                m + "routed_expert_down_proj.weight": (lat, d),
                m + "routed_expert_up_proj.weight": (d, lat),
                m + "routed_expert_norm.weight": (lat,),
                m + "shared_experts.gate_proj.weight": (s, d),
                m + "shared_experts.up_proj.weight": (s, d),
                m + "shared_experts.down_proj.weight": (d, s)}  # fmt: skip
        for j in range(c.num_experts):
            e = f"{m}experts.{j}."
            out |= {e + "w1.weight": (f, lat), e + "w3.weight": (f, lat), e + "w2.weight": (lat, f)}
    return out


def synthetic_released(c: K3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the released names: norms near 1, A_log zero-padded past the heads."""
    gen, heads = torch.Generator().manual_seed(seed), c.linear_attn_config["num_heads"]
    out = {}
    for name, shape in released_layout(c).items():
        t = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            t = 1 + 0.2 * t
        elif name.endswith("A_log"):
            t[heads:] = 0
        elif len(shape) > 1:
            t = t / math.sqrt(shape[-1])
        out[name] = t
    return out


def write_checkpoint(folder, tensors, config):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config_to_released(config)))
    return folder


@pytest.fixture(scope="module")
def tiny():
    return k3_preset("k3-tiny")


@pytest.fixture(scope="module")
def released(tiny):
    return synthetic_released(tiny)


def test_plan_matches_the_handwritten_layout(tiny, released):
    plan = checkpoint_plan(tiny)
    names = [name for e in plan for name in e.released]
    assert len(names) == len(set(names))
    shapes = {n: s for e in plan for n, s in zip(e.released, e.released_shapes, strict=True)}
    assert shapes == released_layout(tiny)


def test_full_k3_tensor_count_matches_the_release():
    """A header audit of the release counts 497,052 text tensors, every routed-expert weight
    stored as a weight_packed + weight_scale pair: 92 * 896 * 3 expert weights counted once."""
    plan = checkpoint_plan(k3_preset("k3"))
    experts = 92 * 896 * 3
    assert sum(len(e.released) for e in plan) == 497_052 - experts


def test_synthetic_release_loads_into_the_right_places(tmp_path, tiny, released):
    model = load_released(write_checkpoint(tmp_path / "ck", released, tiny))
    assert not model.training and model.config.to_dict() == tiny.to_dict()
    layer, moe = model.model.layers[1], model.model.layers[1].mlp
    r = "model.layers.1.block_sparse_moe.experts.5."
    f = tiny.moe_intermediate_size
    assert torch.equal(moe.experts.gate_up_proj[5, :f], released[r + "w1.weight"])
    assert torch.equal(moe.experts.gate_up_proj[5, f:], released[r + "w3.weight"])
    assert torch.equal(moe.experts.down_proj[5], released[r + "w2.weight"])
    res = released["model.layers.1.self_attention_res_proj.weight"]
    assert torch.equal(layer.self_attention_res.proj.weight, res)
    assert torch.equal(layer.self_attn.A_log, released["model.layers.1.self_attn.A_log"][:2])
    # and back: exactly the released tensors, A_log padding included
    again = to_released(model.state_dict(), tiny)
    assert again.keys() == released.keys()
    assert all(torch.equal(again[n], released[n]) for n in released)


def _moe_reference(x, t, c, p="model.layers.1.block_sparse_moe."):
    """The released K3 MoE block (KimiSparseMoeBlock), straight from the released tensors."""
    scores = torch.sigmoid(x @ t[p + "gate.weight"].T)
    idx = (scores + t[p + "gate.e_score_correction_bias"]).topk(c.num_experts_per_token).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor

    def glu(h, gate, up, down):
        g, u = h @ gate.T, h @ up.T
        return (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)) @ down.T

    z = x @ t[p + "routed_expert_down_proj.weight"].T
    y = torch.zeros_like(z)
    for n in range(x.shape[0]):
        for slot, j in enumerate(idx[n].tolist()):
            e = f"{p}experts.{j}."
            out = glu(z[n], t[e + "w1.weight"], t[e + "w3.weight"], t[e + "w2.weight"])
            y[n] += w[n, slot] * out
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
    y = (y * t[p + "routed_expert_norm.weight"]) @ t[p + "routed_expert_up_proj.weight"].T
    s = p + "shared_experts."
    return y + glu(x, *(t[f"{s}{n}_proj.weight"] for n in ("gate", "up", "down")))


def test_moe_layer_equals_the_reference_on_released_tensors(tiny, released):
    model = K3ForCausalLM(tiny).double()
    model.load_state_dict(from_released(released, tiny), strict=True)
    t = {n: v.double() for n, v in released.items()}
    x = torch.randn(6, tiny.hidden_size, generator=torch.Generator().manual_seed(1), dtype=F64)
    want = _moe_reference(x, t, tiny)
    torch.testing.assert_close(model.model.layers[1].mlp(x), want, atol=1e-12, rtol=1e-12)


def _randomized(config, seed=0):
    """A model whose every tensor is random (norms, AttnRes queries and biases included)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(config)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(1 + 0.2 * torch.randn_like(t) if name.endswith("norm.weight") else t)
            if name.endswith(("res.proj.weight", "e_score_correction_bias")):
                t.normal_(0, 0.1)
    return model


def test_round_trip_is_exact(tmp_path, tiny):
    model = _randomized(tiny)
    state = model.state_dict()
    back = from_released(to_released(state, tiny), tiny)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[n], state[n]) for n in state)
    loaded = load_released(save_released(state, tiny, tmp_path / "ck"))
    assert all(torch.equal(loaded.state_dict()[n], state[n]) for n in state)
    ids = torch.randint(0, tiny.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_missing_extra_and_misshapen_tensors_are_named(tiny, released):
    name = "model.layers.2.block_sparse_moe.experts.7.w3.weight"
    with pytest.raises(ReleasedCheckpointError, match=rf"1 missing: {name}"):
        from_released({n: t for n, t in released.items() if n != name}, tiny)
    with pytest.raises(ReleasedCheckpointError, match=r"1 unexpected: model\.layers\.0\.extra"):
        from_released(released | {"model.layers.0.extra": torch.zeros(1)}, tiny)
    bad = released | {name: released[name].T.contiguous()}
    with pytest.raises(ReleasedCheckpointError, match=rf"misshapen: {name}: \(48, 96\)"):
        from_released(bad, tiny)
    legacy = released | {"model.layers.1.mlp_res.proj.weight": torch.zeros(1, 96)}
    with pytest.raises(ReleasedCheckpointError, match=r"unexpected: model.layers.1.mlp_res.proj"):
        from_released(legacy, tiny)


def test_nothing_loads_partially(tmp_path, tiny, released):
    short = {n: t for n, t in released.items() if not n.startswith("model.layers.3.")}
    folder = write_checkpoint(tmp_path / "ck", short, tiny)
    with pytest.raises(ReleasedCheckpointError, match=r"missing: model\.layers\.3\..* more\)"):
        load_released(folder)


def test_a_log_layouts(tiny, released):
    name = "model.layers.0.self_attn.A_log"
    heads = released[name][:2]
    for layout in (heads, heads.view(1, 1, 2, 1)):  # K3 modeling code, Kimi-Linear-48B
        state = from_released(released | {name: layout}, tiny)
        assert torch.equal(state[name], heads)
    padded = released[name].clone()
    padded[100] = 1.0
    with pytest.raises(ReleasedCheckpointError, match=rf"{name}: padding .* not zero"):
        from_released(released | {name: padded}, tiny)


def test_vision_language_release_and_packed_experts(tiny, released):
    vl = {f"language_model.{n}": t for n, t in released.items()}
    vl |= {"vision_tower.patch_embed.proj.weight": torch.zeros(2),
           "mm_projector.0.weight": torch.zeros(2)}  # fmt: skip
    state = from_released(vl, tiny)
    assert torch.equal(state["lm_head.weight"], released["lm_head.weight"])
    with pytest.raises(ReleasedCheckpointError, match=r"outside language_model\.\): audio\.x"):
        from_released(vl | {"audio.x": torch.zeros(1)}, tiny)
    e = "model.layers.1.block_sparse_moe.experts.0.w1."
    packed = {n: t for n, t in released.items() if n != e + "weight"}
    packed |= {e + "weight_packed": torch.zeros(96, 24, dtype=torch.uint8),
               e + "weight_scale": torch.zeros(96, 1)}  # fmt: skip
    with pytest.raises(ReleasedCheckpointError, match=r"MXFP4.*weight_packed"):
        from_released(packed, tiny)


def test_tied_embeddings_store_no_lm_head():
    config = k3_preset("k3-debug", tie_word_embeddings=True)
    model = _randomized(config)
    tensors = to_released(model.state_dict(), config)
    assert "lm_head.weight" not in tensors
    state = from_released(tensors, config)
    assert torch.equal(state["lm_head.weight"], model.model.embed_tokens.weight)


def released_config_dict() -> dict:
    """A released config.json as the K3 release nests it (values of k3-architecture.md sec. 1)."""
    text = config_to_released(k3_preset("k3"))
    text |= {"torch_dtype": "bfloat16", "topk_method": "noaux_tc", "moe_layer_freq": 1,
             "use_grouped_topk": True, "rope_theta": None, "head_dim": 64}  # fmt: skip
    return {"model_type": "kimi_k3", "text_config": text, "vision_config": {"hidden_size": 1152}}


def test_released_config_translates():
    config = config_from_released(released_config_dict())
    assert config.to_dict() | {"dtype": None} == k3_preset("k3").to_dict() | {"dtype": None}
    assert config.dtype == torch.bfloat16
    assert config_from_released(config_to_released(config)).to_dict() == config.to_dict()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("quantization_config", {"quant_method": "compressed-tensors"}, "quantization_config="),
        ("num_nextn_predict_layers", 1, "num_nextn_predict_layers=1"),
        ("mla_use_nope", False, "mla_use_nope=False"),
        ("num_key_value_heads", 8, "num_key_value_heads=8"),
        ("sliding_window", 4096, r"unknown keys \['sliding_window'\]"),
        ("linear_attn_config", {"num_v_heads": 4}, r"linear_attn_config keys \['num_v_heads'\]"),
        ("layer_types", ["full_attention"] * 93, "layer_types disagrees"),
    ],
)
def test_unsupported_released_config_fields_are_refused(key, value, message):
    raw = released_config_dict()
    text = raw["text_config"]
    text[key] = text[key] | value if key == "linear_attn_config" else value
    with pytest.raises(ValueError, match=message):
        config_from_released(raw)


def test_mla_norm_eps_is_the_reference_default():
    """The reference builds q_a_layernorm / kv_a_layernorm without an eps (RMSNorm default 1e-6,
    not rms_norm_eps); transformers' KimiLinearAttention does the same."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    from transformers import KimiLinearConfig

    config = k3_preset("k3-debug")
    mla = K3ForCausalLM(config).model.layers[3].self_attn
    assert mla.q_a_layernorm.eps == mla.kv_a_layernorm.eps == config.mla_norm_eps == 1e-6
    theirs = kimi.KimiLinearAttention(KimiLinearConfig(q_lora_rank=16), layer_idx=0)
    assert theirs.q_a_layernorm.variance_epsilon == theirs.kv_a_layernorm.variance_epsilon == 1e-6


def _subset_config() -> K3Config:
    """What transformers' KimiLinear implements: SiLU, no AttnRes, plain MoE, softplus KDA gate,
    low-rank KDA output gate, ungated MLA (here with a q LoRA)."""
    la = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2],
          "full_attn_layers": [3], "gate_lower_bound": None,
          "use_full_rank_gate": False}  # fmt: skip
    return K3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, linear_attn_config=la,
        num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, mla_use_output_gate=False, num_experts=8,
        num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=16,
        routed_expert_hidden_size=None, intermediate_size=48, hidden_act="silu",
        attn_res_block_size=None, routed_scaling_factor=2.446, max_position_embeddings=4096,
    )  # fmt: skip


def test_same_released_tensors_give_transformers_kimi_linear_logits(tmp_path):
    """One released-format checkpoint (Kimi-Linear-48B A_log layout) loaded by load_released and
    by transformers' KimiLinearForCausalLM.from_pretrained (its own renaming of the released
    names). MLA's LoRA latents are shrunk so that the norm eps matters: with rms_norm_eps
    (1e-5) instead of 1e-6 the logits differ by ~1e-2. transformers runs KDA in fp32."""
    transformers = pytest.importorskip("transformers")
    config = _subset_config()
    model = _randomized(config, seed=3).double()
    with torch.no_grad():
        mla = model.model.layers[2].self_attn
        mla.q_a_proj.weight.mul_(0.003)
        mla.kv_a_proj_with_mqa.weight.mul_(0.003)

    def a_log_48b(tensors):
        return {n: t[:2].view(1, 1, 2, 1) if n.endswith("A_log") else t for n, t in tensors.items()}

    folder = save_released(model.state_dict(), config, tmp_path / "ck", adjust=a_log_48b)
    ours = load_released(folder, dtype=F64)
    theirs, info = transformers.KimiLinearForCausalLM.from_pretrained(
        folder, dtype=F64, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True,
    )  # fmt: skip
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = torch.randint(0, 64, (2, 37), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = theirs.double().eval()(ids).logits
        torch.testing.assert_close(ours(ids).logits, want, atol=5e-6, rtol=1e-5)
        wrong_eps = K3Config(**(config.to_dict() | {"mla_norm_eps": config.rms_norm_eps}))
        off = load_released(folder, wrong_eps, dtype=F64)(ids).logits
    assert (off - want).abs().max() > 1e-3
