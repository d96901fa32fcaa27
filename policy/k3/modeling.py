"""The Kimi-K3-style causal LM as a transformers model: K3Model, K3ForCausalLM.

Assembled from the layers of this package (k3-architecture.md sections 1-6):

    h_0 = embed(ids);  state = AttnResState.start(h_0)
    layer l (section 4.3):
        h = AttnRes_in(state);  close a block when l % S == 0
        state += mixer(input_layernorm(h))          KDA or gated NoPE MLA (cfg.layer_types)
        h = AttnRes_mid(state)
        state += mlp(post_attention_layernorm(h))   SiTU-GLU if l < first_k_dense_replace,
                                                    else Stable LatentMoE (cfg.mlp_types)
    out: logits = lm_head(norm(AttnRes_out(state)))

With attn_res_block_size None the residual is the plain h + f(h). No positional parameters: KDA
carries order through its decay and short conv, MLA is NoPE; position_ids are accepted and ignored.

Padding: attention_mask [B, T] (1 = real token), left or right; masked tokens do not touch the KDA
state or conv, are never attended to, and their outputs are meaningless. With a K3Cache the mask
may also be [B, S + T] (transformers convention); its last T columns are used. Padding is exact
at a sequence's start or end only: a masked token between cached and new tokens would enter the
KDA short-conv window as zeros.

Routing replay: `replay_experts` gives, per MoE layer (in layer order), the experts to use for
every token, [B*T, K] in x.reshape(-1, D) order (or [B, T, K]); the router still computes the
weights from its live scores, so it keeps its gradients. A token whose row holds -1 (no record)
is routed live. `return_routing=True` returns the selections the forward used `routed_experts`
[M, B*T, K] (the replayed ones where replayed), the router's own top-k `router_choice` (same
shape; equal to routed_experts without replay) and the dense scores `router_scores` (M x
[B*T, E]).

Letters: B batch, T new tokens, D hidden size, V vocabulary, M MoE layers, K experts per token,
E experts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedModel,
)
from transformers import initialization as init
from transformers.utils import ModelOutput

from policy.k3.attn_res import AttnRes, AttnResState, closes_block
from policy.k3.cache import K3Cache
from policy.k3.configuration import K3Config
from policy.k3.kda import GatedRMSNorm, KimiDeltaAttention
from policy.k3.mla import GatedMLA
from policy.k3.moe import GroupedExperts, StableLatentMoE
from policy.k3.routing import Routing, TopKRouter
from policy.k3.situ import SituGLU


@dataclass
class K3ModelOutput(ModelOutput):
    """last_hidden_state [B, T, D]; cache (K3Cache or None); routing fields as documented above."""

    last_hidden_state: Tensor | None = None
    cache: K3Cache | None = None
    routed_experts: Tensor | None = None
    router_choice: Tensor | None = None
    router_scores: tuple[Tensor, ...] | None = None


@dataclass
class K3CausalLMOutput(ModelOutput):
    """loss (mean next-token CE when labels are given), logits [B, T or logits_to_keep, V]."""

    loss: Tensor | None = None
    logits: Tensor | None = None
    cache: K3Cache | None = None
    routed_experts: Tensor | None = None
    router_choice: Tensor | None = None
    router_scores: tuple[Tensor, ...] | None = None


def build_mixer(config: K3Config, layer_idx: int) -> nn.Module:
    """The token mixer of layer `layer_idx`: KDA ("linear_attention") or gated MLA."""
    if config.layer_types[layer_idx] == "linear_attention":
        la = config.linear_attn_config
        return KimiDeltaAttention(
            config.hidden_size,
            num_heads=la["num_heads"],
            head_dim=la["head_dim"],
            conv_size=la["short_conv_kernel_size"],
            gate_lower_bound=la.get("gate_lower_bound", -5.0),
            full_rank_output_gate=la.get("use_full_rank_gate", True),
            norm_eps=config.rms_norm_eps,
        )
    return GatedMLA(
        config.hidden_size,
        config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        output_gate=config.mla_use_output_gate,
        norm_eps=config.mla_norm_eps,
    )


class K3DecoderLayer(nn.Module):
    """Pre-norm mixer + MLP with K3's AttnRes bookkeeping (or a plain residual)."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx, self.block_size = layer_idx, config.attn_res_block_size
        self.is_kda = config.layer_types[layer_idx] == "linear_attention"
        self.is_sparse = config.mlp_types[layer_idx] == "sparse"
        self.self_attn = build_mixer(config, layer_idx)
        if self.is_sparse:
            self.mlp = StableLatentMoE(StableLatentMoE.Config.from_k3(config))
        else:
            self.mlp = SituGLU(d, config.intermediate_size, *config.situ_betas)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        if self.block_size is not None:
            self.self_attention_res = AttnRes(d, eps)
            self.mlp_res = AttnRes(d, eps)

    def mix(self, x_BTD: Tensor, mask_BT: Tensor | None, cache: K3Cache | None) -> Tensor:
        if cache is None:
            return self.self_attn(x_BTD, mask=mask_BT)[0]
        if self.is_kda:
            out_BTD, new = self.self_attn(x_BTD, cache=cache.kda(self.layer_idx), mask=mask_BT)
            cache.set_kda(self.layer_idx, new)
            return out_BTD
        return self.self_attn(x_BTD, cache=cache.mla(self.layer_idx), mask=mask_BT)[0]

    def ffn(self, x_BTD: Tensor, replay_TK: Tensor | None) -> tuple[Tensor, Routing | None]:
        if not self.is_sparse:
            return self.mlp(x_BTD), None
        if replay_TK is not None:
            replay_TK = replay_TK.reshape(-1, replay_TK.shape[-1])
        return self.mlp(x_BTD, replay_indices_TK=replay_TK, return_routing=True)

    def mixer_input(self, state) -> Tensor:
        """What the token mixer reads, [B, T, D]: input_layernorm of AttnRes_in(state) (of the
        hidden itself for a plain residual)."""
        h_BTD = state if self.block_size is None else self.self_attention_res(state)
        return self.input_layernorm(h_BTD)

    def forward(
        self, state, *, mask_BT=None, cache=None, replay_TK=None, latent_only=False, positions=None
    ):
        """state: AttnResState (the hidden [B, T, D] for a plain residual) -> (out_BTD, routing).

        out_BTD is the next hidden, or with AttnRes the layer's new running block sum only: the
        caller carries the stored sources on (`AttnResState.after_layer`). A layer never returns
        a tensor it was given: FSDP2 hands a wrapped layer its inputs as views (its
        post-backward hook is an identity autograd Function), and returning those views would
        let a later in-place op drop the layer's pre-backward hook.

        latent_only (MLA layers): -> (the latents [B, T, L] this layer's attention would cache,
        None), nothing else computed; through the module call so that a sharded layer gathers
        its weights (context ranks send the latents before they attend, context.py).

        positions: `forward_at` (through the module call, for the same reason)."""
        if latent_only:
            return self.self_attn.latent(self.mixer_input(state)), None
        if positions is not None:
            return self.forward_at(
                state, positions, mask_BT=mask_BT, cache=cache, replay_TK=replay_TK
            )
        return self.after_mix(state, self.mix(self.mixer_input(state), mask_BT, cache), replay_TK)

    def forward_at(self, state, positions: list[int], *, mask_BT=None, cache=None, replay_TK=None):
        """`forward`'s result at `positions` only (sorted indices into T) for an MLA layer whose
        later layers mix no tokens (the last layer): every position's latent goes into
        `cache` (the keys of later queries), the attention, the MLP and the residual run at the
        U positions. -> (out [B, U, D], routing of the U positions, the input state at them),
        the caller's `next_state` taking that state."""
        assert not self.is_kda, "forward_at is for an MLA layer"
        index_U = torch.tensor(positions, dtype=torch.long, device=_hidden(state).device)
        x_BTD = self.mixer_input(state)  # every position: the latents need it
        slots = cache.mla(self.layer_idx) if cache is not None else None
        mixed_BUD, _ = self.self_attn.forward_at(x_BTD, positions, cache=slots, mask=mask_BT)
        if replay_TK is not None:  # [B*T, K] or [B, T, K] -> [B*U, K]
            replay_TK = replay_TK.reshape(x_BTD.shape[0], x_BTD.shape[1], -1)[:, index_U]
        sub = _at(state, index_U)
        gate = self.mlp.gate if self.is_sparse else None
        try:  # Quantile Balancing's statistics skip this call (policy/parallel.py RouterStats)
            if gate is not None:
                gate.routes_subset = True
            return (*self.after_mix(sub, mixed_BUD, replay_TK), sub)
        finally:
            if gate is not None:
                gate.routes_subset = False

    def after_mix(self, state, mixed_BTD: Tensor, replay_TK) -> tuple[Tensor, Routing | None]:
        """The residual, the MLP and its residual after the token mixer's output `mixed_BTD`
        -> (out_BTD, routing), as `forward` returns them."""
        if self.block_size is None:
            h_BTD = state + mixed_BTD
            out_BTD, routing = self.ffn(self.post_attention_layernorm(h_BTD), replay_TK)
            return h_BTD + out_BTD, routing
        if closes_block(self.layer_idx, self.block_size):
            state = state.close_block()
        state = state.add(mixed_BTD)
        out_BTD, routing = self.ffn(self.post_attention_layernorm(self.mlp_res(state)), replay_TK)
        return state.add(out_BTD).partial, routing

    def next_state(self, state, out_BTD: Tensor):
        """The residual state after this layer, from its input `state` and its forward's
        `out_BTD` (the caller's side of the contract above; no parameters involved)."""
        if self.block_size is None:
            return out_BTD
        return state.after_layer(out_BTD, closed=closes_block(self.layer_idx, self.block_size))


