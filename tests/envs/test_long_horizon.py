"""LongHorizon-v0: chain questions whose evidence is read, whole documents at a time, into the
agent's context, far apart; from a 1K-token default to million-token episodes."""

from __future__ import annotations

import itertools
import json
import re
import time
import tracemalloc

import gymnasium
import numpy as np
import pytest

import envs
from envs.check import check_tool_env
from envs.long_horizon import (
    RETRACTED,
    Archive,
    LongHorizonEnv,
    chain_note,
    chain_prefix,
    facts_in,
    make_archive,
    normalize,
    resolve,
)
from envs.types import assistant, tool_call
from rollout.parse import parse_turn

ID = "agentrl/LongHorizon-v0"


def answer(text: str):
    return assistant("", [tool_call("answer", {"answer": text})])


def read_next():
    return assistant("", [tool_call("read_next", {})])


def facts_of(archive, docs) -> dict[tuple[str, str], str]:
    facts = {}
    for doc in docs:
        for relation, subject, obj in facts_in(archive.text(doc)):
            facts[(relation, subject)] = obj
    return facts


def test_it_is_registered_and_listed():
    assert ID in envs.env_ids()
    assert "LongHorizonExpert" in type(envs.make_expert(ID)).__name__


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"hops": 4, "distance": 5, "doc_tokens": 1500, "distractors": 3},
        {"hops": 3, "distance": 3, "evidence_order": "reverse"},
        {"distractors": 0, "background_facts": False},
    ],
)
def test_agentrl_envs_check_passes(kwargs):
    report = check_tool_env(ID, kwargs=kwargs, episodes=3, long_steps=12)
    assert report.passed, report.format()


def test_the_default_episode_is_small_enough_for_a_cpu_test():
    env = gymnasium.make(ID)
    demo = envs.demonstrate(env, envs.make_expert(ID), seed=0)
    chars = sum(len(m["content"]) for m in demo.messages)
    assert demo.outcome["success"] and chars < 8_000  # ~2K tokens at 4 characters a token


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
@pytest.mark.parametrize("hops", [1, 2, 3, 5])
def test_the_expert_solves_every_seed(hops, order):
    env = gymnasium.make(ID, hops=hops, distance=3, evidence_order=order, distractors=3)
    expert = envs.make_expert(ID, seed=0)
    for seed in range(15):
        demo = envs.demonstrate(env, expert, seed=seed)
        details = demo.outcome["details"]
        assert demo.outcome["success"], (seed, details)
        # it read in order up to the last piece of evidence, and no further
        reads = [m for m in demo.messages if m.get("name") == "read_next"]
        assert len(reads) == details["docs_read"] == max(details["evidence_docs"]) + 1
        assert details["hops"] == hops and details["distance"] == 3
        assert details["tokens_read"] == details["chars_read"] // 4 > 0


def test_an_imperfect_expert_answers_with_distractors():
    env = gymnasium.make(ID, hops=2, distractors=2)
    expert = envs.make_expert(ID, error_rate=0.5, seed=1)
    outcomes = [envs.demonstrate(env, expert, seed=s).outcome for s in range(40)]
    wrong = [o for o in outcomes if not o["success"]]
    assert 8 <= len(wrong) <= 32
    inner = env.unwrapped
    assert all(o["details"]["given"] != o["details"]["expected"] for o in wrong)
    assert inner.archive.decoys  # what the wrong answers are drawn from


def note_links(note: str) -> list[tuple[str, str, str]]:
    """The links a chain note states, as (relation, subject, object)."""
    assert note.startswith("Chain: ") and note.endswith("."), note
    return list(facts_in(note.removeprefix("Chain: ")))


def expert_turns(demo):
    """Each expert turn as (note, call, documents read before it, true facts read before it)."""
    docs_read, facts, turns = 0, set(), []
    for message in demo.messages:
        if message["role"] == "assistant":
            [call] = message["tool_calls"]
            turns.append((message["content"], call["function"], docs_read, set(facts)))
        elif message.get("name") == "read_next" and not message["content"].startswith("Error"):
            docs_read += 1
            facts |= set(facts_in(message["content"]))
    return turns


