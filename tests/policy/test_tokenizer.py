"""The offline-built tokenizer: digits one per token (numbers copy digit by digit), lossless."""

from __future__ import annotations

from policy.tokenizer import build_tokenizer

PROSE = "How warm is it in Kyiv today, in degrees Fahrenheit?"
CALL = '{"city": "Kyiv", "celsius": -12}'
CORPUS = [f"{PROSE} {CALL} Is it warm in Oslo? " + '{"city": "Oslo"}'] * 50


def test_digits_are_one_per_token_and_text_round_trips():
    tokenizer = build_tokenizer(CORPUS, vocab_size=320)
    pieces = [tokenizer.decode([i]) for i in tokenizer("-12 and 2026")["input_ids"]]
    assert [p for p in pieces if p.strip().isdigit()] == ["1", "2", "2", "0", "2", "6"]
    for text in (PROSE, CALL, "  two  spaces\tand a tab\n"):
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
