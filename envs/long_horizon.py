"""`agentrl/LongHorizon-v0`: multi-hop questions whose evidence the agent reads, whole document by
whole document, into its own context, so episodes grow to hundreds of thousands of tokens and past
a million.

Each seed generates an archive of `num_documents` documents in reading (chronological) order, each
about `doc_tokens` tokens of filler and background facts, and a chain question such as

    hops=1  Name the founder of Velkaro Works.
    hops=2  Name the city where the founder of Velkaro Works was born.
    hops=3  Name the river that flows through the city where the founder of Velkaro Works was born.
    hops=4+ ... the founder of Velkaro Works -> their mentor (hops - 3 times) -> birthplace -> river

Each hop's fact sits in its own document, `distance` documents after the previous hop's (in
`evidence_order="forward"`; "reverse" puts the last hop first, so every fact must be remembered
until the chain closes; "random" shuffles them). Titles are opaque ("Document 12 of 40: Letters"),
so nothing says where the evidence is: the agent reads the archive in order (`read_next`) and
keeps what it learns. Distractors (`distractors` per hop, 0-5):
- near misses: the same relation for similarly named entities, in the evidence's own document
  ("Velkaro Labs was founded by Ben Kamiro" next to "Velkaro Works was founded by Ana Kamiro");
- retracted claims: "It is a myth that Velkaro Works was founded by Dara Kamiro.", placed after
  the true fact (in a later document where there is one), so the most recent mention is wrong;
- filler that mentions the chain's entities, and background facts about other entities (3 in 8
  background sentences state a relation; `background_facts=False` makes them all filler, so the
  inserted sentences are the archive's only statements and a relation's words alone find its
  fact: the long-context reading stays, the look-alike keys go).
Answering from the last document read, from the question alone, or from the latest mention fails
(with distractors and background facts).

Tools: `list_documents(start)` (ids and titles, 200 a page), `read(doc_id)` and `read_next()`
(the WHOLE document text as the tool result) and `answer(answer)`. Success: the answer names the
right entity (case, punctuation, a leading "the" and a trailing "river" ignored). The outcome
details carry hops, distance, the evidence documents, and the documents, characters and tokens
(characters / 4) read. The prompt asks the agent to write the chain found so far before each
call ("Chain: Velkaro Works was founded by Ana Kamiro."); the scripted expert does (`chain_note`).
Only the answer is graded: the note earns nothing.

Size: a token here is 4 characters (the usual rule of thumb; the text averages 6.2 characters a
word, ~1.6 tokens, and a 768-token byte-level BPE trained on it gives 3.8 characters a token). A
document is `doc_tokens` x 4 characters of background plus its few inserted facts (~50 characters
each). Reading in order up to the last evidence document, the expert reads `start + (hops - 1) *
distance + 1` documents, `start` drawn uniformly from `0 .. num_documents - (hops - 1) * distance
- 1` (default num_documents: `(hops - 1) * distance + 1 + distance`). Measured (seeds 0-2):

    defaults (hops 2, distance 2, doc_tokens 100)      340-550 tokens of documents
    hops=3, distance=12, doc_tokens=4000                100K-121K tokens, 0.05 s
    hops=4, distance=20, doc_tokens=16000               0.98M-1.25M tokens, 0.4 s

Nothing but the chain (a few dozen names and inserted sentences) is kept per episode: a document's
text is generated on demand from (seed, doc_id), deterministic and memory-sane at any size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs import retrieval
from envs.base import ToolEnv
from envs.tools import MAX_RESULT_CHARS, ToolError, tool
from envs.types import Message, Outcome, assistant, tool_call, user

# the name parts of Retrieval-v0, shared so the two worlds read alike
SYL, FIRST = retrieval.SYL, retrieval.FIRST
COMPANY_SUFFIX, CITY_SUFFIX = retrieval.COMPANY, retrieval.CITY
# fmt: off
THEMES = ("Letters", "Ledger", "Minutes of the council", "Diary", "Chronicle", "Travel notes",
    "Court records", "Newspaper clippings", "Trade register", "Parish records")
# fmt: on
COMPANY, PERSON, CITY, RIVER = "company", "person", "city", "river"
STEM = len(SYL) ** 3  # 13824 three-syllable stems
SPACE = {COMPANY: 6 * STEM, PERSON: 16 * STEM, CITY: 6 * STEM, RIVER: STEM}

RELATIONS: dict[str, tuple[str, str]] = {  # relation: (subject kind, object kind)
    "founder": (COMPANY, PERSON),
    "mentor": (PERSON, PERSON),
    "birthplace": (PERSON, CITY),
    "river": (CITY, RIVER),
}
_RELATION_NAMES = tuple(RELATIONS)
TEMPLATES: dict[str, tuple[str, ...]] = {  # the true statements (and their paraphrases)
    "founder": ("{s} was founded by {o}.", "The founder of {s} was {o}."),
    "mentor": ("{s} trained under {o}.", "The mentor of {s} was {o}."),
    "birthplace": ("{s} was born in {o}.", "The birthplace of {s} is {o}."),
    "river": ("{s} lies on the {o} river.", "The {o} river flows through {s}."),
}
PHRASES = {  # how the question names the next entity of the chain
    "founder": "the founder of {x}",
    "mentor": "the mentor of {x}",
    "birthplace": "the city where {x} was born",
    "river": "the river that flows through {x}",
}
RETRACTED = (  # a false claim: a prefix and then a true-looking statement
    "It is a myth that ",
    "A retracted report claimed that ",
    "Contrary to an old rumour, it is not true that ",
)
FILLER = (
    "{a} is often compared with {b}.",
    "A report on {a} also mentions {b}.",
    "Visitors to {a} rarely hear about {b}.",
    "{a} was described in an old almanac next to {b}.",
    "Some say {a} owes a lot to {b}.",
    "Nobody could agree whether {a} or {b} deserved the prize that year.",
    "The weather that season was unremarkable.",
    "Prices at the market rose a little and then fell again.",
    "A letter from {a} was read aloud at the meeting.",
)
_WORD = re.compile(r"[a-z0-9]+")
_SENTENCE = re.compile(r"(?<=\.)\s+|\n+")
_NAME = r"([A-Z][A-Za-z]*(?: [A-Z][A-Za-z]*)*)"


def _pattern(template: str) -> tuple[re.Pattern[str], int, int]:
    """A template as a regex, with the group numbers of its subject and object."""
    regex = re.escape(template).replace(re.escape("{s}"), _NAME).replace(re.escape("{o}"), _NAME)
    s_first = template.index("{s}") < template.index("{o}")
    return re.compile(regex), (1 if s_first else 2), (2 if s_first else 1)


_PATTERNS = [(r, *_pattern(t)) for r, templates in TEMPLATES.items() for t in templates]


def _syllables(code: int, count: int = 3) -> str:
    parts = []
    for _ in range(count):
        code, digit = divmod(code, len(SYL))
        parts.append(SYL[digit])
    return "".join(parts).capitalize()


def name(kind: str, code: int) -> str:
    """The entity of `kind` numbered `code` (0 <= code < SPACE[kind])."""
    if kind == COMPANY:
        return f"{_syllables(code // 6)} {COMPANY_SUFFIX[code % 6]}"
    if kind == PERSON:
        return f"{FIRST[code % 16]} {_syllables(code // 16)}"
    if kind == CITY:
        return f"{_syllables(code // 6)}{CITY_SUFFIX[code % 6]}"
    return _syllables(code)


def near_misses(kind: str, code: int) -> list[int]:
    """Codes of similarly named entities: the same stem with another suffix (companies, cities),
    the same surname with another first name (people), the same first syllables (rivers)."""
    if kind in (COMPANY, CITY):
        return [code // 6 * 6 + k for k in range(6) if k != code % 6]
    if kind == PERSON:
        return [code // 16 * 16 + k for k in range(16) if k != code % 16]
    low = code % (len(SYL) ** 2)
    return [low + k * len(SYL) ** 2 for k in range(len(SYL)) if k != code // len(SYL) ** 2]


def normalize(text: str) -> str:
    words = _WORD.findall(text.lower())
    if words[:1] == ["the"]:
        words = words[1:]
    if words[-1:] == ["river"]:
        words = words[:-1]
    return " ".join(words)


def facts_in(text: str) -> Iterator[tuple[str, str, str]]:
    """The true statements of a document, as (relation, subject, object); retracted claims are
    skipped. This is all a reader needs: the scripted expert and the tests use it."""
    for sentence in _SENTENCE.split(text):
        if not sentence or sentence.startswith(RETRACTED):
            continue
        for relation, pattern, s, o in _PATTERNS:
            match = pattern.fullmatch(sentence)
            if match:
                yield relation, match.group(s), match.group(o)
                break


def chain_prefix(facts: dict[tuple[str, str], str], start: str, relations: list[str]) -> list[str]:
    """The chain's entities as far as `facts` ((relation, subject) -> object) resolve it: `start`,
    then each hop's object while its link is known (the longest resolvable prefix; all
    `len(relations) + 1` of them once the chain closes)."""
    entities = [start]
    for relation in relations:
        found = facts.get((relation, entities[-1]))
        if found is None:
            break
        entities.append(found)
    return entities


def resolve(facts: dict[tuple[str, str], str], start: str, relations: list[str]) -> str | None:
    """Follow the chain from `start` through `facts` ((relation, subject) -> object); None while a
    link is missing."""
    entities = chain_prefix(facts, start, relations)
    return entities[-1] if len(entities) == len(relations) + 1 else None


def chain_note(entities: list[str], relations: list[str]) -> str:
    """The running note the expert writes before each call: `Chain: <start>.` while no link is
    known, then each known link (`entities` from `chain_prefix`) in the env's own wording, one
    fixed template a relation: "Chain: Velkaro Works was founded by Ana Kamiro. Ana Kamiro was born
    in Tanmiford." Each note without its final "." starts the next one."""
    known = zip(relations, entities, entities[1:], strict=False)  # the links known so far
    links = [statement(relation, s, o, 0) for relation, s, o in known]
    return "Chain: " + (" ".join(links) if links else f"{entities[0]}.")