def test_chain_prefix_and_note():
    relations = ["founder", "birthplace", "river"]
    facts = {("founder", "Velkaro Works"): "Ana Kamiro", ("river", "Tanmiford"): "Sorbe"}
    assert chain_prefix(facts, "Velkaro Works", relations) == ["Velkaro Works", "Ana Kamiro"]
    assert resolve(facts, "Velkaro Works", relations) is None
    facts[("birthplace", "Ana Kamiro")] = "Tanmiford"
    entities = chain_prefix(facts, "Velkaro Works", relations)
    assert entities == ["Velkaro Works", "Ana Kamiro", "Tanmiford", "Sorbe"]
    assert resolve(facts, "Velkaro Works", relations) == "Sorbe"
    assert chain_note(entities[:1], relations) == "Chain: Velkaro Works."
    assert chain_note(entities[:2], relations) == "Chain: Velkaro Works was founded by Ana Kamiro."
    assert chain_note(entities, relations) == (
        "Chain: Velkaro Works was founded by Ana Kamiro. Ana Kamiro was born in Tanmiford. "
        "Tanmiford lies on the Sorbe river."
    )
    assert note_links(chain_note(entities, relations))[-1] == ("river", "Tanmiford", "Sorbe")


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_the_experts_notes_name_only_what_it_has_read_and_only_grow(order):
    env = gymnasium.make(ID, hops=3, distance=2, evidence_order=order, distractors=2)
    expert = envs.make_expert(ID, seed=0)
    for seed in range(12):
        demo = envs.demonstrate(env, expert, seed=seed)
        archive = env.unwrapped.archive
        assert demo.outcome["success"] and "`Chain: ...`" in demo.messages[0]["content"]
        turns = expert_turns(demo)
        for note, call, docs_read, facts in turns:
            # the links known: every hop up to the first whose document is still unread
            known = 0
            while known < len(archive.relations) and archive.positions[known] < docs_read:
                known += 1
            assert note == chain_note(archive.chain[: known + 1], archive.relations), seed
            links = note_links(note)
            assert len(links) == known and set(links) <= facts  # read, before this turn
            assert call["name"] == ("answer" if known == len(archive.relations) else "read_next")
        notes = [note for note, *_ in turns]
        for earlier, later in itertools.pairwise(notes):
            assert later.startswith(earlier.removesuffix("."))  # a note only grows
            assert note_links(later)[: len(note_links(earlier))] == note_links(earlier)


def test_a_wrong_demonstrations_note_ends_with_its_decoy():
    for hops in (2, 3):
        env = gymnasium.make(ID, hops=hops, distractors=2)
        expert = envs.make_expert(ID, error_rate=1.0, seed=3)
        for seed in range(10):
            demo = envs.demonstrate(env, expert, seed=seed)
            archive = env.unwrapped.archive
            note, call, *_ = expert_turns(demo)[-1]
            given = call["arguments"]["answer"]
            assert call["name"] == "answer" and not demo.outcome["success"]
            assert given in archive.decoys and given == demo.outcome["details"]["given"]
            links = note_links(note)
            assert links[-1] == (archive.relations[-1], archive.chain[-2], given)
            true = list(zip(archive.relations, archive.chain[:-1], archive.chain[1:], strict=True))
            assert links[:-1] == true[:-1]  # only the last link is misread
            notes = [n for n, *_ in expert_turns(demo)]
            assert all(b.startswith(a.removesuffix(".")) for a, b in itertools.pairwise(notes))


def test_the_final_note_ends_with_the_graded_answer():
    env = gymnasium.make(ID, hops=3, distance=3, distractors=3)
    expert = envs.make_expert(ID, seed=0)
    for seed in range(10):
        demo = envs.demonstrate(env, expert, seed=seed)
        note, call, *_ = expert_turns(demo)[-1]
        details = demo.outcome["details"]
        assert demo.outcome["success"] and call["name"] == "answer"
        assert note_links(note)[-1][2] == call["arguments"]["answer"] == details["expected"]


def test_a_note_and_its_call_render_and_parse_back_as_one_turn():
    from policy.tokenizer import render_conversations

    demo = envs.demonstrate(gymnasium.make(ID), envs.make_expert(ID), seed=1)
    [text] = render_conversations([(demo.messages, demo.tools)])
    turns = [t.split("<|im_end|>")[0] for t in text.split("<|im_start|>assistant\n")[1:]]
    expected = [m for m in demo.messages if m["role"] == "assistant"]
    assert len(turns) == len(expected) >= 2
    for turn, message in zip(turns, expected, strict=True):
        assert turn.startswith(message["content"] + "\n<tool_call>")
        parsed = parse_turn(turn)
        assert parsed.errors == [] and parsed.message == message


