"""Decode sessions (policy/session.py): multi-turn episodes interleaved in one session give the
tokens and logprobs of re-prefilling each whole history (K3 fused, K3 module path, any
transformers LM), routes cover every forwarded position once, weights change between steps
without dropping contexts, drop frees rows and cache sizes are exact."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from policy.engines import open_session
from policy.hf import HFPolicy, build_model, checksum, export_weights
from policy.k3 import K3Cache, K3ForCausalLM, k3_preset
from policy.k3.engine import K3Policy
from policy.sampling import SamplingParams

QWEN = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": True, "max_position_embeddings": 1024}  # fmt: skip
VOCAB = 512
STOPS = tuple(range(3, VOCAB, 7))  # turns end at scattered steps


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def k3_model(dtype=torch.float32, seed=0) -> K3ForCausalLM:
    """k3-debug away from its init symmetries (as tests/policy/k3/test_engine.make_model)."""
    torch.manual_seed(seed)
    model = K3ForCausalLM(k3_preset("k3-debug", vocab_size=VOCAB)).to(dtype).eval()
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


def qwen_model(seed=0):
    return build_model("qwen3", QWEN, vocab_size=VOCAB, seed=seed).eval()


def make_policy(engine: str, seed=0, **kwargs):
    if engine == "hf":
        return HFPolicy(qwen_model(seed), pad_token_id=0)
    return K3Policy(k3_model(seed=seed, **kwargs.pop("model", {})),
                    fused=engine in ("k3", "k3-paged"), paged=engine == "k3-paged",
                    **kwargs)  # fmt: skip


def greedy(budget: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=budget, stop_token_ids=STOPS)


class Episode:
    """One scripted episode: prompt, then turns of up to `budget` sampled tokens, each followed
    by an observation; `history` is everything in its context (pending token included)."""

    def __init__(self, key, prompt, start, rng, turns):
        self.key, self.start, self.turns = key, start, turns
        self.history, self.routes = list(prompt), []  # int16 [n, M, Kx] chunks, in order
        self.budgets = rng.integers(2, 8, size=turns).tolist()
        self.observations = [rng.integers(1, VOCAB, size=int(n)).tolist()
                             for n in rng.integers(1, 14, size=turns)]  # fmt: skip
        self.turn, self.tokens, self.logprobs = 0, [], []
        self.to_add: list[int] | None = None

    def record(self, routes) -> None:
        if routes is not None:
            assert routes.dtype == np.int16 and routes.ndim == 3
            self.routes.append(routes)


def run_script(session, policy, turns=3, seed=0, check=True):
    """Interleaved episodes: starts at different ticks, adds batched across keys of different
    lengths (fresh and continuing), steps over changing subsets (some keys idle), a drop when
    an episode ends and a new key after drops. Each finished turn is compared with
    policy.generate on the whole history (greedy). Returns the finished episodes."""
    rng = np.random.default_rng(seed)
    specs = [(3, 0), (21, 0), (40, 2), (9, 5), (15, 9)]  # prompt length, start tick
    episodes = [Episode(f"ep{i}", rng.integers(1, VOCAB, size=n).tolist(), start, rng, turns)
                for i, (n, start) in enumerate(specs)]  # fmt: skip
    for ep in episodes:
        ep.to_add = list(ep.history)
    live, done, tick = list(episodes), [], 0
    while live:
        adding = [ep for ep in live if ep.to_add is not None and ep.start <= tick]
        if adding:
            routes = session.add([ep.key for ep in adding], [ep.to_add for ep in adding])
            for ep, r in zip(adding, routes, strict=True):
                ep.record(r)
                ep.to_add = None
        stepping = [ep for i, ep in enumerate(live)
                    if ep.start <= tick and ep.to_add is None and (tick + i) % 4]  # fmt: skip
        if stepping:
            outs = session.step([ep.key for ep in stepping], greedy(8))
            for ep, out in zip(stepping, outs, strict=True):
                ep.record(out.routes)
                ep.tokens.append(out.token)
                ep.logprobs.append(out.logprob)
                if out.token in STOPS or len(ep.tokens) == ep.budgets[ep.turn]:
                    end_turn(session, policy, ep, check)
                    if ep.turn == ep.turns:
                        live.remove(ep)
                        done.append(ep)
                        session.drop([ep.key])
        tick += 1
    return done


def end_turn(session, policy, ep: Episode, check: bool) -> None:
    if check:
        want = policy.generate([ep.history], greedy(ep.budgets[ep.turn]))[0]
        assert ep.tokens == want.token_ids, (ep.key, ep.turn)
        np.testing.assert_allclose(ep.logprobs, want.logprobs, atol=1e-4, rtol=0)
    ep.history += ep.tokens
    assert session.context_length(ep.key) == len(ep.history)
    ep.tokens, ep.logprobs = [], []
    ep.to_add = ep.observations[ep.turn]
    ep.history += ep.to_add if ep.turn + 1 < ep.turns else []
    ep.turn += 1


@pytest.mark.parametrize("engine", ["k3", "k3-paged", "k3-module", "hf"])
def test_multiturn_greedy_equals_reprefill(engine, monkeypatch):
    compactions = []
    compact = K3Cache.compact
    monkeypatch.setattr(K3Cache, "compact", lambda self: compactions.append(1) or compact(self))
    policy = make_policy(engine)
    session = open_session(policy)
    done = run_script(session, policy, turns=4)
    assert len(done) == 5 and not session.contexts
    if engine == "hf":
        assert session.batched_forwards > 0
    elif engine == "k3-paged":  # no holes to compact; every page back, arenas released
        assert session.pool is None and session.stats["gather"] and not compactions
        assert not session.pages.taken and len(session.pages.arenas) == 1  # the spare
    else:
        assert session.pool is None
        assert session.stats["view"] and session.stats["gather"] and compactions


def test_routes_single_turn_equal_generate():
    policy = make_policy("k3", record_routing=True, model={"dtype": torch.float64})
    session = open_session(policy)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, VOCAB, size=n).tolist() for n in (4, 19, 11)]
    routes = [[r] for r in session.add(["a", "b", "c"], prompts)]  # int16 [n, M, Kx] chunks
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    tokens = [[], [], []]
    for _ in range(6):
        for i, out in enumerate(session.step(["a", "b", "c"], params)):
            routes[i].append(out.routes)
            tokens[i].append(out.token)
    for prompt, got, sampled in zip(prompts, routes, tokens, strict=True):
        want = policy.generate([prompt], params)[0]
        assert sampled == want.token_ids
        assert want.routed_experts.dtype == np.int16
        np.testing.assert_array_equal(np.concatenate(got), want.routed_experts)
    assert session.step([], params) == [] and session.add([], []) == []


def test_routes_multiturn_cover_every_position_once():
    """float64: every recorded position equals the model's routing over the final sequence."""
    policy = make_policy("k3", record_routing=True, model={"dtype": torch.float64})
    session = open_session(policy)
    done = run_script(session, policy, turns=3, seed=2, check=False)
    sparse, top_k = policy.model.config.mlp_types.count("sparse"), 2
    for ep in done:
        routes = torch.from_numpy(np.concatenate(ep.routes)).long()  # [T - 1, M, Kx]
        assert routes.shape == (len(ep.history) - 1, sparse, top_k), ep.key
        with torch.no_grad():
            live = policy.model(torch.tensor([ep.history]), return_routing=True).routed_experts
        want = live[:, :-1].transpose(0, 1)  # [M, T, Kx] -> [T - 1, M, Kx]
        assert torch.equal(routes.sort(-1).values, want.sort(-1).values), ep.key
    off = open_session(make_policy("k3"))
    assert off.add(["a"], [[1, 2, 3]]) == [None]
    assert off.step(["a"], greedy(1))[0].routes is None


