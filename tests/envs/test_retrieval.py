"""Retrieval-v0: multi-hop questions over a generated collection, from a few KB to >1M tokens."""

from __future__ import annotations

import itertools
import tracemalloc

import gymnasium
import pytest

import envs
from envs.retrieval import RetrievalEnv, World, make_world
from envs.types import assistant, tool_call


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_the_expert_solves_every_hop_count(difficulty):
    env = gymnasium.make("agentrl/Retrieval-v0", difficulty=difficulty, num_documents=200)
    expert = envs.make_expert("agentrl/Retrieval-v0", seed=0)
    demos = [envs.demonstrate(env, expert, seed=s) for s in range(20)]
    assert all(d.outcome["success"] for d in demos)
    opened = [m for m in demos[0].messages if m.get("name") == "open"]
    assert len(opened) == difficulty  # one document per hop


def test_evidence_is_spread_across_distant_documents():
    env = RetrievalEnv(difficulty=2, num_documents=900)
    for seed in range(10):
        env.reset(seed=seed)
        docs = sorted(env.chain)
        gaps = [b - a for a, b in itertools.pairwise(docs)] + [900 - docs[-1] + docs[0]]
        assert min(gaps) >= 900 // 3 - 1


def test_the_world_is_deterministic_in_the_seed():
    a, b = RetrievalEnv(num_documents=50), RetrievalEnv(num_documents=50)
    assert a.reset(seed=7)[0] == b.reset(seed=7)[0]
    assert [a.world.text(i) for i in range(50)] == [b.world.text(i) for i in range(50)]
    assert a.reset(seed=8)[0] != b.reset(seed=7)[0]


def test_tools_answer_and_wrong_answers_fail():
    env = RetrievalEnv(difficulty=1, num_documents=30)
    env.reset(seed=1)
    company = env.world.title(env.chain[0])
    obs, *_ = env.step(assistant("", [tool_call("search", {"query": company})]))
    assert obs[0]["content"].startswith(f"{env.chain[0]}: {company}")
    obs, *_ = env.step(assistant("", [tool_call("open", {"doc_id": 10**9})]))
    assert obs[0]["content"].startswith("Error: no document")
    _, reward, terminated, _, info = env.step(
        assistant("", [tool_call("answer", {"answer": "Nobody Special"})])
    )
    assert terminated and reward == 0.0 and info["outcome"]["details"]["expected"] == env.target


def test_small_collection_is_a_few_kilobytes():
    env = RetrievalEnv(num_documents=30, doc_sentences=1)
    env.reset(seed=0)
    size = sum(len(env.world.text(i)) for i in range(30))
    assert 1_000 < size < 10_000


@pytest.mark.slow
def test_a_collection_of_over_a_million_tokens_is_fast_and_memory_sane(monkeypatch):
    rng = __import__("numpy").random.default_rng(0)
    generated = []  # documents whose text was generated (the costly part: none at build time)
    real = World.text
    monkeypatch.setattr(World, "text", lambda self, doc: generated.append(doc) or real(self, doc))
    tracemalloc.start()
    world, chain = make_world(rng, 20_000, 5, hops=3)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    built_texts = len(generated)
    words = chars = 0
    for doc in range(20_000):
        text = world.text(doc)
        words, chars = words + len(text.split()), chars + len(text)
    assert words > 1_000_000  # every subword tokenizer gives at least one token per word
    # fast: building generates no document text (~6.5 MB of it), which is also never held
    assert built_texts == 0 and peak < 64 * 2**20, (built_texts, peak)
    assert len(generated) == 20_000  # the reads above did generate it, on demand
    assert chain[0] in world.search(world.title(chain[0]))
    assert world.text(chain[1]) == world.text(chain[1])  # generated on demand, the same each time
