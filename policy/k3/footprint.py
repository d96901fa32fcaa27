"""Bytes of the K3 policy at scale, from its config alone or from probes (docs/scale.md).

- `parameters_by_kind`: the parameters of the model built on the meta device (no memory),
  summed by kind (embedding, KDA, MLA, routed experts, ...), to check the analytic counts of
  configuration.py; `expert_split`: routed-expert vs dense parameters (EP vs FSDP).
- `decode_cache`: one sequence's K3Cache (KDA state + conv window per KDA layer, MLA latent per
  token per MLA layer, key mask), analytic and as built on the meta device.
- `segment_rates`: what the segmented learner (policy/k3/segments.py) saves for its backward,
  per token, measured with saved-tensor hooks (`SavedBytes`): one probe model with one decoder
  layer of each kind the config has (KDA + dense MLP, KDA + MoE, MLA + MoE; plain residual), run
  forward over 64 and 128 tokens (slope = bytes per token, intercept = bytes per call, mostly the
  router's fp32 copy of its weight); MLA's bytes per earlier key (a segment's recomputation
  attends over the earlier latent chunks in place: mla.py `ChunkedLatents`, absorbed after a
  cache, `choose_form`); AttnRes's bytes per site at the config's own hidden size for each
  number of sources.
  A config too large to build (full K3) is probed at widths divided by s (hidden, heads, LoRA
  ranks, experts, expert and dense widths; head dims, top-k and chunk sizes unchanged): bytes
  per token are then a + b/s and per call d/s + e/s^2, fitted at two scales, checked against a
  probe at a third, and read at s = 1.
- `learner_carry`, `learner_keys`, `head_row_bytes`: the per-token terms of the learner's memory
  (checked against the peak live bytes of forward + backward: tests/test_scale_plan.py);
  `PeakBytes`, the peak live tensor bytes of a block of code (benchmarks/learner_bytes.py).

Letters: D hidden size, L MLA latent width (kv_lora_rank + qk_rope_head_dim), H heads.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from policy.k3.attn_res import attn_res
from policy.k3.cache import K3Cache
from policy.k3.configuration import K3Config, count_parameters
from policy.k3.mla import ChunkedLatents
from policy.k3.modeling import K3ForCausalLM

PARAM_KINDS = ("embedding", "lm_head", "norms", "attn_res", "kda", "mla", "dense_mlp",
               "moe_shared_router_latent", "moe_routed_experts")  # fmt: skip
LAYER_KINDS = ("kda_dense", "kda_moe", "mla_moe", "mla_dense")
_WIDTHS = ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "num_experts",
           "moe_intermediate_size", "routed_expert_hidden_size", "intermediate_size")  # fmt: skip


def _param_kind(name: str, config: K3Config) -> str:
    """The count_parameters key a parameter name of K3ForCausalLM belongs to."""
    if name.startswith("lm_head."):
        return "lm_head"
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if "_res." in name:
        return "attn_res"
    if name == "model.norm.weight":
        return "norms"
    layer = int(name.split(".")[2])
    if ".self_attn." in name:
        return "kda" if config.layer_types[layer] == "linear_attention" else "mla"
    if "layernorm." in name:
        return "norms"
    if config.mlp_types[layer] == "dense":
        return "dense_mlp"
    return "moe_routed_experts" if ".mlp.experts." in name else "moe_shared_router_latent"


def parameters_by_kind(config: K3Config) -> dict[str, int]:
    """Parameters of K3ForCausalLM(config) built on the meta device, by PARAM_KINDS, + total."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    counts = dict.fromkeys(PARAM_KINDS, 0)
    for name, param in model.named_parameters():
        counts[_param_kind(name, config)] += param.numel()
    counts["total"] = sum(counts.values())
    return counts


def expert_split(config: K3Config) -> dict[str, int]:
    """Analytic counts: total, active, routed experts (EP-sharded), dense (all the rest)."""
    counts = count_parameters(config)
    return {
        "total": counts["total"],
        "active": counts["active"],
        "active_non_embedding": counts["active_non_embedding"],
        "experts": counts["moe_routed_experts"],
        "dense": counts["total"] - counts["moe_routed_experts"],
        "buffers": config.mlp_types.count("sparse") * config.num_experts * 4,  # fp32 QB biases
    }