def continued_logprobs(old, new, prefix: list[int], token: int) -> torch.Tensor:
    """log_softmax of `new`'s next-token logits after `token`, over a cache of `prefix`
    computed by `old` (what an in-flight weight update leaves in a live context)."""
    with torch.no_grad():
        cache = old(torch.tensor([prefix]), use_cache=True).cache
        mask = torch.ones(1, len(prefix) + 1)
        position = torch.tensor([[len(prefix)]])
        out = new(torch.tensor([[token]]), attention_mask=mask, position_ids=position, cache=cache,
                  use_cache=True)  # fmt: skip
    return torch.log_softmax(out.logits[0, -1].float(), -1)


@pytest.mark.parametrize("engine", ["k3", "k3-paged", "k3-module", "hf"])
def test_weights_change_between_steps(engine):
    policy = make_policy(engine)
    old = copy.deepcopy(policy.model)
    new = make_policy(engine, seed=9).model
    weights = export_weights(new)
    session = open_session(policy)
    rng = np.random.default_rng(3)
    histories = {k: rng.integers(1, VOCAB, size=n).tolist() for k, n in (("a", 7), ("b", 16))}
    session.add(list(histories), list(histories.values()))
    for _ in range(3):
        for key, out in zip(histories, session.step(list(histories), greedy(1)), strict=True):
            histories[key].append(out.token)
    with pytest.raises(ValueError):
        session.load_weights(3, weights, checksum(weights) + 1)
    assert session.version == policy.version == 0
    session.load_weights(3, weights, checksum(weights))
    assert session.version == policy.version == 3
    outs = session.step(list(histories), greedy(1))
    for (key, history), out in zip(histories.items(), outs, strict=True):
        want = continued_logprobs(old, new, history[:-1], history[-1])
        stale = continued_logprobs(old, old, history[:-1], history[-1])
        assert out.token == int(want.argmax())
        assert abs(out.logprob - float(want.max())) < 1e-4
        assert (want - stale).abs().max() > 1e-2  # the install did change the next logits
        assert session.context_length(key) == len(history) + 1
    policy.load_weights(5, weights, checksum(weights))
    assert session.version == 5
    assert len(session.step(list(histories), greedy(1))) == 2


