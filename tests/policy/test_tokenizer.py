"""The offline-built tokenizer: digits one per token, and with `split_spaces` a word is the same
token in prose and inside a JSON string (what a small model needs to copy it into a call)."""

from __future__ import annotations

from policy.tokenizer import build_tokenizer

PROSE = "How warm is it in Kyiv today, in degrees Fahrenheit?"
CALL = '{"city": "Kyiv", "celsius": -12}'
CORPUS = [f"{PROSE} {CALL} Is it warm in Oslo? " + '{"city": "Oslo"}'] * 50


def pieces(tokenizer, text: str) -> list[str]:
    return [tokenizer.decode([i]) for i in tokenizer(text)["input_ids"]]


def test_split_spaces_makes_a_word_one_token_in_prose_and_in_json():
    plain = build_tokenizer(CORPUS, vocab_size=320)
    split = build_tokenizer(CORPUS, vocab_size=320, split_spaces=True)
    assert " Kyiv" in pieces(plain, PROSE) and "Kyiv" in pieces(plain, CALL)  # two tokens
    assert "Kyiv" in pieces(split, PROSE) and "Kyiv" in pieces(split, CALL)
    assert " Kyiv" not in pieces(split, PROSE)
    for text in (PROSE, CALL, "  two  spaces\tand a tab\n"):
        assert split.decode(split(text)["input_ids"]) == text  # lossless


def test_digits_are_one_per_token():
    for split_spaces in (False, True):
        tokenizer = build_tokenizer(CORPUS, vocab_size=320, split_spaces=split_spaces)
        assert [p for p in pieces(tokenizer, "-12 and 2026") if p.strip().isdigit()] == [
            "1",
            "2",
            "2",
            "0",
            "2",
            "6",
        ]