def decode_cache(config: K3Config, tokens: int, dtype=torch.bfloat16) -> dict[str, int]:
    """One sequence's decode cache: analytic parts, K3Cache.row_bytes, and the K3Cache built
    on the meta device with `tokens` slots in use (all three must agree)."""
    la = config.linear_attn_config
    heads, dim, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    item, state_item = _item(dtype), _item(torch.promote_types(dtype, torch.float32))
    kda_layers = config.layer_types.count("linear_attention")
    mla_layers = config.num_hidden_layers - kda_layers
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    out = {
        "kda_state_per_layer": heads * dim * dim * state_item,
        "kda_conv_per_layer": (width - 1) * 3 * heads * dim * item,
        "mla_latent_per_token_per_layer": latent * item,
        "key_mask_per_token": 1,
    }
    out["kda_per_sequence"] = kda_layers * (out["kda_state_per_layer"] + out["kda_conv_per_layer"])
    out["mla_per_token"] = mla_layers * out["mla_latent_per_token_per_layer"]
    out["kda_layers"], out["mla_layers"] = kda_layers, mla_layers
    out["total"] = out["kda_per_sequence"] + tokens * (out["mla_per_token"] + 1)
    out["row_bytes"] = K3Cache.row_bytes(config, tokens, dtype)
    with torch.device("meta"):
        cache = K3Cache.empty(config, 1, dtype=dtype, capacity=tokens)
    cache.length = tokens  # every slot in use
    out["meta_total"] = cache.nbytes()["total"]
    return out


def _item(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


# --------------------------------------------------------------------------- probes


def layer_kind(config: K3Config, layer: int) -> str:
    mixer = "kda" if config.layer_types[layer] == "linear_attention" else "mla"
    return f"{mixer}_{'dense' if config.mlp_types[layer] == 'dense' else 'moe'}"


def probe_config(config: K3Config, scale: int = 1) -> K3Config:
    """One decoder layer per kind `config` has (dense ones first), widths divided by `scale`,
    plain residual (AttnRes is probed on its own), a small vocabulary."""
    kinds = sorted({layer_kind(config, i) for i in range(config.num_hidden_layers)},
                   key=lambda k: (not k.endswith("dense"), k))  # fmt: skip
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "dtype"):
        fields.pop(key, None)
    for key in _WIDTHS:
        if fields[key] is not None:
            if fields[key] % scale:
                raise ValueError(f"{key}={fields[key]} does not divide by scale {scale}")
            fields[key] //= scale
    la = dict(config.linear_attn_config)
    if la["num_heads"] % scale:
        raise ValueError(f"linear_attn_config.num_heads does not divide by scale {scale}")
    la["num_heads"] //= scale
    la["kda_layers"] = [i + 1 for i, k in enumerate(kinds) if k.startswith("kda")]
    la["full_attn_layers"] = [i + 1 for i, k in enumerate(kinds) if k.startswith("mla")]
    fields.update(
        num_hidden_layers=len(kinds),
        linear_attn_config=la,
        vocab_size=256,
        first_k_dense_replace=sum(k.endswith("dense") for k in kinds),
        attn_res_block_size=None,
    )
    return K3Config(**fields)


