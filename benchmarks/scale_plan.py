"""The plan on paper for full K3 on 1M-token episodes on N H200s (issue 20, item 4; docs/scale.md).

Run: .venv/bin/python benchmarks/scale_plan.py [--preset k3] [--devices 64 256 1024]
     [--out runs/scale-plan/plan.json] [--no-check]

Prints markdown tables and writes them as JSON: the parameter counts of the model built on the
meta device against the analytic ones; per device the bytes of weights, gradients and optimizer
shards, the activations of the learner (as built: whole-decoder segment checkpoints on one rank;
as designed: context parallel, layer checkpoints inside segments, MLA attending in its latent
space), the transient gathered weights; communication per step (FSDP, EP all-to-all, CP);
the weight push; the rollout cache of one 1M-token episode. Activation rates are measured by
policy/k3/footprint.py (saved-tensor hooks on width-scaled probes, checked at a third width);
everything else is arithmetic on the config and the constants below. The context parallelism
planned here shards the state over every rank; the learner's trainer.context_parallel
(policy/k3/context.py: ranks at the same time, layer by layer) replicates it over the context
ranks: its rows are the design's volumes, not measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.k3 import footprint
from policy.k3.configuration import (
    K3Config,
    count_parameters,
    k3_preset,
    kda_layer_params,
    mla_layer_params,
    moe_layer_params,
)

# --- hardware (each: value, source) ---------------------------------------------------------
HBM_BYTES = 141e9  # NVIDIA H200 SXM datasheet: 141 GB HBM3e per GPU
HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet: 4.8 TB/s (not used by a volume; for reference)
NVLINK_BYTES_PER_S = 900e9  # NVIDIA H200 datasheet: 900 GB/s NVLink per GPU (both directions)
IB_BYTES_PER_S = 400e9 / 8  # assumed: one 400 Gb/s NDR InfiniBand NIC per GPU, 50 GB/s each way
GPUS_PER_NODE = 8  # assumed: HGX H200 nodes of 8 GPUs on one NVLink switch
USABLE_FRACTION = 0.9  # assumed: the rest goes to the CUDA context, NCCL buffers, fragmentation
# --- the workload ---------------------------------------------------------------------------
EPISODE_TOKENS = 1 << 20  # "1M-token episodes": 1,048,576 tokens, as docs/benchmarks.md
SEGMENT_TOKENS = 1024  # trainer.segment_tokens as benchmarked (docs/benchmarks.md, segments)
HEAD_CHUNK = 4096  # policy/logprobs.py head_logprobs default chunk
DOCS_CACHE_MIB = 28_077.55  # docs/benchmarks.md, cache bytes, K3 bf16 (meta), 1,048,576 tokens
# --- the measured weight push (docs/benchmarks.md "Weight push", 2 CPU cores, localhost) ------
PUSH_BYTES, PUSH_SECONDS = 256 * 2**20, 0.0435  # 256 MiB, object store -> 2 workers, best
# --- optimizer state per parameter (sharded) ------------------------------------------------
SCHEMES = {
    # as built on CUDA (rl/learner/distributed.py): FSDP2 keeps fp32 parameters (the master),
    # computes in bf16 (MixedPrecisionPolicy param_dtype), reduces fp32 gradients; AdamW's two
    # moments follow the parameters' dtype: fp32.
    "fp32 master, fp32 AdamW": {"param": 4, "grad": 4, "moments": 8},
    "fp32 master, bf16 AdamW moments": {"param": 4, "grad": 4, "moments": 4},  # not built
    # not built: no master copy (bf16 updates need care, e.g. stochastic rounding)
    "bf16 weights, grads and AdamW, no master": {"param": 2, "grad": 2, "moments": 4},
}
BF16_FLOP_PER_S = 989e12  # NVIDIA H200 datasheet: dense bf16 tensor-core peak (for scale only)
BF16 = 2
GB = 1e9


def mesh_for(devices: int, config: K3Config, cp: int) -> dict[str, int]:
    """data x context parallel (cp ranks share one episode, devices / cp episodes at once);
    expert parallel over the largest P dividing both the devices and the experts (each rank
    keeps E / P experts, FSDP-sharded over the devices / P ranks that keep the same ones)."""
    ep = math.gcd(devices, config.num_experts)
    return {"devices": devices, "dp": devices // cp, "cp": cp, "ep": ep, "edp": devices // ep,
            "nodes": math.ceil(devices / GPUS_PER_NODE)}  # fmt: skip


def fsdp_units(config: K3Config, mesh: dict[str, int]) -> dict[str, int]:
    """Parameters gathered at once, per FSDP unit (policy/parallel.py: one unit per decoder
    layer, one root: embedding, head, final norm, output AttnRes; with EP a layer's routed
    experts are their own unit over "edp", E / P of them per rank)."""
    counts = count_parameters(config)
    moe_always, per_expert = moe_layer_params(config)
    layer_dense = {"kda": kda_layer_params(config), "mla": mla_layer_params(config)}
    root = counts["embedding"] + counts["lm_head"] + 3 * config.hidden_size
    largest = 0
    for i in range(config.num_hidden_layers):
        mixer = "kda" if config.layer_types[i] == "linear_attention" else "mla"
        mlp = 3 * config.hidden_size * config.intermediate_size
        if config.mlp_types[i] == "sparse":
            mlp = moe_always + config.num_experts // mesh["ep"] * per_expert
        largest = max(largest, layer_dense[mixer] + mlp + 8 * config.hidden_size)
    return {"root": root, "largest_layer": largest}


def state_bytes(split: dict[str, int], devices: int, scheme: dict[str, int]) -> dict[str, float]:
    """Sharded training state per device: every parameter lives on exactly one rank's shard
    (dense: FSDP over all devices; experts: E / P per EP rank, FSDP over edp)."""
    per = split["total"] / devices
    return {key: per * width for key, width in scheme.items()}


def activations_as_built(config, rates, tokens: int, segment: int) -> dict[str, float]:
    """The segmented learner as built on one rank: it holds the whole episode (context ranks,
    trainer.context_parallel, split it), a segment is one checkpoint of all layers,
    and each segment's recomputation attends over every earlier latent (absorbed MLA). Peak at
    the backward of the last segment (what tests/test_scale_plan.py measures on k3-debug)."""
    per_token = footprint.learner_carry(config, segment)
    per_key = footprint.learner_keys(config, rates)
    out = {
        "carry": tokens * per_token["total"],
        "earlier_keys": tokens * per_key["total"],
        "segment": segment * rates["per_token"] + rates["per_call"],
    }
    out["total"] = sum(out.values())
    return out


def activations_design(config, rates, mesh, segment: int, head_chunk: int) -> dict[str, float]:
    """As designed (not built): cp ranks share the episode (t = T / cp tokens each) and run it
    layer by layer (every layer over all t tokens, in segments, before the next layer); each
    layer is a checkpoint (its input is saved); MLA attends in its latent space (absorbed) over
    the keys of the whole episode, gathered for the one layer being run; KDA hands its state to
    the next rank. Peak: every layer's input + the final hidden state + one layer's
    recomputation over a segment + that layer's gathered keys, or the LM head's chunk."""
    tokens = EPISODE_TOKENS // mesh["cp"]
    sources = max(footprint.attn_res_sites(config), default=0)
    inputs = (config.num_hidden_layers + sources) * config.hidden_size * BF16
    carry = footprint.learner_carry(config, segment)
    own = carry["hidden"] + carry["routes"] + carry["ids"]
    widest = max(rates["kind_per_token"][footprint.layer_kind(config, i)]
                 for i in range(config.num_hidden_layers))  # fmt: skip
    site = max(rates["attn_res_per_site"].values(), default=0.0)
    keys = footprint.learner_keys(config, rates, design=True)
    cache = footprint.decode_cache(config, 0)
    layer = (
        segment * (widest + 2 * site)
        + EPISODE_TOKENS * keys["one_layer"]
        + math.ceil(tokens / segment) * cache["kda_per_sequence"] / max(1, cache["kda_layers"])
    )
    head = head_chunk * rates["head_row_bytes"]
    out = {"layer_inputs": tokens * inputs, "carry": tokens * own, "working": max(layer, head)}
    out["total"] = sum(out.values())
    out["tokens_per_rank"] = tokens
    return out


def device_memory(config, split, rates, mesh, scheme: dict[str, int]) -> dict[str, float]:
    """Per device: the sharded state, the gathered bf16 weights (the root unit and two layer
    units: the one computing and the one prefetched), the designed activations."""
    units = fsdp_units(config, mesh)
    out = state_bytes(split, mesh["devices"], scheme)
    out["gathered_weights"] = BF16 * (units["root"] + 2 * units["largest_layer"])
    acts = activations_design(config, rates, mesh, SEGMENT_TOKENS, HEAD_CHUNK)
    out["activations"] = acts["total"]
    out["total"] = sum(out.values())
    out["fits"] = out["total"] <= USABLE_FRACTION * HBM_BYTES
    return out


def choose_mesh(config, split, rates, devices: int) -> tuple[dict[str, int], str | None]:
    """The smallest power-of-two context-parallel size whose memory fits under the first
    optimizer scheme (in SCHEMES order: as built first) that fits at all: fewer CP ranks, fewer
    KDA hand-offs in series. When none fits: the size with the least memory, and None."""
    sizes = [2**i for i in range(int(math.log2(devices)) + 1)]
    for name, scheme in SCHEMES.items():
        for cp in sizes:
            mesh = mesh_for(devices, config, cp)
            if device_memory(config, split, rates, mesh, scheme)["fits"]:
                return mesh, name
    leanest = min(SCHEMES.values(), key=lambda scheme: sum(scheme.values()))
    totals = {
        cp: device_memory(config, split, rates, mesh_for(devices, config, cp), leanest)["total"]
        for cp in sizes
    }
    return mesh_for(devices, config, min(totals, key=totals.get)), None


def smallest_fleet(config, split, rates, scheme: dict[str, int], limit: int = 16384) -> int:
    """The fewest devices (a power of two, at least one node) on which some CP size fits."""
    devices = GPUS_PER_NODE
    while devices <= limit:
        for cp in (2**i for i in range(int(math.log2(devices)) + 1)):
            mesh = mesh_for(devices, config, cp)
            if device_memory(config, split, rates, mesh, scheme)["fits"]:
                return devices
        devices *= 2
    return 0


def communication(config, split, mesh) -> dict[str, float]:
    """Bytes each device sends (= receives) per step, a step being one episode per CP group.
    FSDP: all-gather of bf16 weights in the forward and again in the backward (whose layer
    checkpoint recomputes under the same gather), reduce-scatter of fp32 gradients; each moves
    (n - 1) / n of a unit per rank. EP: the latent rows of every token's top-k experts to their
    owners and back (dispatch + combine), in the forward, the recomputation and the backward.
    CP (design): per MLA layer an all-gather of the episode's latents (forward, recomputation)
    and a reduce-scatter of their fp32 gradients; per KDA layer the state + conv tails handed
    to the next rank in the forward, the recomputation and (as a gradient) the backward."""
    devices, ep, edp, cp = mesh["devices"], mesh["ep"], mesh["edp"], mesh["cp"]
    moe_layers = config.mlp_types.count("sparse")
    local_experts = split["experts"] / ep  # this EP rank's experts, before FSDP over edp
    dense_share, expert_share = (devices - 1) / devices, (edp - 1) / edp
    tokens = EPISODE_TOKENS // cp
    cache = footprint.decode_cache(config, 0)
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    out = {
        "fsdp_all_gather": 2 * BF16 * (split["dense"] * dense_share + local_experts * expert_share),
        "fsdp_reduce_scatter": 4 * (split["dense"] * dense_share + local_experts * expert_share),
        "ep_all_to_all": tokens * moe_layers * 3 * 2 * config.num_experts_per_token
        * (config.routed_expert_hidden_size or config.hidden_size) * BF16 * (ep - 1) / ep,
        "cp_latents": cache["mla_layers"] * EPISODE_TOKENS * latent * (2 * BF16 + 4)
        * (cp - 1) / cp,
        "cp_kda_handoff": 3 * cache["kda_per_sequence"] * (cp > 1),
    }  # fmt: skip
    out["total"] = sum(out.values())
    out["seconds_at_ib"] = out["total"] / IB_BYTES_PER_S
    width = config.routed_expert_hidden_size or config.hidden_size
    out["ep_per_token_per_layer"] = 3 * 2 * config.num_experts_per_token * width * BF16
    return out


def compute(config: K3Config, split: dict[str, int], mesh: dict[str, int]) -> dict[str, float]:
    """For scale only: seconds per step per device at BF16_FLOP_PER_S (100% of peak) of the
    matmuls (2 FLOP per active parameter per token, in the forward, the recomputation and twice
    in the backward) and of MLA's attention over the causal half of the episode's T^2 pairs,
    shared evenly by the CP ranks: per pair and head 2 (Dn + E + Dv) FLOP in the per-head form
    (mla.py naive, keys expanded block by block), 2 (L + R) in the latent (absorbed) form."""
    tokens, heads = EPISODE_TOKENS // mesh["cp"], config.num_attention_heads
    pairs = EPISODE_TOKENS**2 / 2 / mesh["cp"] * config.layer_types.count("full_attention")
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    latent = 2 * config.kv_lora_rank + config.qk_rope_head_dim
    flops = {
        "matmuls": 4 * 2 * split["active_non_embedding"] * tokens,
        "attention_per_head_form": 4 * 2 * heads * per_head * pairs,
        "attention_latent_form": 4 * 2 * heads * latent * pairs,
    }
    return {f"{k}_seconds": v / BF16_FLOP_PER_S for k, v in flops.items()}


def weight_push(config: K3Config, split: dict[str, int], replica_gpus: int) -> dict[str, float]:
    """A bf16 copy of every parameter (+ the fp32 expert-bias buffers), and its time at the
    measured rate (one stream, CPU, localhost), one IB link, and a rollout replica's links.
    `export_gather`: as built, the learner's export (policy/parallel.py iter_full_tensors)
    gathers each state-dict tensor whole, in the master's fp32, on every rank; the largest is
    one layer's fused expert gate/up weight [E, 2F, L]."""
    size = BF16 * split["total"] + split["buffers"]
    measured = PUSH_BYTES / PUSH_SECONDS
    width = config.routed_expert_hidden_size or config.hidden_size
    largest = max(config.num_experts * 2 * config.moe_intermediate_size * width,
                  config.vocab_size * config.hidden_size)  # fmt: skip
    return {
        "bytes": size,
        "export_gather": 4 * largest,
        "measured_bytes_per_s": measured,
        "seconds_at_measured": size / measured,
        "seconds_at_one_ib_link": size / IB_BYTES_PER_S,
        "replica_gpus": replica_gpus,
        "seconds_at_replica_links": size / (replica_gpus * IB_BYTES_PER_S),
    }