def relations_for(hops: int) -> list[str]:
    if hops <= 3:
        return ["founder", "birthplace", "river"][:hops]
    return ["founder", *["mentor"] * (hops - 3), "birthplace", "river"]


def question_for(start: str, relations: list[str]) -> str:
    phrase = start
    for relation in relations:
        phrase = PHRASES[relation].format(x=phrase)
    return f"Name {phrase}."


def statement(relation: str, subject: str, obj: str, variant: int) -> str:
    templates = TEMPLATES[relation]
    return templates[variant % len(templates)].format(s=subject, o=obj)


@dataclass(slots=True)
class Archive:
    """One seed's archive: the chain and its inserted sentences; the rest is generated on demand."""

    seed: int
    num_documents: int
    doc_chars: int
    relations: list[str]
    chain: list[str]
    """The chain's entities: the question's start, then each hop's answer (the last is the
    answer to the question)."""
    positions: list[int]
    """The document holding each hop's true fact."""
    inserts: dict[int, list[str]]
    """Inserted sentences (true facts and distractors) per document, in order of appearance."""
    reserved: frozenset[str]
    """Every name the chain and its distractors use: background facts never have these as
    subjects, so the only statements about them are the inserted ones."""
    decoys: list[str] = field(default_factory=list)
    """Wrong answers planted for the last hop (near misses and the retracted claim's value)."""
    background_facts: bool = True
    """Whether background sentences state relations between other entities (else only filler)."""

    def title(self, doc: int) -> str:
        theme = THEMES[int(np.random.default_rng([self.seed, doc, 1]).integers(len(THEMES)))]
        return f"Document {doc} of {self.num_documents}: {theme}"

    def _background_name(self, kind: str, code: int) -> str:
        code %= SPACE[kind]
        text = name(kind, code)
        while text in self.reserved:
            code = (code + 7) % SPACE[kind]
            text = name(kind, code)
        return text

    def _background(self, row: list[int]) -> str:
        pick, a, b, c = row
        if self.background_facts and pick % 8 < 3:  # a fact about entities outside the chain
            relation = _RELATION_NAMES[a % 4]
            subject_kind, object_kind = RELATIONS[relation]
            code = b % SPACE[subject_kind]
            # the same subject gets the same object in every document: the archive is consistent
            obj = (code * 2654435761 + 7919 * (a % 4) + self.seed) % SPACE[object_kind]
            subject = self._background_name(subject_kind, code)
            return statement(relation, subject, self._background_name(object_kind, obj), pick)
        template = FILLER[a % len(FILLER)]
        kinds = (COMPANY, PERSON, CITY)
        first = self._background_name(kinds[b % 3], c)
        if pick % 16 == 5:  # the chain's entities turn up in filler too
            first = self.chain[b % len(self.chain)]
        return template.format(a=first, b=self._background_name(kinds[c % 3], b))

    def text(self, doc: int) -> str:
        """The whole document (the same text every time)."""
        rng = np.random.default_rng([self.seed, doc])
        inserted = self.inserts.get(doc, [])
        budget = self.doc_chars - sum(len(s) + 1 for s in inserted)
        sentences: list[str] = []
        while budget > 0:
            for row in rng.integers(0, 2**31, size=(budget // 40 + 4, 4)).tolist():
                sentences.append(self._background(row))
                budget -= len(sentences[-1]) + 1
                if budget <= 0:
                    break
        slots = np.sort(rng.integers(0, len(sentences) + 1, size=len(inserted))).tolist()
        for offset, (slot, sentence) in enumerate(zip(slots, inserted, strict=True)):
            sentences.insert(slot + offset, sentence)
        paragraphs = [" ".join(sentences[i : i + 8]) for i in range(0, len(sentences), 8)]
        return "\n\n".join([self.title(doc), *paragraphs])


class _Names:
    """Draws distinct names; every name it gave is `used` (the archive's reserved names)."""

    def __init__(self, rng: np.random.Generator):
        self.rng, self.used = rng, set[str]()

    def fresh(self, kind: str, codes: Iterable[int] = ()) -> tuple[str, int]:
        """An unused name of `kind`: one of `codes` (near misses) while any is left, else any."""
        pool = [c for c in codes if name(kind, c) not in self.used]
        while True:
            code = int(self.rng.integers(SPACE[kind]))
            if pool:
                code = pool[int(self.rng.integers(len(pool)))]
            text = name(kind, code)
            if text not in self.used:
                self.used.add(text)
                return text, code


def _slots(rng: np.random.Generator, hops: int, distance: int, num_documents: int, order: str):
    """The document of each hop's fact: `distance` apart, in the given order of hops."""
    first = int(rng.integers(num_documents - (hops - 1) * distance))
    slots = [first + i * distance for i in range(hops)]
    if order == "reverse":
        return slots[::-1]
    if order == "random":
        return [slots[i] for i in rng.permutation(hops)]
    return slots


def _retracted(rng: np.random.Generator, relation: str, subject: str, wrong: str) -> str:
    claim = statement(relation, subject, wrong, int(rng.integers(2)))
    if claim.startswith("The "):
        claim = "t" + claim[1:]
    return RETRACTED[int(rng.integers(len(RETRACTED)))] + claim


def make_archive(
    rng: np.random.Generator,
    *,
    hops: int,
    distance: int,
    num_documents: int,
    doc_chars: int,
    distractors: int,
    evidence_order: str,
    background_facts: bool = True,
) -> Archive:
    """Draw one archive's chain, where its facts go and its distractors (nothing else is kept)."""
    relations = relations_for(hops)
    names = _Names(rng)
    chain = [names.fresh(COMPANY)]
    chain += [names.fresh(RELATIONS[relation][1]) for relation in relations]
    slots = _slots(rng, hops, distance, num_documents, evidence_order)
    last = max(slots)
    facts: dict[int, list[str]] = {}
    retracted: dict[int, list[str]] = {}
    decoys: list[str] = []
    for hop, relation in enumerate(relations):
        (subject, s_code), (obj, o_code) = chain[hop], chain[hop + 1]
        s_kind, o_kind = RELATIONS[relation]
        doc, wrongs = slots[hop], []
        facts.setdefault(doc, []).append(statement(relation, subject, obj, int(rng.integers(2))))
        for _ in range(distractors):  # near misses, in the same document
            other, _ = names.fresh(s_kind, near_misses(s_kind, s_code))
            wrongs.append(names.fresh(o_kind, near_misses(o_kind, o_code))[0])
            facts[doc].append(statement(relation, other, wrongs[-1], int(rng.integers(2))))
        if distractors:  # a retracted claim about the true subject, after the true fact
            wrongs.append(names.fresh(o_kind, near_misses(o_kind, o_code))[0])
            later = int(rng.integers(doc + 1, last + 1)) if doc < last else doc
            retracted.setdefault(later, []).append(_retracted(rng, relation, subject, wrongs[-1]))
        if hop == hops - 1:
            decoys = wrongs
    inserts: dict[int, list[str]] = {}
    for doc in sorted(set(facts) | set(retracted)):  # retracted claims after the true facts
        shown, later = facts.get(doc, []), retracted.get(doc, [])
        inserts[doc] = [shown[i] for i in rng.permutation(len(shown))]
        inserts[doc] += [later[i] for i in rng.permutation(len(later))]
    return Archive(
        seed=int(rng.integers(2**62)),
        num_documents=num_documents,
        doc_chars=doc_chars,
        relations=relations,
        chain=[text for text, _ in chain],
        positions=slots,
        inserts=inserts,
        reserved=frozenset(names.used),
        decoys=decoys,
        background_facts=background_facts,
    )


class LongHorizonEnv(ToolEnv):
    """Read a long archive, whole documents at a time, and answer a chain question whose links
    sit in documents far apart."""

    expert = "envs.long_horizon:LongHorizonExpert"

    def __init__(
        self,
        *,
        hops: int = 2,
        distance: int = 2,
        doc_tokens: int = 100,
        num_documents: int | None = None,
        distractors: int = 2,
        evidence_order: str = "forward",
        background_facts: bool = True,
        max_turns: int | None = None,
        tool_timeout_s: float | None = 30.0,
        render_mode: str | None = None,
    ):
        if not 1 <= hops <= 16:
            raise ValueError(f"hops must be in [1, 16], got {hops}")
        if not 1 <= distance <= 100_000:
            raise ValueError(f"distance must be in [1, 100000], got {distance}")
        if not 20 <= doc_tokens <= 1_000_000:
            raise ValueError(f"doc_tokens must be in [20, 1000000], got {doc_tokens}")
        if not 0 <= distractors <= 5:
            raise ValueError(f"distractors must be in [0, 5], got {distractors}")
        if evidence_order not in ("forward", "reverse", "random"):
            raise ValueError(
                f"evidence_order must be 'forward', 'reverse' or 'random', got {evidence_order!r}"
            )
        if not isinstance(background_facts, bool):
            raise ValueError(f"background_facts must be true or false, got {background_facts!r}")
        span = (hops - 1) * distance + 1
        if num_documents is None:
            num_documents = span + distance
        if not span <= num_documents <= 200_000:
            raise ValueError(
                f"num_documents must be in [{span}, 200000] ((hops - 1) * distance + 1 documents "
                f"hold the evidence), got {num_documents}"
            )
        turns = max_turns if max_turns is not None else num_documents + 2
        super().__init__(max_turns=turns, tool_timeout_s=tool_timeout_s, render_mode=render_mode)
        self.hops, self.distance, self.doc_tokens = hops, distance, doc_tokens
        self.num_documents, self.distractors = num_documents, distractors
        self.evidence_order, self.background_facts = evidence_order, background_facts
        # whole documents are the point: no result of ours is ever cut
        self.toolbox.max_result_chars = max(MAX_RESULT_CHARS, 8 * doc_tokens + 65536)
        self.archive: Archive | None = None
        self.target = ""
        self.question = ""
        self._cursor = -1
        self._docs_read: list[int] = []
        self._chars_read = 0

    # --- tools ------------------------------------------------------------------------------
    @tool
    def list_documents(self, start: int = 0) -> str:
        """List document ids and titles, 200 at a time (the archive is in chronological order).

        Args:
            start: The first id to list (0 for the beginning).
        """
        if not 0 <= start < self.num_documents:
            raise ToolError(f"no document {start} (ids are 0 to {self.num_documents - 1})")
        stop = min(start + 200, self.num_documents)
        lines = [self.archive.title(doc) for doc in range(start, stop)]
        if stop < self.num_documents:
            lines.append(f"... {self.num_documents - stop} more (list_documents start={stop})")
        return "\n".join(lines)

    @tool
    def read(self, doc_id: int) -> str:
        """Read a whole document; read_next then continues after it.

        Args:
            doc_id: The document's id (0 to the number of documents - 1).
        """
        if not 0 <= doc_id < self.num_documents:
            raise ToolError(f"no document {doc_id} (ids are 0 to {self.num_documents - 1})")
        return self._read(doc_id)

    @tool
    def read_next(self) -> str:
        """Read the whole next document: the one after the last one read (at first, document 0)."""
        if self._cursor + 1 >= self.num_documents:
            raise ToolError(f"the archive ends with document {self.num_documents - 1}")
        return self._read(self._cursor + 1)

    @tool
    def answer(self, answer: str) -> str:
        """Give the final answer and end the episode.

        Args:
            answer: The name that answers the question.
        """
        return self.submit(answer)

    def _read(self, doc: int) -> str:
        text = self.archive.text(doc)
        self._cursor = doc
        self._docs_read.append(doc)
        self._chars_read += len(text)
        return text

    # --- task -------------------------------------------------------------------------------
    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        self.archive = make_archive(
            self.np_random,
            hops=self.hops,
            distance=self.distance,
            num_documents=self.num_documents,
            doc_chars=4 * self.doc_tokens,
            distractors=self.distractors,
            evidence_order=self.evidence_order,
            background_facts=self.background_facts,
        )
        self.target = self.archive.chain[-1]
        self.question = question_for(self.archive.chain[0], self.archive.relations)
        self._cursor, self._docs_read, self._chars_read = -1, [], 0
        return [
            user(
                f"{self.question} The archive holds {self.num_documents} documents (ids 0 to "
                f"{self.num_documents - 1}) in chronological order; the facts you need are in "
                "different documents, far apart. Read the documents in order with read_next (or "
                "read one by id), remember what you learn, then call answer. Before each tool "
                "call, write the chain you have found so far, as `Chain: ...`. Claims called "
                "myths, rumours or retractions are false."
            )
        ]

    def _grade(self, answer: Message) -> Outcome:
        given = answer.get("content", "")
        return Outcome(
            success=normalize(given) == normalize(self.target),
            details={
                "expected": self.target,
                "given": given[:200],
                "hops": self.hops,
                "distance": self.distance,
                "num_documents": self.num_documents,
                "evidence_docs": list(self.archive.positions),
                "docs_read": len(self._docs_read),
                "chars_read": self._chars_read,
                "tokens_read": self._chars_read // 4,
            },
        )


class LongHorizonExpert:
    """Reads the archive in order with `read_next`, collecting the true statements it sees (and
    skipping retracted ones), until the question's chain can be followed to its end; then answers.
    Before each call it writes the chain found so far (`chain_note`: the question's start, then
    each link known), so every decision depends on one look-up keyed by what it just wrote. It
    never looks at where the evidence is: only at the question's start and relations and the text
    it read. `error_rate` of its episodes answer with a planted distractor instead (a near miss or
    the retracted claim's value, both in documents already read), written as the note's last link
    too, so note and answer agree."""

    def __init__(self, *, error_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.error_rate = error_rate
        self.rng = np.random.default_rng(seed)
        self._wrong = False
        self._facts: dict[tuple[str, str], str] = {}
        self._seen = 0

    def begin(self) -> None:
        self._wrong = bool(self.rng.random() < self.error_rate)
        self._facts, self._seen = {}, 0

    def act(self, env: ToolEnv, history: list[Message]) -> Message:
        inner = env.unwrapped
        archive = inner.archive
        if len(history) < self._seen:  # a new history: read it from the start
            self._facts, self._seen = {}, 0
        for message in history[self._seen :]:
            if message.get("role") == "tool" and message.get("name") in ("read", "read_next"):
                for relation, subject, obj in facts_in(message["content"]):
                    self._facts[(relation, subject)] = obj
        self._seen = len(history)
        relations = archive.relations
        entities = chain_prefix(self._facts, archive.chain[0], relations)
        closed = len(entities) == len(relations) + 1
        ended = bool(history) and str(history[-1].get("content", "")).startswith(
            "Error: the archive ends"
        )
        if not closed and not ended:
            return assistant(chain_note(entities, relations), [tool_call("read_next", {})])
        if closed and self._wrong and archive.decoys:  # a misreading of the last link
            entities[-1] = archive.decoys[int(self.rng.integers(len(archive.decoys)))]
        note = chain_note(entities, relations)
        return assistant(note, [tool_call("answer", {"answer": entities[-1]})])