def _probe_model(config: K3Config, dtype: torch.dtype) -> K3ForCausalLM:
    """K3ForCausalLM(config) in `dtype` with small random weights, without the slow init."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(0.0, 1.0, generator=gen)
            elif param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    for buf in model.buffers():
        buf.zero_()
    return model


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode and still alive (forward,
    recomputation and backward; parameters are not counted, their views only once)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def _release(self, key: int, _ref) -> None:
        self.now -= self.live.pop(key, 0)
        self.refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key in self.live or storage.nbytes() == 0:
                    continue
                self.live[key] = storage.nbytes()
                self.refs[key] = weakref.ref(storage, lambda ref, key=key: self._release(key, ref))
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
        return out


class SavedBytes:
    """saved_tensors_hooks that add up the distinct storages autograd saves and that are still
    alive (parameters and `skip` left out), attributed to `self.where` at the time they are
    saved. Read `by` while the forward's output (and so its graph) is still referenced: what a
    discarded branch saved is freed then, and its address may be reused."""

    def __init__(self, skip: set[int] | None = None) -> None:
        self.skip = skip or set()
        self.live: dict[int, tuple[str, int, weakref.ref]] = {}
        self.by: dict[str, int] = {}
        self.where = "other"
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.skip and key not in self.live and storage.nbytes():
            ref = weakref.ref(storage, functools.partial(self._free, key))
            self.live[key] = (self.where, storage.nbytes(), ref)
            self.by[self.where] = self.by.get(self.where, 0) + storage.nbytes()
        return tensor

    def _free(self, key: int, _ref) -> None:
        where, size, _ = self.live.pop(key)
        self.by[where] -= size

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _set_where(meter: SavedBytes, where: str, *_) -> None:
    meter.where = where


def _layer_bytes(model: K3ForCausalLM, tokens: int) -> dict[str, int]:
    """Saved bytes of one forward over [1, tokens], by layer kind (+ "other": embedding, final
    norm). MLA runs from the sequence's start, in its naive form: the first segment's; a later
    segment's absorbed form (mla.py `choose_form`) saves more per new token (full K3, bf16, one
    layer: 340,488 against 217,608 B), about 3 GB more a 1,024-token segment over the 24 MLA
    layers, which these rates leave out (0.3% of one rank's as-built 1M-token total)."""
    config = model.config
    meter = SavedBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
    handles = []
    for i, layer in enumerate(model.model.layers):
        enter = functools.partial(_set_where, meter, layer_kind(config, i))
        handles.append(layer.register_forward_pre_hook(enter))
        handles.append(layer.register_forward_hook(functools.partial(_set_where, meter, "other")))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (1, tokens), generator=gen)
    for layer in model.model.layers:
        if not layer.is_kda:
            layer.self_attn.fused_max_scores = 0  # the blockwise path, as a later segment runs
    try:
        with meter:
            out = model.model(ids)
        totals = dict(meter.by)
        del out
    finally:
        for handle in handles:
            handle.remove()
    return totals


def _past_key_bytes(model: K3ForCausalLM, past: tuple[int, int], tokens: int = 8) -> float:
    """Saved bytes per earlier key of an MLA layer's forward over `tokens` new tokens after
    `past` cached latents that need gradients, one chunk as a segment's recomputation has them
    (segments.py; read in place, not counted): the slope."""
    layer = next(layer for layer in model.model.layers if not layer.is_kda)
    dtype, width = layer.self_attn.o_proj.weight.dtype, layer.self_attn.kv_lora_rank
    width += layer.self_attn.qk_rope_head_dim
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = []
    for keys in past:
        latent = torch.randn(1, keys, width, dtype=dtype, requires_grad=True)
        skip_all = skip | {latent.untyped_storage().data_ptr()}
        x = torch.randn(1, tokens, model.config.hidden_size, dtype=dtype, requires_grad=True)
        cache = ChunkedLatents((latent,), torch.ones(1, keys, dtype=torch.bool))
        with SavedBytes(skip_all) as meter:
            out = layer.self_attn(x, cache=cache)
        sizes.append(sum(meter.by.values()))
        del out
    return (sizes[1] - sizes[0]) / (past[1] - past[0])


def attn_res_sites(config: K3Config) -> list[int]:
    """Stored sources (blocks) each AttnRes site mixes with the partial sum, in forward order:
    per layer its self_attention_res and mlp_res, then output_attn_res. 0 = identity."""
    size = config.attn_res_block_size
    if size is None:
        return []
    blocks, sites = 0, []
    for layer in range(config.num_hidden_layers):
        sites.append(blocks)
        if layer % size == 0:
            blocks += 1
        sites.append(blocks)
    return [*sites, blocks]


def attn_res_bytes(hidden: int, blocks: int, dtype=torch.bfloat16, tokens: int = 4) -> float:
    """Saved bytes per token of one AttnRes site over `blocks` stored sources (0: identity)."""
    if blocks == 0:
        return 0.0
    gen = torch.Generator().manual_seed(0)
    make = lambda: torch.randn(1, tokens, hidden, generator=gen, dtype=dtype, requires_grad=True)  # noqa: E731
    partial, sources = make(), [make() for _ in range(blocks)]
    proj = torch.zeros(1, hidden, dtype=dtype, requires_grad=True)
    norm = torch.ones(hidden, dtype=dtype, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in (partial, proj, norm, *sources)}
    with SavedBytes(skip) as meter:
        out = attn_res(partial, sources, proj, norm, 1e-6)
    saved = sum(meter.by.values()) / tokens
    del out
    return saved


