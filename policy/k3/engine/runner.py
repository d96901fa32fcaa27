"""K3Policy: the rollout engine for K3ForCausalLM (same interface as policy.hf.HFPolicy).

Letters: N prompts in a generate() call, B rows in the running batch, P padded prompt length,
V vocabulary, M MoE layers, Kx experts per token, G max_new_tokens.

    generate(prompts, params):
      waiting = all prompts (in order); running = none
      loop:  admit waiting prompts into free rows (up to max_batch): batched prefill of the new
             prompts alone, in groups of similar length (left-padded, `prefill_chunk` tokens per
             forward, logits of the last position only), their K3Cache rows appended to the
             running cache
             sample one token for every running row (policy.sampling.sample_next)
             rows that emitted a stop token or reached max_new_tokens leave (cache rows dropped,
             holes squeezed out of the MLA slots when they pile up)
             one decode step (one token per row) for the remaining rows
Finished rows are thus replaced by waiting prompts without restarting the others (continuous
batching), and no Python loop runs per row in a decode step. Both prefill and decode run the
fused forward of decode.py on weights packed once per weight version (plan.py; chunked KDA and
absorbed MLA for prefill chunks, the single-step KDA recurrence for decode). fused=False (and
models that are not float32/float64) run K3ForCausalLM.forward with the same K3Cache instead,
the reference the fused path is tested against.

Logprobs are log_softmax(logits / T) over the full vocabulary at the sampled token (the
learner's quantity, policy/logprobs.py; equal within 1e-5 in float32); greedy reports T = 1.
Only last-position logits are computed, never [T, V].

Routing record (record_routing=True): Completion.routed_experts, int16 [len(prompt) +
len(token_ids) - 1, M, Kx], row j = the experts chosen by each MoE layer at input position j of
prompt + token_ids (every position a forward ran over; the last sampled token is never fed).
Row len(prompt) - 1 + i is the routing that produced token_ids[i]'s logprob.
`replay_indices` turns it into K3ForCausalLM.forward's replay_experts for that sequence.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from policy.hf import import_verified
from policy.k3.cache import K3Cache
from policy.k3.engine.decode import forward_tokens
from policy.k3.engine.plan import DecodePlan, build_plan
from policy.k3.paged import PAGE_SIZE
from policy.sampling import Completion, SamplingParams, left_pad, sample_next


class K3Policy:
    """Batched, continuously batched, cached sampling from a K3ForCausalLM.

    max_batch: rows decoded together (more prompts wait for free rows); prefill_chunk: tokens
    per prefill forward (bounds the [B, H, chunk, S] MLA scores); record_routing: fill
    Completion.routed_experts; fused: use the fused forward (decode.py) when the model is
    float32/float64; paged: sessions keep MLA latents in pages of `page_size` tokens
    (policy/k3/paged.py; fused forward only); exact: sessions decode every episode alone, one
    token per forward, so that its logprobs equal the learner's bit for bit
    (policy/k3/engine/exact.py). Set torch's thread count outside (rollout workers: one per
    worker).
    """

    def __init__(
        self,
        model,
        *,
        pad_token_id: int = 0,
        seed: int = 0,
        max_batch: int = 64,
        prefill_chunk: int = 256,
        record_routing: bool = False,
        fused: bool = True,
        exact: bool = False,
        paged: bool = False,
        page_size: int = PAGE_SIZE,
    ) -> None:
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        self.model = model.eval()
        self.pad_token_id, self.max_batch, self.prefill_chunk = (
            pad_token_id,
            max_batch,
            prefill_chunk,
        )
        self.record_routing, self.exact = record_routing, exact
        dtype = model.get_input_embeddings().weight.dtype
        self.fused = fused and dtype in (torch.float32, torch.float64)
        self.paged, self.page_size = paged and self.fused, page_size
        self.version = 0
        self.device = model.get_input_embeddings().weight.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._plan: DecodePlan | None = None
        self._plan_key: tuple | None = None

    def reseed(self, seed: int) -> None:
        """Make the next draws a function of `seed` alone."""
        self.generator.manual_seed(seed)

    def load_weights(self, version: int, weights: dict[str, np.ndarray], expected: int) -> None:
        """Install `weights` as `version` after verifying their checksum."""
        import_verified(self.model, version, weights, expected)
        self.version = version

    def plan(self) -> DecodePlan:
        """The packed decode weights, rebuilt when any parameter changed (in place or not)."""
        key = tuple((t.data_ptr(), t._version) for t in self.model.state_dict().values())
        if self._plan is None or key != self._plan_key:
            self._plan, self._plan_key = build_plan(self.model), key
        return self._plan

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample a completion for every prompt (each a non-empty list of token ids)."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not prompts:
            return []
        return _Run(self, prompts, params).run()

    # -- forward passes -------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], plan: DecodePlan | None = None):
        """Left-padded chunked prefill -> (K3Cache, last logits [B, V], routing [B, P, M, Kx])."""
        ids_BP, mask_BP = left_pad(prompts, self.pad_token_id)
        width = ids_BP.shape[1]
        ids_BP, mask_BP = ids_BP.to(self.device), mask_BP.to(self.device)
        dtype = self.model.get_input_embeddings().weight.dtype
        cache = K3Cache.empty(
            self.model.config, len(prompts), dtype=dtype, device=self.device, capacity=width + 64
        )
        routes = []
        for start in range(0, width, self.prefill_chunk):
            chunk = slice(start, start + self.prefill_chunk)
            logits_BV, routed_BTMK = self.forward(cache, ids_BP[:, chunk], mask_BP[:, chunk], plan)
            if routed_BTMK is not None:
                routes.append(routed_BTMK)
        return cache, logits_BV, (torch.cat(routes, 1) if routes else None)

    def forward(self, cache: K3Cache, ids_BT, mask_BT=None, plan: DecodePlan | None = None):
        """T tokens per row through the model -> (last logits [B, V], routing [B, T, M, Kx])."""
        if self.fused:
            return forward_tokens(
                plan or self.plan(), cache, ids_BT, mask_BT, record=self.record_routing
            )
        out = self.model(
            ids_BT,
            attention_mask=mask_BT,
            cache=cache,
            logits_to_keep=1,
            return_routing=self.record_routing,
        )
        routed = out.routed_experts  # [M, B*T, Kx]
        if routed is not None:
            routed = routed.transpose(0, 1).unflatten(0, ids_BT.shape)
        return out.logits[:, -1], routed


class _Run:
    """The state of one generate() call: waiting prompts, the running batch, output buffers."""

    def __init__(self, policy: K3Policy, prompts: list[list[int]], params: SamplingParams):
        self.policy, self.prompts, self.params = policy, prompts, params
        self.plan = policy.plan() if policy.fused else None  # weights are fixed per call
        self.waiting = deque(range(len(prompts)))
        self.results: list[Completion | None] = [None] * len(prompts)
        budget = params.max_new_tokens
        self.tokens_NG = torch.zeros(len(prompts), budget, dtype=torch.long)
        self.logps_NG = torch.zeros(len(prompts), budget, dtype=torch.float32)
        self.stops = torch.tensor(params.stop_token_ids or [-1])
        self.cache: K3Cache | None = None
        self.rows_B = torch.zeros(0, dtype=torch.long)  # prompt index of each running row
        self.count_B = torch.zeros(0, dtype=torch.long)  # tokens sampled so far per row
        self.logits_BV: torch.Tensor | None = None
        self.prompt_routes: dict[int, torch.Tensor] = {}  # prompt index -> int16 [P, M, Kx]
        self.decode_routes: torch.Tensor | None = None  # int16 [N, G, M, Kx], filled lazily

    def run(self) -> list[Completion]:
        while self.waiting or len(self.rows_B):
            self.admit()
            tokens_B, logps_B = sample_next(self.logits_BV, self.params, self.policy.generator)
            tokens_B, logps_B = tokens_B.cpu(), logps_B.cpu()
            self.tokens_NG[self.rows_B, self.count_B] = tokens_B
            self.logps_NG[self.rows_B, self.count_B] = logps_B
            self.count_B += 1
            stopped_B = torch.isin(tokens_B, self.stops)
            done_B = stopped_B | (self.count_B >= self.params.max_new_tokens)
            if bool(done_B.any()):
                self.finish(done_B, stopped_B)
                keep_B = ~done_B
                tokens_B = tokens_B[keep_B]
            if len(self.rows_B):
                self.logits_BV, routed_B1MK = self.policy.forward(
                    self.cache, tokens_B.to(self.policy.device)[:, None], plan=self.plan
                )
                if routed_B1MK is not None:
                    self.record_decode(routed_B1MK[:, 0])
        return self.results  # type: ignore[return-value]

    def admit(self) -> None:
        """Prefill waiting prompts into free rows and append them to the running batch."""
        free = self.policy.max_batch - len(self.rows_B)
        if free <= 0 or not self.waiting:
            return
        new = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        for group in prefill_groups([len(self.prompts[i]) for i in new]):
            self.add_rows([new[g] for g in group])

    def add_rows(self, new: list[int]) -> None:
        cache, logits_BV, routes_BPMK = self.policy.prefill(
            [self.prompts[i] for i in new], self.plan
        )
        if routes_BPMK is not None:
            for row, index in enumerate(new):
                length = len(self.prompts[index])
                self.prompt_routes[index] = routes_BPMK[row, -length:].to("cpu", torch.int16)
        new_B = torch.tensor(new, dtype=torch.long)
        if self.cache is None or not len(self.rows_B):
            self.cache, self.logits_BV = cache, logits_BV
            self.rows_B, self.count_B = new_B, torch.zeros(len(new), dtype=torch.long)
            return
        self.cache.extend(cache)
        self.logits_BV = torch.cat([self.logits_BV, logits_BV])
        self.rows_B = torch.cat([self.rows_B, new_B])
        self.count_B = torch.cat([self.count_B, torch.zeros(len(new), dtype=torch.long)])

    def finish(self, done_B: torch.Tensor, stopped_B: torch.Tensor) -> None:
        """Write the Completions of the finished rows and drop them from the batch."""
        for row in done_B.nonzero()[:, 0].tolist():
            index = int(self.rows_B[row])
            count = int(self.count_B[row])
            self.results[index] = Completion(
                token_ids=self.tokens_NG[index, :count].tolist(),
                logprobs=self.logps_NG[index, :count].tolist(),
                finish_reason="stop" if stopped_B[row] else "length",
                routed_experts=self.routes_of(index, count),
            )
        keep_B = ~done_B
        self.rows_B, self.count_B = self.rows_B[keep_B], self.count_B[keep_B]
        if len(self.rows_B):
            self.cache.select(keep_B.to(self.policy.device))
            if 2 * self.cache.length > 3 * int(self.cache.key_mask.sum(1).max()):
                self.cache.compact()  # over a third of the widest row's slots are holes
        else:
            self.cache = None

    def record_decode(self, routed_BMK: torch.Tensor) -> None:
        if self.decode_routes is None:
            shape = (len(self.prompts), self.params.max_new_tokens, *routed_BMK.shape[1:])
            self.decode_routes = torch.zeros(shape, dtype=torch.int16)
        self.decode_routes[self.rows_B, self.count_B - 1] = routed_BMK.to("cpu", torch.int16)

    def routes_of(self, index: int, count: int) -> np.ndarray | None:
        """int16 [P + count - 1, M, Kx]: the prompt's routes, then those of the fed samples."""
        if not self.policy.record_routing:
            return None
        parts = [self.prompt_routes.pop(index)]
        if count > 1:
            parts.append(self.decode_routes[index, : count - 1])
        return routes_array(parts, self.policy.model.config)