def analytic_k3_bytes(config) -> tuple[int, int]:
    """(bytes per sequence: KDA states + conv windows, bytes per token: MLA latents), float32
    (benchmarks/cache_bytes.py)."""
    la = config.linear_attn_config
    heads, dim, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    kda = config.layer_types.count("linear_attention")
    mla = config.num_hidden_layers - kda
    per_seq = kda * 4 * (heads * dim * dim + (width - 1) * 3 * heads * dim)
    return per_seq, mla * 4 * (config.kv_lora_rank + config.qk_rope_head_dim)


@pytest.mark.parametrize("engine", ["k3", "hf"])
def test_drop_lengths_and_cache_bytes(engine):
    policy = make_policy(engine)
    session = open_session(policy)
    if engine == "hf":
        per_seq, per_token = (
            0,
            2 * QWEN["num_hidden_layers"] * QWEN["num_key_value_heads"] * (QWEN["head_dim"] * 4),
        )
    else:
        per_seq, per_token = analytic_k3_bytes(policy.model.config)
    session.add(["a", "b", "c"], [[5] * 10, [6] * 3, [7] * 30])
    assert [session.context_length(k) for k in "abc"] == [10, 3, 30]
    assert session.cache_bytes("a") == per_seq + 10 * per_token
    session.step(["a", "b"], greedy(1))  # a pending token: in the context, not in the cache
    assert (
        session.context_length("a") == 11 and session.cache_bytes("a") == per_seq + 10 * per_token
    )
    session.step(["a"], greedy(1))
    assert session.cache_bytes("a") == per_seq + 11 * per_token
    session.add(["a", "b"], [[1, 2, 3, 4, 5], []])  # pending + 5 new tokens; b's pending only
    assert (
        session.context_length("a") == 17 and session.cache_bytes("a") == per_seq + 17 * per_token
    )
    assert session.context_length("b") == 4 and session.cache_bytes("b") == per_seq + 4 * per_token
    mask = 1 if engine == "k3" else 0  # the admission model also counts K3's key-mask byte
    assert session.bytes_for(17) == session.cache_bytes("a") + 17 * mask  # to the byte
    session.drop(["b", "unknown"])
    with pytest.raises(KeyError):
        session.context_length("b")
    with pytest.raises(ValueError):
        session.add(["a", "a"], [[1], [2]])
    with pytest.raises(ValueError):
        session.add(["a"], [[VOCAB]])
    session.add(["d"], [[]])  # a key with an empty context cannot sample yet
    with pytest.raises(ValueError):
        session.step(["d"], greedy(1))
    session.drop(["d"])
    assert session.cache_bytes("c") == per_seq + 30 * per_token
    if engine == "k3":
        assert session.pool.num_rows == 2
        for _ in range(300):  # c idles while a decodes: its row gets holes, compacted away
            session.step(["a"], greedy(1))
        assert session.pool.length <= 1.5 * (17 + 300) + 2
        assert session.cache_bytes("c") == per_seq + 30 * per_token
        session.drop(["a", "c"])
        assert session.pool is None