def probe_rates(config: K3Config, scale: int, dtype=torch.bfloat16, tokens=(64, 128)) -> dict:
    """Measured on the probe at `scale`: bytes per token and per call of each layer kind and of
    "other", MLA bytes per earlier key, and the raw totals of the forward over tokens[-1]
    (one token count: raw totals and past keys only)."""
    model = _probe_model(probe_config(config, scale), dtype)
    runs = [_layer_bytes(model, n) for n in tokens]
    high = runs[-1]
    out = {"scale": scale, "raw": high, "tokens": tokens[-1]}
    if len(tokens) == 2:
        slope = {k: (high[k] - runs[0].get(k, 0)) / (tokens[1] - tokens[0]) for k in high}
        out["per_token"] = slope
        out["per_call"] = {k: high[k] - slope[k] * tokens[1] for k in high}
    has_mla = any(k.startswith("mla") for k in high)
    out["past_key"] = _past_key_bytes(model, (256, 512)) if has_mla else 0.0
    return out


def _fit(s1: float, y1: float, s2: float, y2: float, powers: tuple[int, int], scale: float):
    """y = c / s**p + e / s**q through (s1, y1) and (s2, y2), read at `scale` (p, q = powers)."""
    p, q = powers
    det = s1**-p * s2**-q - s2**-p * s1**-q
    c = (y1 * s2**-q - y2 * s1**-q) / det
    e = (s1**-p * y2 - s2**-p * y1) / det
    return c * scale**-p + e * scale**-q


def extrapolate(a: dict, b: dict, scale: float = 1, tokens: int | None = None) -> dict:
    """Two probes (probe_rates at two scales) read at `scale`: bytes per token a + b/s (each
    per-token tensor has one scaled width), bytes per call d/s + e/s^2 (vectors of one width,
    and the router's fp32 copy of its [E, D] weight), bytes per earlier MLA key a + b/s; with
    `tokens`, also the total per kind for one forward over that many tokens (to check a third
    probe)."""
    s1, s2 = a["scale"], b["scale"]

    def fit(key: str, kind: str | None, powers: tuple[int, int]) -> float:
        y1, y2 = (a[key], b[key]) if kind is None else (a[key][kind], b[key][kind])
        return _fit(s1, y1, s2, y2, powers, scale)

    per_token = {k: fit("per_token", k, (0, 1)) for k in a["raw"]}
    per_call = {k: fit("per_call", k, (1, 2)) for k in a["raw"]}
    out = {"scale": scale, "per_token": per_token, "per_call": per_call,
           "past_key": fit("past_key", None, (0, 1))}  # fmt: skip
    if tokens is not None:
        out["raw"] = {k: per_token[k] * tokens + per_call[k] for k in a["raw"]}
    return out


def segment_rates(config: K3Config, dtype=torch.bfloat16, scales=(32, 16), check: int | None = 8):
    """What one segment of the segmented learner saves for its backward, per token and per
    call, over the whole decoder (a segment is one checkpoint of all layers), plus MLA's bytes
    per earlier key. A config of under 2e8 parameters is probed as it is; a larger one at
    `scales` and extrapolated (module docstring), then checked against a probe at `check`."""
    if count_parameters(config)["total"] < 2e8:
        rates, checked = probe_rates(config, 1, dtype), {}
    else:
        a, b = (probe_rates(config, s, dtype) for s in scales)
        rates = extrapolate(a, b)
        checked = {}
        if check is not None:
            got = probe_rates(config, check, dtype, tokens=(64,))
            want = extrapolate(a, b, check, 64)
            checked = {k: want["raw"][k] / got["raw"][k] - 1 for k in got["raw"] if got["raw"][k]}
            if got["past_key"]:  # 0 as built: the earlier latents are read in place
                checked["past_key"] = want["past_key"] / got["past_key"] - 1
    kinds = [layer_kind(config, i) for i in range(config.num_hidden_layers)]
    sites = attn_res_sites(config)
    res = {j: attn_res_bytes(config.hidden_size, j, dtype) for j in set(sites)}
    out = {
        "kind_per_token": rates["per_token"],
        "kind_per_call": rates["per_call"],
        "attn_res_per_site": {str(j): res[j] for j in sorted(res)},
        "layers_per_token": sum(rates["per_token"][k] for k in kinds),
        "attn_res_per_token": sum(res[j] for j in sites),
        "other_per_token": rates["per_token"].get("other", 0.0),
        "per_call": sum(rates["per_call"][k] for k in kinds) + rates["per_call"].get("other", 0),
        "mla_past_per_key_per_layer": rates["past_key"],
        "mla_layers": config.layer_types.count("full_attention"),
        "check_scale": check if checked else None,
        "check_relative_error": checked,
    }
    out["per_token"] = out["layers_per_token"] + out["attn_res_per_token"] + out["other_per_token"]
    return out