def _hidden(state) -> Tensor:
    return state if isinstance(state, Tensor) else state.partial


def _at(state, index_U: Tensor):
    """The residual state (a hidden [B, T, D] or an AttnResState) at positions index_U."""
    if isinstance(state, Tensor):
        return state[:, index_U]
    blocks = tuple(b[:, index_U] for b in state.blocks)
    partial = None if state.partial is None else state.partial[:, index_U]
    return AttnResState(blocks=blocks, partial=partial)


def _spread(routing: Routing, positions: list[int], batch: int, length: int) -> Routing:
    """A routing of the B*U tokens at `positions` laid out over all B*T tokens: expert
    indices -1 at the others (the scores stay [B*U, E])."""
    index_U = torch.tensor(positions, dtype=torch.long, device=routing.indices_TK.device)

    def spread(x_XK: Tensor | None) -> Tensor | None:
        if x_XK is None:
            return None
        out_BTK = x_XK.new_full((batch, length, x_XK.shape[-1]), -1)
        out_BTK[:, index_U] = x_XK.view(batch, len(positions), x_XK.shape[-1])
        return out_BTK.flatten(0, 1)

    return routing._replace(
        indices_TK=spread(routing.indices_TK), chosen_TK=spread(routing.chosen_TK)
    )


class K3PreTrainedModel(PreTrainedModel):
    config_class = K3Config
    config: K3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ("K3DecoderLayer",)
    _skip_keys_device_placement = ("cache",)
    # router weights and bias and the KDA decay parameters stay fp32 even in a bf16 model
    _keep_in_fp32_modules_strict = ("gate.weight", "e_score_correction_bias", "A_log", "dt_bias")
    _is_stateful = True

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        """Always run `_init_weights`: it uses transformers' flag-respecting init functions, so the
        custom-code shortcut (which skips modules without own parameters, such as AttnRes) is
        not needed and would leave AttnRes pseudo-queries at the Linear default."""
        super()._initialize_weights(module, is_custom_code=False)

    def _init_weights(self, module: nn.Module) -> None:
        """Normal(0, initializer_range) matrices, unit norms, zero AttnRes pseudo-queries, and
        the KDA gate parameters as in fla (A_log = 0 for the lower-bound gate); with
        config.mla_fan_in_init, MLA's up-projections and kv_a at std fan_in^-0.5."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Conv1d):  # KDA short convs: PyTorch's default, as fla
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif isinstance(module, (GatedRMSNorm, nn.RMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, GroupedExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, TopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, AttnRes):
            init.zeros_(module.proj.weight)  # uniform mixing at init (parent runs after children)
        elif isinstance(module, KimiDeltaAttention):
            _init_kda_gate(module)
        elif isinstance(module, GatedMLA) and self.config.mla_fan_in_init:
            q_up = module.q_b_proj if hasattr(module, "q_b_proj") else module.q_proj
            for linear in (module.kv_a_proj_with_mqa, module.kv_b_proj, q_up):
                init.normal_(linear.weight, mean=0.0, std=linear.in_features**-0.5)


def _init_kda_gate(module: KimiDeltaAttention) -> None:
    if module.gate_lower_bound is None:
        init.uniform_(module.A_log, a=1.0, b=16.0)
        init.copy_(module.A_log, module.A_log.log())
    else:
        init.zeros_(module.A_log)
    init.uniform_(module.dt_bias, a=-6.907755278982137, b=-2.302585092994046)  # log 1e-3, 1e-1
    dt = module.dt_bias.exp().clamp(min=1e-4)
    init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))


class K3Model(K3PreTrainedModel):
    """Embeddings, decoder layers and the output AttnRes + final norm (no LM head)."""

    def __init__(self, config: K3Config) -> None:
        super().__init__(config)
        if not config.mla_use_nope:
            raise ValueError("only NoPE MLA (mla_use_nope=True) is implemented")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [K3DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        if config.attn_res_block_size is not None:
            self.output_attn_res = AttnRes(config.hidden_size, config.rms_norm_eps)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: K3Cache | None = None,
        use_cache: bool | None = None,
        replay_experts: Tensor | Sequence[Tensor] | None = None,
        return_routing: bool = False,
        positions: list[int] | None = None,
        **kwargs,
    ) -> K3ModelOutput:
        """positions (sorted indices into T; the last layer an MLA layer): the hidden states
        at those positions only, [B, U, D], equal to the whole forward's there. The last
        layer attends and runs its MLP at them alone (`K3DecoderLayer.forward_at`); every
        position still passes the earlier layers and leaves its latent in `cache`. With
        return_routing, the last layer's routed_experts and router_choice are -1 at the other
        positions, and its router_scores cover the U positions only."""
        del position_ids, kwargs  # NoPE: positions play no role
        if positions is not None and self.layers[-1].is_kda:
            raise ValueError("positions needs an MLA last layer (a KDA layer mixes on)")
        length = input_ids.shape[1]
        mask_BT = None if attention_mask is None else attention_mask[:, -length:]
        if use_cache and cache is None:
            param = self.embed_tokens.weight
            cache = K3Cache.empty(
                self.config, input_ids.shape[0], dtype=param.dtype, device=param.device
            )
        if cache is not None:
            cache.begin(mask_BT, length)
        if mask_BT is not None and bool(mask_BT.all()):
            mask_BT = None  # identical result, cheaper
        hidden_BTD = self.embed_tokens(input_ids)
        state = (
            hidden_BTD
            if self.config.attn_res_block_size is None
            else AttnResState.start(hidden_BTD)
        )
        replays = iter(replay_experts) if replay_experts is not None else None
        routings = []
        for layer in self.layers:
            replay_TK = next(replays) if replays is not None and layer.is_sparse else None
            at = positions if layer is self.layers[-1] else None
            if at is not None:
                out_BTD, routing, state = layer(
                    state, mask_BT=mask_BT, cache=cache, replay_TK=replay_TK, positions=at
                )
                routing = None if routing is None else _spread(routing, at, *input_ids.shape)
            else:
                out_BTD, routing = layer(state, mask_BT=mask_BT, cache=cache, replay_TK=replay_TK)
            state = layer.next_state(state, out_BTD)
            if routing is not None:
                routings.append(routing)
        if self.config.attn_res_block_size is not None:
            state = self.output_attn_res(state)
        if cache is not None:
            cache.commit(length)
        out = K3ModelOutput(last_hidden_state=self.norm(state), cache=cache)
        if return_routing and routings:
            out.routed_experts = torch.stack([r.indices_TK for r in routings])
            out.router_choice = torch.stack([r.chosen_TK for r in routings])
            out.router_scores = tuple(r.scores_TE for r in routings)
        return out


class K3ForCausalLM(K3PreTrainedModel, GenerationMixin):
    """K3Model + an untied LM head (tied when config.tie_word_embeddings)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # noqa: RUF012

    def __init__(self, config: K3Config) -> None:
        super().__init__(config)
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_decoder(self) -> K3Model:
        return self.model

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        cache: K3Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        replay_experts: Tensor | Sequence[Tensor] | None = None,
        return_routing: bool = False,
        **kwargs,
    ) -> K3CausalLMOutput:
        """Logits of the last `logits_to_keep` positions (0 = all); loss when labels are given
        (labels are the input ids with -100 where not trained; shifted inside)."""
        out = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            replay_experts=replay_experts,
            return_routing=return_routing,
        )
        hidden_BTD = out.last_hidden_state
        if logits_to_keep:
            hidden_BTD = hidden_BTD[:, -logits_to_keep:]
        logits_BTV = self.lm_head(hidden_BTD)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits_BTV, labels, self.config.vocab_size, **kwargs)
        return K3CausalLMOutput(
            loss=loss,
            logits=logits_BTV,
            cache=out.cache,
            routed_experts=out.routed_experts,
            router_choice=out.router_choice,
            router_scores=out.router_scores,
        )

    def prepare_inputs_for_generation(
        self, input_ids: Tensor, attention_mask=None, cache: K3Cache | None = None, **kwargs
    ):
        """transformers' generate(): the whole prompt first, then one token per step over the
        K3Cache that `_update_model_kwargs_for_generation` carries between steps (rollouts use
        policy.k3.engine.K3Policy, which is faster still)."""
        if not isinstance(cache, K3Cache):
            cache = None  # generate() may seed the kwarg with its own (unused) cache object
        else:
            input_ids = input_ids[:, -1:]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "cache": cache,
            "use_cache": True,
            "logits_to_keep": 1,
        }

    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or config.num_beams or 1) > 1:
            raise ValueError(
                "K3ForCausalLM.generate supports greedy decoding and sampling, not beam search "
                "(the K3Cache is not reordered between beams); set num_beams=1"
            )
        return super().generate(*args, **kwargs)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, *args, **kwargs
        )
        model_kwargs["cache"] = outputs.cache
        return model_kwargs


def register() -> None:
    """Make "agentrl_k3" known to AutoConfig, AutoModel and AutoModelForCausalLM (idempotent)."""
    AutoConfig.register(K3Config.model_type, K3Config, exist_ok=True)
    AutoModel.register(K3Config, K3Model, exist_ok=True)
    AutoModelForCausalLM.register(K3Config, K3ForCausalLM, exist_ok=True)