def test_the_task_is_deterministic_in_the_seed():
    a, b = LongHorizonEnv(hops=3, distance=4), LongHorizonEnv(hops=3, distance=4)
    assert a.reset(seed=7)[0] == b.reset(seed=7)[0]
    assert a.archive.positions == b.archive.positions and a.target == b.target
    docs = range(a.num_documents)
    assert [a.archive.text(i) for i in docs] == [b.archive.text(i) for i in docs]
    assert [a.archive.text(i) for i in docs] == [a.archive.text(i) for i in docs]
    assert a.reset(seed=8)[0] != b.reset(seed=7)[0]


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_the_evidence_is_far_apart_and_every_hop_is_needed(order):
    hops, distance = 4, 6
    env = LongHorizonEnv(hops=hops, distance=distance, doc_tokens=300, evidence_order=order)
    for seed in range(10):
        env.reset(seed=seed)
        archive = env.archive
        positions = sorted(archive.positions)
        assert len(set(positions)) == hops
        assert all(b - a >= distance for a, b in itertools.pairwise(positions))
        per_doc = [facts_of(archive, [d]) for d in range(env.num_documents)]

        def chain_end(docs, archive=archive, per_doc=per_doc):
            known = {k: v for d in docs for k, v in per_doc[d].items()}
            return resolve(known, archive.chain[0], archive.relations)

        everything = range(env.num_documents)
        assert chain_end(everything) == env.target
        for evidence in archive.positions:  # without any one evidence document: no answer
            assert chain_end([d for d in everything if d != evidence]) is None
            assert chain_end([evidence]) is None  # and no one document answers it
        # each hop's true fact is stated in exactly one document: its own
        for hop, relation in enumerate(archive.relations):
            holders = [d for d in everything if (relation, archive.chain[hop]) in per_doc[d]]
            assert holders == [archive.positions[hop]]


@pytest.mark.parametrize("distractors", [0, 2])
def test_without_background_facts_only_the_inserted_sentences_state_anything(distractors):
    hops = 3
    kwargs = {"hops": hops, "distance": 3, "doc_tokens": 600, "distractors": distractors}
    env = LongHorizonEnv(**kwargs, background_facts=False)
    wrapped = gymnasium.make(ID, **kwargs, background_facts=False)  # for the expert's episodes
    expert = envs.make_expert(ID, seed=0)
    for seed in range(6):
        env.reset(seed=seed)
        archive = env.archive
        docs = range(env.num_documents)
        stated = [fact for d in docs for fact in facts_in(archive.text(d))]
        inserted = [
            fact for d in archive.inserts for s in archive.inserts[d] for fact in facts_in(s)
        ]
        assert sorted(stated) == sorted(inserted) and len(stated) >= hops  # nothing else
        assert all(subject in archive.reserved for _, subject, _ in stated)
        # the documents keep their length: filler takes the background facts' place
        assert len(archive.text(0)) >= 4 * 600
        assert envs.demonstrate(wrapped, expert, seed=seed).outcome["success"]
    with_background = LongHorizonEnv(**kwargs | {"distractors": 0})
    with_background.reset(seed=0)
    assert len(list(facts_in(with_background.archive.text(0)))) > 5  # the default has many


def test_the_question_alone_is_not_enough():
    env = LongHorizonEnv(hops=3, distance=3)
    for seed in range(10):
        opening, _ = env.reset(seed=seed)
        question = opening[0]["content"]
        assert env.archive.chain[0] in question
        assert all(name not in question for name in env.archive.chain[1:])
        for guess in (env.archive.chain[0], question, *env.archive.decoys):
            env.reset(seed=seed)
            _, reward, terminated, *_ = env.step(answer(guess))
            assert terminated and reward == 0.0


def naive_statements(text: str, relation: str) -> list[str]:
    """The objects of every statement of `relation` in `text`, in order, retracted ones too."""
    found = []
    for sentence in re.split(r"(?<=\.)\s+|\n+", text):
        for prefix in RETRACTED:
            if sentence.startswith(prefix):
                sentence = sentence[len(prefix)].upper() + sentence[len(prefix) + 1 :]
        found += [o for r, _, o in facts_in(sentence) if r == relation]
    return found


def last_document_policy(env, seed: int, *, latest: bool) -> bool:
    """Reads in order as far as the expert does, then answers with the first (or, `latest`, the
    most recent) statement of the question's last relation in the last document read."""
    env.reset(seed=seed)
    inner = env.unwrapped
    for _ in range(max(inner.archive.positions) + 1):
        obs, *_ = env.step(read_next())
    found = naive_statements(obs[0]["content"], inner.archive.relations[-1])
    assert found  # the last document does state the relation, several times
    _, reward, terminated, *_ = env.step(answer(found[-1] if latest else found[0]))
    return terminated and reward == 1.0


@pytest.mark.parametrize("latest", [False, True])
def test_answering_from_the_last_document_read_mostly_fails(latest):
    env = gymnasium.make(ID, hops=3, distance=3, distractors=3)
    wins = sum(last_document_policy(env, seed, latest=latest) for seed in range(40))
    assert wins <= (0 if latest else 16), wins  # the first: 1 in 4 or less by luck