def learner_carry(
    config: K3Config,
    segment: int,
    dtype=torch.bfloat16,
    *,
    replay: bool = True,
    keep_hidden: bool = True,
) -> dict[str, float]:
    """Bytes per token of the whole trajectory that the segmented learner (policy/k3/
    segments.py through policy/logprobs.py TokenLogprobs) holds while it runs the backward of
    a segment: hidden: the decoder's output [T, D] and its gradient (kept for a value head;
    keep_hidden=False: 0, the LM head runs inside each segment's checkpoint); latents: twice
    each MLA layer's latents (its chunks, and the gradients the chunks gather from later
    segments); kda_boundaries: the KDA
    state and conv tails at each segment boundary (per token: / segment); routes: the
    router's choices it returns (int64 [M, T, K]) and, with routing replay, the replayed ones;
    ids: the attention mask (int64), logprob and entropy (fp32), the key mask (bool)."""
    cache = decode_cache(config, 0, dtype)
    moe_layers = config.mlp_types.count("sparse")
    out = {
        "hidden": 2 * config.hidden_size * _item(dtype) if keep_hidden else 0,
        "latents": 2 * cache["mla_per_token"],
        "kda_boundaries": cache["kda_per_sequence"] / segment,
        "routes": (1 + replay) * moe_layers * config.num_experts_per_token * 8,
        "ids": 8 + 4 + 4 + 1,
    }
    out["total"] = sum(out.values())
    return out


def head_row_bytes(config: K3Config, dtype=torch.bfloat16) -> float:
    """Bytes the LM head's logprob and entropy (policy/logprobs.py `_chunk_stats`) save per
    selected position: a * V + b * D + c, measured at three small (D, V) and read at the
    config's. Below its checkpoint threshold the head keeps them for every selected position;
    above, for one chunk at a time, recomputed in the backward."""
    from policy.logprobs import _chunk_stats

    def measure(hidden: int, vocab: int, rows: int = 8) -> float:
        head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
        targets = torch.randint(0, vocab, (rows,))
        skip = {head.weight.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
        with SavedBytes(skip) as meter:
            out = _chunk_stats(x, targets, head, 1.0)
        saved = sum(meter.by.values()) / rows
        del out
        return saved

    base, wide, deep = measure(64, 1024), measure(64, 2048), measure(128, 1024)
    per_vocab, per_hidden = (wide - base) / 1024, (deep - base) / 64
    const = base - per_vocab * 1024 - per_hidden * 64
    return per_vocab * config.vocab_size + per_hidden * config.hidden_size + const


def learner_keys(
    config: K3Config, rates: dict, *, design: bool = False, dtype=torch.bfloat16
) -> dict[str, float]:
    """Bytes per earlier key of the MLA layers in the learner's backward. As built (mla.py
    `choose_form`: a later segment attends over the latents, absorbed): `all_layers`, what every
    MLA layer of the checkpointed segment saves per earlier key beyond the chunks it reads in
    place (measured: segment_rates; about 0), plus `one_layer`: the fp32 gradient of the
    latents that the blockwise backward of one layer allocates for every earlier chunk
    (L * 4, flash.py `_backward`; the c_kv slice's gradient is added into its first R columns).
    They are new buffers in every dtype: autograd adds them into the gradients the chunks
    already hold from the later segments, so both are alive while the layer's backward runs
    (in float32 too: k3-debug's peak live bytes grow by 992 per token at 1K-8K tokens, 96 of
    them these buffers; 1,056 with a separate c_kv gradient buffer before 2026-12-06;
    tests/test_scale_plan.py). design=True (not built: one layer checkpoint at a time, the
    latents read in place): one layer holds the latents (L values) and their fp32 gradients
    (L + R values: the design's kernel keeps a separate c_kv gradient)."""
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    grads = latent * 4
    if design:
        design_grads = (latent + config.kv_lora_rank) * 4
        out = {"all_layers": 0.0, "one_layer": latent * _item(dtype) + design_grads}
    else:
        out = {"all_layers": rates["mla_layers"] * rates["mla_past_per_key_per_layer"],
               "one_layer": grads}  # fmt: skip
    out["total"] = out["all_layers"] + out["one_layer"]
    return out
