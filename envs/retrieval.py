"""`agentrl/Retrieval-v0`: multi-hop questions over a generated document collection.

Each episode's seed generates a world of `num_documents` documents, each about one company,
person or city, and a question whose evidence sits in documents far apart in the collection:

    hops=1  Who founded Velkaro Works?                               (company -> founder)
    hops=2  In which city was the founder of Velkaro Works born?      (-> birthplace)
    hops=3  Which river flows through the city where the founder ... (-> river)

Tools: `search(query)` (title search: the documents whose names share the most words with the
query), `open(doc_id)` and `answer(answer)`. Success: the answer names the right entity (case and
punctuation ignored). Filler sentences mention other entities, so reading a document is needed.

Size: a few KB (`num_documents=30`) to well over a million tokens (`num_documents=16000,
doc_sentences=4`, about 1.6M words). Only small per-document arrays and a title index are kept;
a document's text is generated on demand from (seed, doc_id), so generation is fast, deterministic
and memory-sane at any size. Difficulty (`difficulty=1..3`) is the number of hops.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.base import ToolEnv
from envs.tools import ToolError, tool
from envs.types import Message, Outcome, assistant, tool_call, user

# fmt: off
SYL = ("ka", "ro", "vel", "mi", "tan", "sor", "be", "lu", "dar", "nis", "fen", "qo", "ri", "zal",
    "mo", "che", "pra", "tu", "vin", "el", "os", "gar", "hu", "ly")
FIRST = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi",
    "Lena", "Mara", "Nils", "Omar", "Pia")
COMPANY = ("Works", "Labs", "Group", "Systems", "Foods", "Motors")
CITY = ("ford", "ton", "ville", "burg", "port", "mouth")
RIVERS = ("Amber", "Basalt", "Cedar", "Delta", "Ember", "Fjord", "Garnet", "Heron", "Indigo",
    "Juniper")
TRADES = ("baker", "engineer", "painter", "pilot", "teacher", "chemist", "sailor", "architect")
INDUSTRY = ("shipping", "software", "textile", "farming", "mining", "publishing")
# fmt: on
FILLER = (
    "{a} is often compared with {b}.",
    "A report on {a} also mentions {b}.",
    "Visitors to {a} rarely hear about {b}.",
    "{a} was described in an old almanac next to {b}.",
    "Some say {a} owes a lot to {b}.",
)
COMPANY_T, PERSON_T, CITY_T = 0, 1, 2
_WORD = re.compile(r"[a-z0-9]+")


def _syllables(code: int, count: int) -> str:
    parts = []
    for _ in range(count):
        code, digit = divmod(code, len(SYL))
        parts.append(SYL[digit])
    return "".join(parts).capitalize()


def _article(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def normalize(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


@dataclass(slots=True)
class World:
    """One collection: per-document type, name code and link (founder, birthplace or river)."""

    seed: int
    kinds: np.ndarray
    codes: np.ndarray
    links: np.ndarray
    doc_sentences: int
    index: dict[str, list[int]]

    def title(self, doc: int) -> str:
        kind, code = int(self.kinds[doc]), int(self.codes[doc])
        if kind == COMPANY_T:
            return f"{_syllables(code // 6, 3)} {COMPANY[code % 6]}"
        if kind == PERSON_T:
            return f"{FIRST[code % 16]} {_syllables(code // 16, 3)}"
        return f"{_syllables(code // 6, 3)}{CITY[code % 6]}"

    def text(self, doc: int) -> str:
        draws = (
            np.random.default_rng([self.seed, doc])
            .integers(0, 2**31, size=1 + 2 * self.doc_sentences)
            .tolist()
        )
        name, link, kind = self.title(doc), int(self.links[doc]), int(self.kinds[doc])
        if kind == COMPANY_T:
            core = f"{name} is a {INDUSTRY[draws[0] % 6]} company founded by {self.title(link)}."
        elif kind == PERSON_T:
            core = f"{name} is {_article(TRADES[draws[0] % 8])} born in {self.title(link)}."
        else:
            core = f"{name} is a city on the {RIVERS[link]} river."
        n = len(self.kinds)
        filler = [
            FILLER[draws[i] % len(FILLER)].format(a=name, b=self.title(draws[i + 1] % n))
            for i in range(1, len(draws), 2)
        ]
        return " ".join([core, *filler])

    def search(self, query: str, k: int = 5) -> list[int]:
        scores: dict[int, int] = {}
        for word in set(_WORD.findall(query.lower())):
            for doc in self.index.get(word, ()):
                scores[doc] = scores.get(doc, 0) + 1
        return sorted(scores, key=lambda d: (-scores[d], d))[:k]


def make_world(rng: np.random.Generator, num_documents: int, doc_sentences: int, hops: int):
    """A world plus the question's chain (company, its founder[, the founder's birthplace]),
    whose documents are spread evenly across the collection."""
    n = num_documents
    kinds = rng.integers(0, 3, size=n).astype(np.int8)
    start, size = int(rng.integers(n)), min(hops, 2) + 1
    chain = [(start + j * n // size) % n for j in range(size)]
    for j, doc in enumerate(chain):
        kinds[doc] = j
    codes = np.zeros(n, dtype=np.int64)
    for kind, space in ((COMPANY_T, 6 * 24**3), (PERSON_T, 16 * 24**3), (CITY_T, 6 * 24**3)):
        where = np.flatnonzero(kinds == kind)
        codes[where] = rng.choice(space, size=len(where), replace=False)
    persons, cities = np.flatnonzero(kinds == PERSON_T), np.flatnonzero(kinds == CITY_T)
    links = np.zeros(n, dtype=np.int64)
    links[kinds == COMPANY_T] = rng.choice(persons, size=int((kinds == COMPANY_T).sum()))
    links[kinds == PERSON_T] = rng.choice(cities, size=len(persons))
    links[kinds == CITY_T] = rng.integers(0, len(RIVERS), size=len(cities))
    for a, b in itertools.pairwise(chain):
        links[a] = b
    world = World(int(rng.integers(2**62)), kinds, codes, links, doc_sentences, {})
    for doc in range(n):
        for word in _WORD.findall(world.title(doc).lower()):
            world.index.setdefault(word, []).append(doc)
    return world, chain


QUESTIONS = {
    1: "Who founded {c}?",
    2: "In which city was the founder of {c} born?",
    3: "Which river flows through the city where the founder of {c} was born?",
}


class RetrievalEnv(ToolEnv):
    """Answer a multi-hop question by searching and opening documents."""

    expert = "envs.retrieval:RetrievalExpert"

    def __init__(
        self,
        *,
        difficulty: int = 1,
        num_documents: int = 30,
        doc_sentences: int = 1,
        max_turns: int | None = None,
        tool_timeout_s: float | None = 30.0,
        render_mode: str | None = None,
    ):
        if difficulty not in (1, 2, 3):
            raise ValueError(f"difficulty (hops) must be 1, 2 or 3, got {difficulty}")
        if not 10 <= num_documents <= 200_000:
            raise ValueError(f"num_documents must be in [10, 200000], got {num_documents}")
        if not 0 <= doc_sentences <= 20:
            raise ValueError(f"doc_sentences must be in [0, 20], got {doc_sentences}")
        turns = max_turns if max_turns is not None else 2 * difficulty + 2
        super().__init__(max_turns=turns, tool_timeout_s=tool_timeout_s, render_mode=render_mode)
        self.difficulty, self.num_documents = difficulty, num_documents
        self.doc_sentences = doc_sentences
        self.world: World | None = None
        self.chain: list[int] = []
        self.hops = difficulty
        self.target = ""

    @tool
    def search(self, query: str) -> str:
        """Find documents by name: the titles sharing the most words with the query.

        Args:
            query: Words of a name, e.g. "Velkaro Works".
        """
        hits = self.world.search(query[:500])
        if not hits:
            return "No documents found."
        return "\n".join(f"{doc}: {self.world.title(doc)}" for doc in hits)

    @tool
    def open(self, doc_id: int) -> str:
        """Read a document.

        Args:
            doc_id: The number search showed before the title.
        """
        if not 0 <= doc_id < self.num_documents:
            raise ToolError(f"no document {doc_id} (ids are 0 to {self.num_documents - 1})")
        return self.world.text(doc_id)

    @tool
    def answer(self, answer: str) -> str:
        """Give the final answer and end the episode.

        Args:
            answer: The name that answers the question.
        """
        return self.submit(answer)

    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        hops = self.hops = int(options.get("difficulty", self.difficulty))
        self.world, self.chain = make_world(
            self.np_random, self.num_documents, self.doc_sentences, hops
        )
        last = self.chain[-1]
        self.target = RIVERS[int(self.world.links[last])] if hops == 3 else self.world.title(last)
        question = QUESTIONS[hops].format(c=self.world.title(self.chain[0]))
        return [user(f"{question} Search the {self.num_documents} documents, then answer.")]

    def _grade(self, answer: Message) -> Outcome:
        given = normalize(answer.get("content", ""))
        success = given == normalize(self.target) or given == normalize(f"{self.target} river")
        return Outcome(
            success=success,
            details={"expected": self.target, "given": answer.get("content", "")[:200]},
        )


class RetrievalExpert:
    """Searches for each entity of the chain, opens its document, answers; `error_rate` of its
    episodes skip the last document and answer with a distractor."""

    def __init__(self, *, error_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.error_rate = error_rate
        self.rng = np.random.default_rng(seed)
        self._wrong = False

    def begin(self) -> None:
        self._wrong = bool(self.rng.random() < self.error_rate)

    def act(self, env: ToolEnv, history: list[Message]) -> Message:
        inner = env.unwrapped
        world, chain = inner.world, inner.chain
        hops = inner.hops
        step = sum(m["role"] == "assistant" for m in history)  # 0, 1, 2, ...
        if step < 2 * hops:
            doc = chain[step // 2]
            if step % 2 == 0:
                return assistant("", [tool_call("search", {"query": world.title(doc)})])
            return assistant("", [tool_call("open", {"doc_id": doc})])
        given = inner.target
        if self._wrong:
            given = world.title(int(self.rng.integers(len(world.kinds))))
        return assistant("", [tool_call("answer", {"answer": given})])