def prefill_groups(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """Indices grouped for batched prefill: by length, each group padded by at most `waste` of
    its real tokens. (On CPU one padded batch of mixed lengths runs at the speed of its padded
    size, while prompts prefilled alone or in even groups run ~1.7x faster per real token:
    benchmarks/decode_speed.py, prefill table.)"""
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    groups: list[list[int]] = []
    for index in order:
        if groups:
            group = groups[-1]
            widest = lengths[group[0]]
            real = sum(lengths[i] for i in group) + lengths[index]
            if widest * (len(group) + 1) <= (1 + waste) * real:
                group.append(index)
                continue
        groups.append([index])
    return groups


def routes_array(parts: list[torch.Tensor], config) -> np.ndarray:
    """Routing pieces ([t, M, Kx] tensors, in order) -> one int16 numpy array [n, M, Kx] (the
    routing record's type; n = 0, shaped from `config`, when there are none)."""
    if not parts:
        shape = (0, config.mlp_types.count("sparse"), config.num_experts_per_token)
        return np.zeros(shape, dtype=np.int16)
    return torch.cat([p.to("cpu", torch.int16) for p in parts]).numpy()


def replay_indices(completion: Completion, length: int) -> torch.Tensor:
    """[M, length, Kx] replay_experts for one sequence (prompt + completion.token_ids, `length`
    tokens) from a recorded completion. The last position, whose routing no logprob depends
    on and the engine never ran, repeats the one before it."""
    if completion.routed_experts is None:
        raise ValueError("the completion carries no routing (K3Policy(record_routing=True))")
    recorded_TMK = torch.tensor(completion.routed_experts, dtype=torch.long)
    if recorded_TMK.shape[0] != length - 1:
        raise ValueError(f"{recorded_TMK.shape[0]} recorded positions for {length} tokens")
    return torch.cat([recorded_TMK, recorded_TMK[-1:]]).transpose(0, 1)