def test_hf_a_groups_prompt_is_prefilled_once_and_decode_steps_stay_in_one_batch():
    """A prompt added to several new keys runs once; decode steps over the same keys (or at
    least half of them, after a drop) are one forward on the kept batch, whose rows are each
    key's own context: greedy tokens and logprobs equal generate's on the whole history."""
    policy = make_policy("hf")
    session = open_session(policy)
    shapes = []
    policy.model.register_forward_hook(
        lambda m, args, kwargs, out: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    prompts = [list(range(5, 30))] * 4 + [list(range(40, 52))] * 2
    keys = [f"k{i}" for i in range(6)]
    session.add(keys, prompts)
    assert shapes == [(1, 25), (1, 12)]  # one prefill per distinct prompt
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    sampled = {key: [] for key in keys}
    for turn in range(8):
        if turn == 4:
            session.drop(keys[:2])  # 4 of the batch's 6 rows step on
            keys = keys[2:]
        for key, out in zip(keys, session.step(keys, params), strict=True):
            sampled[key].append((out.token, out.logprob))
    assert shapes[2] == (6, 1) and all(shape == (6, 1) for shape in shapes[3:]), shapes
    assert len(shapes) == 2 + 8 - 1  # the first step's tokens are sampled from the prefill
    for key, prompt in zip([f"k{i}" for i in range(6)], prompts, strict=True):
        want = policy.generate([prompt], params)[0]
        got = sampled[key]
        assert [t for t, _ in got] == want.token_ids[: len(got)], key
        np.testing.assert_allclose([lp for _, lp in got], want.logprobs[: len(got)], atol=1e-4)
        if key in keys:
            assert session.cache_bytes(key) == session.bytes_for(len(prompt) + 7)


@pytest.mark.parametrize("engine", ["k3", "k3-module"])
def test_k3_a_groups_prompt_is_fed_once_and_copied_row_to_row(engine):
    """K3Session: new keys given the same prompt in one add are fed once; the copies' rows,
    routes, tokens and logprobs are the fed key's (greedy: equal to generate's)."""
    policy = make_policy(engine, record_routing=True)
    session = open_session(policy)
    rows = []
    forward = policy.forward
    policy.forward = lambda sub, ids, *a, **k: (
        rows.append(ids.shape[0]) or forward(sub, ids, *a, **k)
    )
    prompts = [list(range(5, 30))] * 4 + [list(range(40, 52))] * 2
    keys = [f"k{i}" for i in range(6)]
    routes = session.add(keys, prompts)
    assert max(rows) == 2  # the two distinct prompts (staircase), not six rows
    for i in (1, 2, 3):
        np.testing.assert_array_equal(routes[i], routes[0])
    np.testing.assert_array_equal(routes[5], routes[4])
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    sampled = {key: [] for key in keys}
    for _ in range(6):
        for key, out in zip(keys, session.step(keys, params), strict=True):
            sampled[key].append((out.token, out.logprob))
    for key, prompt in zip(keys, prompts, strict=True):
        want = policy.generate([prompt], params)[0]
        assert [t for t, _ in sampled[key]] == want.token_ids, key
        np.testing.assert_allclose([lp for _, lp in sampled[key]], want.logprobs, atol=1e-4)
        assert session.cache_bytes(key) == session.cache_bytes(keys[0 if key < "k4" else 4])