def rollout(config: K3Config, split: dict[str, int]) -> dict[str, float]:
    """One 1M-token episode's decode cache (analytic, K3Cache.row_bytes, the K3Cache built on
    the meta device: all equal, and equal to docs/benchmarks.md's figure to 0.01 MiB), and the
    GPUs a bf16 rollout replica needs for its weights and one such episode."""
    cache = footprint.decode_cache(config, EPISODE_TOKENS)
    assert cache["total"] == cache["row_bytes"] == cache["meta_total"], cache
    weights = BF16 * split["total"]
    gpus = math.ceil((weights + cache["total"]) / (USABLE_FRACTION * HBM_BYTES))
    gpus = GPUS_PER_NODE * math.ceil(gpus / GPUS_PER_NODE)  # whole nodes
    room = gpus * USABLE_FRACTION * HBM_BYTES - weights
    return {**cache, "gib": cache["total"] / 2**30, "mib": cache["total"] / 2**20,
            "replica_gpus": gpus, "episodes_per_replica": int(room // cache["total"])}  # fmt: skip


def model_check(config: K3Config) -> dict[str, dict[str, int]]:
    """Parameter counts of the model built on the meta device against the analytic ones, by
    kind and per layer kind; raises if any differs."""
    meta, analytic = footprint.parameters_by_kind(config), count_parameters(config)
    for kind in (*footprint.PARAM_KINDS, "total"):
        assert meta[kind] == analytic[kind], (kind, meta[kind], analytic[kind])
    kinds = config.layer_types
    per_layer = {
        "kda": (kinds.count("linear_attention"), kda_layer_params(config)),
        "mla": (kinds.count("full_attention"), mla_layer_params(config)),
    }
    for kind, (layers, each) in per_layer.items():
        assert meta[kind] == layers * each, (kind, meta[kind], layers, each)
    moe_always, per_expert = moe_layer_params(config)
    sparse = config.mlp_types.count("sparse")
    assert meta["moe_routed_experts"] == sparse * config.num_experts * per_expert
    assert meta["moe_shared_router_latent"] == sparse * moe_always
    return {"meta": meta, "analytic": {k: analytic[k] for k in meta} | {
        "active": analytic["active"], "active_non_embedding": analytic["active_non_embedding"]},
        "per_layer": {"kda": per_layer["kda"][1], "mla": per_layer["mla"][1],
                      "moe_always": moe_always, "per_expert": per_expert}}  # fmt: skip


def plan(config: K3Config, devices_list, rates: dict) -> dict:
    """Every number of the plan, for each device count."""
    split = footprint.expert_split(config)
    roll = rollout(config, split)
    rows = []
    for devices in devices_list:
        mesh, fitting = choose_mesh(config, split, rates, devices)
        memory = {name: device_memory(config, split, rates, mesh, s) for name, s in SCHEMES.items()}
        acts = activations_design(config, rates, mesh, SEGMENT_TOKENS, HEAD_CHUNK)
        rows.append({"mesh": mesh, "fitting_scheme": fitting, "memory": memory, "activations": acts,
                     "fsdp_units": fsdp_units(config, mesh),
                     "communication": communication(config, split, mesh),
                     "compute": compute(config, split, mesh)})  # fmt: skip
    return {
        "split": split,
        "layers": config.num_hidden_layers,
        "rates": rates,
        "carry_per_token": footprint.learner_carry(config, SEGMENT_TOKENS),
        "keys_as_built": footprint.learner_keys(config, rates),
        "keys_design": footprint.learner_keys(config, rates, design=True),
        "as_built": activations_as_built(config, rates, EPISODE_TOKENS, SEGMENT_TOKENS),
        "devices": rows,
        "smallest_fleet": {
            n: smallest_fleet(config, split, rates, sch) for n, sch in SCHEMES.items()
        },
        "push": weight_push(config, split, roll["replica_gpus"]),
        "rollout": roll,
    }


def measure_rates(config: K3Config, check: bool) -> dict:
    """The measured activation rates (policy/k3/footprint.py) and the LM head's bytes per row."""
    rates = footprint.segment_rates(config, check=8 if check else None)
    rates["head_row_bytes"] = footprint.head_row_bytes(config)
    return rates


# --------------------------------------------------------------------------- tables


def gb(n: float) -> str:
    return f"{n / GB:,.1f}"


def table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def model_table(check: dict) -> str:
    meta, analytic = check["meta"], check["analytic"]
    rows = [[k, f"{meta[k]:,}", f"{analytic[k]:,}", "yes" if meta[k] == analytic[k] else "NO"]
            for k in (*footprint.PARAM_KINDS, "total")]  # fmt: skip
    rows.append(["active (top-k experts, embedding included)", "", f"{analytic['active']:,}", ""])
    rows.append(["active without the input embedding", "",
                 f"{analytic['active_non_embedding']:,}", ""])  # fmt: skip
    return table(["parameters", "meta-device model", "analytic", "equal"], rows)


def rates_table(result: dict) -> str:
    rates, carry = result["rates"], result["carry_per_token"]
    built, design = result["keys_as_built"], result["keys_design"]
    mib = lambda n: f"{n / 2**20:,.3f}"  # noqa: E731
    rows = [[f"segment token, layer kind {k}", mib(v)] for k, v in rates["kind_per_token"].items()]
    rows += [
        [f"segment token, all {result['layers']} layers", mib(rates["layers_per_token"])],
        ["segment token, AttnRes (all sites)", mib(rates["attn_res_per_token"])],
        ["segment token, whole decoder (a segment as built)", mib(rates["per_token"])],
        ["segment call, fixed (router fp32 weight copies; fit)", mib(rates["per_call"])],
    ]
    rows += [[f"episode token, carried: {k}", mib(v)] for k, v in carry.items()]
    rows += [
        ["earlier key, as built: what all MLA layers save", mib(built["all_layers"])],
        ["earlier key, as built: one layer's fp32 latent grads", mib(built["one_layer"])],
        ["earlier key, design: one layer's latent + fp32 grads", mib(design["one_layer"])],
        ["LM head, per selected row (one chunk at a time)", mib(rates["head_row_bytes"])],
    ]
    for kind, error in rates["check_relative_error"].items():
        rows.append([f"check at width / {rates['check_scale']}: {kind}", f"{error:+.2%}"])
    return table(["bytes per", "MiB"], rows)  # fmt: skip


def memory_table(result: dict) -> str:
    rows = []
    for row in result["devices"]:
        mesh = row["mesh"]
        for name, mem in row["memory"].items():
            rows.append([mesh["devices"], f"{mesh['dp']} x {mesh['cp']}",
                         f"{mesh['ep']} x {mesh['edp']}", name, gb(mem["param"]), gb(mem["grad"]),
                         gb(mem["moments"]), gb(mem["gathered_weights"]), gb(mem["activations"]),
                         gb(mem["total"]), "yes" if mem["fits"] else "**no**"])  # fmt: skip
    head = [
        "N",
        "data x context",
        "expert x expert-FSDP",
        "optimizer",
        "param shard",
        "grad shard",
        "AdamW shard",
        "gathered bf16",
        "activations",
        "total",
        "fits",
    ]
    return table(head, rows)


def activations_table(result: dict) -> str:
    built = result["as_built"]
    rows = [["as built, 1 rank", f"{EPISODE_TOKENS:,}", gb(built["carry"]),
             gb(built["earlier_keys"]), gb(built["segment"]), gb(built["total"])]]  # fmt: skip
    for row in result["devices"]:
        acts = row["activations"]
        rows.append([f"design, N={row['mesh']['devices']}, cp={row['mesh']['cp']}",
                     f"{acts['tokens_per_rank']:,}", gb(acts["carry"] + acts["layer_inputs"]),
                     "(in working)", gb(acts["working"]), gb(acts["total"])])  # fmt: skip
    head = ["learner", "tokens per rank", "carried for the episode", "earlier MLA keys",
            "segment / working set", "total GB"]  # fmt: skip
    return table(head, rows)


def communication_table(result: dict) -> str:
    rows = []
    for row in result["devices"]:
        com = row["communication"]
        flops = row["compute"]
        rows.append([row["mesh"]["devices"], row["mesh"]["dp"], gb(com["fsdp_all_gather"]),
                     gb(com["fsdp_reduce_scatter"]), gb(com["ep_all_to_all"]),
                     gb(com["cp_latents"]), gb(com["cp_kda_handoff"]), gb(com["total"]),
                     f"{com['seconds_at_ib']:,.1f}", f"{flops['matmuls_seconds']:,.0f}",
                     f"{flops['attention_per_head_form_seconds']:,.0f} / "
                     f"{flops['attention_latent_form_seconds']:,.0f}"])  # fmt: skip
    head = ["N", "episodes per step", "FSDP all-gather", "FSDP reduce-scatter", "EP all-to-all",
            "CP latents", "CP KDA hand-off", "total GB", "s at 50 GB/s", "matmul s",
            "MLA attention s (per-head / latent form)"]  # fmt: skip
    return table(head, rows)


def push_rollout_table(result: dict) -> str:
    push, roll = result["push"], result["rollout"]
    rows = [
        ["weight push: bf16 copy of all weights", f"{push['bytes'] / GB:,.1f} GB"],
        [f"at the measured {push['measured_bytes_per_s'] / GB:.2f} GB/s (CPU, localhost)",
         f"{push['seconds_at_measured']:,.0f} s"],
        ["at one 400 Gb/s link (assumed)", f"{push['seconds_at_one_ib_link']:,.0f} s"],
        [f"at {push['replica_gpus']} links, a shard to each GPU of one rollout replica",
         f"{push['seconds_at_replica_links']:,.1f} s"],
        ["as built, the export's largest whole fp32 tensor, on every rank",
         f"{push['export_gather'] / GB:,.1f} GB"],
        ["rollout cache, one 1M-token episode", f"{roll['total']:,} B = {roll['gib']:,.2f} GiB"],
        [f"  KDA state + conv ({roll['kda_layers']} layers), per episode",
         f"{roll['kda_per_sequence']:,} B"],
        [f"  MLA latent ({roll['mla_layers']} layers), per token", f"{roll['mla_per_token']:,} B"],
        ["bf16 rollout replica: GPUs for weights + one episode", f"{roll['replica_gpus']}"],
        ["  1M-token episodes that fit beside the weights", f"{roll['episodes_per_replica']}"],
    ]  # fmt: skip
    ep = result["devices"][0]["communication"]["ep_per_token_per_layer"]
    rows.append(["EP all-to-all per token per MoE layer (K x L x 2 B, 2 ways, 3 passes)",
                 f"{ep:,.0f} B"])  # fmt: skip
    rows += [
        [f"fewest devices that fit: {name}", n or "none"]
        for name, n in result["smallest_fleet"].items()
    ]
    return table(["", "value"], rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="k3")
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--out", type=Path, default=Path("runs/scale-plan/plan.json"))
    parser.add_argument("--no-check", action="store_true", help="skip the third-width probe")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = k3_preset(args.preset)
    check = model_check(config)
    result = plan(config, args.devices, measure_rates(config, not args.no_check))
    result["model_check"] = check
    assert abs(result["rollout"]["mib"] - DOCS_CACHE_MIB) < 0.01 or args.preset != "k3"
    for title, text in (("Parameters: meta-device model vs analytic", model_table(check)),
                        ("Learner bytes (measured rates, bf16)", rates_table(result)),
                        ("Per device memory, GB", memory_table(result)),
                        ("Learner activations per device, GB", activations_table(result)),
                        ("Communication per step per device, GB", communication_table(result)),
                        ("Weight push and rollout cache", push_rollout_table(result))):  # fmt: skip
        print(f"### {title}\n\n{text}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
