"""benchmarks/scale_plan.py and policy/k3/footprint.py (docs/scale.md): the plan's functions on
k3-debug for N = 64 add up; the meta-device model's parameter counts equal the analytic ones
(k3-debug and full K3, by kind and per layer); the decode cache of a 1M-token episode is the
docs' figure to the byte; the learner's memory model equals the peak live bytes measured on
k3-debug (as tests/policy/k3/test_segments.py measures them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from policy.k3 import K3ForCausalLM, footprint, k3_preset
from policy.k3.footprint import PeakBytes
from policy.logprobs import TokenLogprobs

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scale_plan.py"


@pytest.fixture(scope="module")
def scale_plan():
    spec = importlib.util.spec_from_file_location("scale_plan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def debug_plan(scale_plan):
    config = k3_preset("k3-debug")
    return config, scale_plan.plan(config, [64], scale_plan.measure_rates(config, check=False))


def test_meta_model_counts_equal_the_analytic_ones(scale_plan):
    for name in ("k3-debug", "k3"):
        check = scale_plan.model_check(k3_preset(name))  # asserts every kind and layer kind
        assert check["meta"]["total"] == check["analytic"]["total"]
    assert check["meta"]["total"] == 2_779_484_393_568  # ~2.8T
    assert check["analytic"]["active_non_embedding"] == 104_189_530_208  # ~104B
    assert check["per_layer"] == {"kda": 443_740_384, "mla": 232_196_096,
                                  "moe_always": 189_926_912, "per_expert": 33_030_144}  # fmt: skip


def test_plan_for_64_devices_adds_up(scale_plan, debug_plan):
    config, result = debug_plan
    (row,) = result["devices"]
    mesh, split = row["mesh"], result["split"]
    assert mesh["dp"] * mesh["cp"] == 64 and mesh["ep"] * mesh["edp"] == 64
    assert config.num_experts % mesh["ep"] == 0
    for name in scale_plan.SCHEMES:
        memory = row["memory"][name]
        parts = sum(memory[k] for k in ("param", "grad", "moments", "gathered_weights"))
        assert memory["total"] == pytest.approx(parts + memory["activations"])
        assert 0 < memory["gathered_weights"] < 2 * split["total"] and memory["fits"]
    acts = row["activations"]
    assert acts["tokens_per_rank"] * mesh["cp"] == scale_plan.EPISODE_TOKENS
    assert acts["total"] == pytest.approx(acts["layer_inputs"] + acts["carry"] + acts["working"])
    com = row["communication"]
    assert all(value >= 0 for value in com.values())
    assert com["total"] == pytest.approx(com["seconds_at_ib"] * scale_plan.IB_BYTES_PER_S)
    assert split["experts"] + split["dense"] == split["total"]
    assert result["push"]["bytes"] == 2 * split["total"] + split["buffers"]


def test_rollout_cache_of_a_1m_token_episode_is_the_docs_figure():
    cache = footprint.decode_cache(k3_preset("k3"), 1 << 20)
    assert cache["total"] == cache["row_bytes"] == cache["meta_total"] == 29_441_449_984
    assert cache["kda_per_sequence"] == 449_372_160 and cache["mla_per_token"] == 27_648
    assert round(cache["total"] / 2**20, 2) == 28_077.55  # docs/benchmarks.md: 27.4 GiB


def test_extrapolation_is_exact_on_its_own_form():
    """a + b/s per token and d/s + e/s^2 per call, through two scales, read anywhere."""

    def probe(s):
        return {"scale": s, "raw": {"x": 0}, "per_token": {"x": 7 + 320 / s},
                "per_call": {"x": 5 / s + 64 / s**2}, "past_key": 3 + 96 / s}  # fmt: skip

    got = footprint.extrapolate(probe(32), probe(16), 4, tokens=10)
    assert got["per_token"]["x"] == pytest.approx(7 + 80)
    assert got["per_call"]["x"] == pytest.approx(5 / 4 + 4) and got["past_key"] == pytest.approx(27)
    assert got["raw"]["x"] == pytest.approx(870 + 5 / 4 + 4)


@pytest.mark.slow
def test_learner_memory_model_matches_measured_peak_bytes():
    """k3-debug, fp32, segments of 128, balanced routing replay, the head on the last 32
    positions, the hidden states kept as the learner keeps them (PPO's values): the peak live
    bytes of forward + backward grow with T by what learner_carry + learner_keys say."""
    config = k3_preset("k3-debug")
    torch.manual_seed(0)
    trunk = TokenLogprobs(K3ForCausalLM(config), segment_tokens=128)
    moe_layers, top_k = config.mlp_types.count("sparse"), config.num_experts_per_token
    peaks = []
    for length in (1152, 2176):
        ids_BT = torch.randint(1, config.vocab_size, (1, length))
        slots_TK = torch.arange(length * top_k).reshape(length, top_k) % config.num_experts
        replay_MTK = slots_TK.expand(moe_layers, -1, -1).contiguous()
        select_BT = torch.zeros(1, length - 1, dtype=torch.bool)
        select_BT[:, -32:] = True
        with PeakBytes() as meter:
            logp_BT, _, hidden_BTD, _ = trunk(
                ids_BT, torch.ones_like(ids_BT), 1.0, select_BT, replay_MTK, True
            )
            (-logp_BT.sum()).backward()
        assert hidden_BTD.shape == (1, length, config.hidden_size)
        trunk.zero_grad(set_to_none=True)
        peaks.append(meter.peak)
    measured = (peaks[1] - peaks[0]) / 1024
    rates = footprint.segment_rates(config, torch.float32)
    carry = footprint.learner_carry(config, 128, torch.float32, replay=True)
    keys = footprint.learner_keys(config, rates, dtype=torch.float32)
    modelled = carry["total"] + keys["total"]
    assert modelled == pytest.approx(measured, rel=0.05), (modelled, measured)


def test_cli_writes_the_plan(scale_plan, tmp_path, capsys):
    out = tmp_path / "plan.json"
    scale_plan.main(["--preset", "k3-debug", "--devices", "64", "--out", str(out), "--no-check"])
    saved = json.loads(out.read_text())
    assert saved["devices"][0]["mesh"]["devices"] == 64
    check = saved["model_check"]
    assert all(check["meta"][kind] == check["analytic"][kind] for kind in check["meta"])
    printed = capsys.readouterr().out
    assert "### Per device memory, GB" in printed and "| 64 |" in printed