def test_tools_read_whole_documents_and_walk_in_order():
    env = LongHorizonEnv(hops=2, distance=2, doc_tokens=3000)
    env.reset(seed=3)
    obs, *_ = env.step(assistant("", [tool_call("list_documents", {})]))
    assert obs[0]["content"].splitlines()[0] == env.archive.title(0)
    obs, *_ = env.step(assistant("", [tool_call("read", {"doc_id": 2})]))
    text = obs[0]["content"]
    assert text == env.archive.text(2) and len(text) >= 4 * 3000  # whole, not cut at 4096
    assert "truncated" not in text
    obs, *_ = env.step(read_next())
    assert obs[0]["content"] == env.archive.text(3)
    obs, *_ = env.step(assistant("", [tool_call("read", {"doc_id": 10**9})]))
    assert obs[0]["content"].startswith("Error: no document")
    env.step(assistant("", [tool_call("read", {"doc_id": env.num_documents - 1})]))
    obs, *_ = env.step(read_next())
    assert obs[0]["content"].startswith("Error: the archive ends")
    _, reward, terminated, _, info = env.step(answer(f"the {env.target.upper()}!"))
    assert terminated and reward == 1.0
    assert info["outcome"]["details"]["docs_read"] == 3


def test_grading_ignores_case_punctuation_and_river():
    assert normalize("The Tanmiro River.") == normalize("tanmiro") == "tanmiro"
    assert normalize("Ana  Kamiro!") == "ana kamiro"
    assert normalize("") == ""


def test_save_and_continue_mid_episode():
    env, other = LongHorizonEnv(hops=3, distance=2), LongHorizonEnv(hops=3, distance=2)
    env.reset(seed=5)
    for _ in range(3):
        env.step(read_next())
    state = json.loads(json.dumps(env.get_state()))
    other.reset(seed=99)
    other.set_state(state)
    assert other._cursor == env._cursor == 2 and other._chars_read == env._chars_read
    assert other.step(read_next())[0] == env.step(read_next())[0]


def test_knobs_are_validated():
    with pytest.raises(ValueError, match="num_documents"):
        LongHorizonEnv(hops=3, distance=10, num_documents=15)
    with pytest.raises(ValueError, match="hops"):
        LongHorizonEnv(hops=0)
    with pytest.raises(ValueError, match="evidence_order"):
        LongHorizonEnv(evidence_order="sideways")
    with pytest.raises(ValueError, match="background_facts"):
        LongHorizonEnv(background_facts="no")
    env = LongHorizonEnv(hops=3, distance=10)
    assert env.num_documents == 2 * 10 + 1 + 10 and env.max_turns == env.num_documents + 2


def expert_episode_chars(seed: int, **kwargs) -> tuple[int, dict]:
    env = gymnasium.make(ID, **kwargs)
    demo = envs.demonstrate(env, envs.make_expert(ID), seed=seed)
    chars = sum(len(m["content"]) for m in demo.messages if m.get("name") == "read_next")
    return chars, demo.outcome


def test_a_100k_token_episode_is_fast_and_near_its_target():
    start = time.perf_counter()
    chars, outcome = expert_episode_chars(0, hops=3, distance=12, doc_tokens=4000)
    seconds = time.perf_counter() - start
    assert outcome["success"]
    tokens = chars // 4
    assert 100_000 / 2 < tokens < 100_000 * 2, tokens
    assert outcome["details"]["chars_read"] == chars
    # a regression bound, not a benchmark: ~0.1 s on an idle 2-core machine, so only a 10x+
    # slowdown (or a badly overloaded machine) breaks it
    assert seconds < 5, seconds


def test_the_archive_is_generated_on_demand(monkeypatch):
    rng = np.random.default_rng(0)
    generated = []  # documents whose text was generated
    real = Archive.text
    monkeypatch.setattr(Archive, "text", lambda self, doc: generated.append(doc) or real(self, doc))
    tracemalloc.start()
    archive = make_archive(
        rng,
        hops=4,
        distance=20_000,
        num_documents=100_000,
        doc_chars=4 * 16_000,
        distractors=5,
        evidence_order="random",
    )
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # an archive of 1.6 billion tokens costs nothing until a document is read: building it
    # generates no text and holds under 1 MiB
    assert generated == [] and peak < 2**20, (generated, peak)
    assert sum(len(v) for v in archive.inserts.values()) <= 4 * (1 + 5 + 1)
    assert len(archive.text(archive.positions[0])) >= 4 * 16_000
    assert generated == [archive.positions[0]]  # made when read, not before


@pytest.mark.slow
def test_a_million_token_episode():
    start = time.perf_counter()
    chars, outcome = expert_episode_chars(0, hops=4, distance=20, doc_tokens=16_000)
    seconds = time.perf_counter() - start
    assert outcome["success"] and chars // 4 > 900_000, chars
    # a regression bound, not a benchmark: ~0.7 s on an idle 2-core machine (90x slack)
    assert seconds < 60, seconds
