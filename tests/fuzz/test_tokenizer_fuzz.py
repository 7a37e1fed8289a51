"""Hypothesis fuzzing of the byte-level tokenizer, the incremental decoder and the chat template."""

from __future__ import annotations

import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from text import (BOS, IM_END, IM_START, ROLES, SPECIAL_TOKENS, VOCAB_SIZE,
                                ByteTokenizer, ChatMessage, IncrementalDecoder)

tok = ByteTokenizer()
any_tokens = st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=64)
messages = st.lists(st.builds(ChatMessage, role=st.sampled_from(ROLES), content=st.text()),
                    max_size=6)

# Each run draws examples of its own (a fixed seed would replay the same ones forever),
# except in CI (CI set), where the same examples every run keep a failure reproducible.
IN_CI = bool(os.environ.get("CI"))


@given(st.text(), st.booleans())
def test_encode_decode_round_trip(text, add_bos):
    ids = tok.encode(text, add_bos=add_bos)
    assert all(0 <= t < VOCAB_SIZE for t in ids)
    assert (ids[:1] == [BOS]) == add_bos
    assert tok.decode(ids) == text


@given(any_tokens)
def test_decode_never_raises_and_drops_specials(ids):
    assert tok.decode(ids) == bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def _stream(ids) -> str:
    dec = IncrementalDecoder()
    return "".join(dec.push(t) for t in ids) + dec.flush()


@given(any_tokens)
def test_incremental_decoder_never_raises(ids):
    assert isinstance(_stream(ids), str)


@settings(derandomize=IN_CI, database=None)
@example(ids=[0xC2, 0xC2, 0x80])
@given(any_tokens)
def test_incremental_decoder_matches_bytes_decode(ids):
    assert _stream(ids) == bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


@given(st.text())
def test_incremental_decoder_streams_valid_text_losslessly(text):
    dec = IncrementalDecoder()
    pieces = [dec.push(t) for t in tok.encode(text, add_bos=False)]
    assert "".join(pieces) == text and dec.flush() == ""
    assert all("\ufffd" not in p for p in pieces if "\ufffd" not in text)


@given(messages, st.booleans())
def test_render_chat_known_roles(msgs, add_generation_prompt):
    ids = tok.render_chat(msgs, add_generation_prompt=add_generation_prompt)
    assert all(0 <= t < VOCAB_SIZE for t in ids)
    assert ids[0] == BOS
    assert ids.count(IM_START) == len(msgs) + add_generation_prompt
    assert ids.count(IM_END) == len(msgs)
    expected = "".join(f"{m.role}\n{m.content}\n" for m in msgs)
    if add_generation_prompt:
        expected += "assistant\n"
    assert tok.decode(ids) == expected
    assert tok.render_chat(msgs, add_generation_prompt) == ids  # deterministic


@settings(max_examples=200)
@given(st.lists(st.builds(ChatMessage, role=st.sampled_from(ROLES), content=st.text()),
                max_size=3),
       st.text().filter(lambda r: r not in ROLES), st.text())
def test_render_chat_unknown_role_raises(before, role, content):
    with pytest.raises(ValueError) as info:
        tok.render_chat([*before, ChatMessage(role, content)])
    message = str(info.value)
    assert repr(role) in message
    assert all(r in message for r in ROLES)


def test_special_tokens_are_in_vocab():
    assert sorted(SPECIAL_TOKENS.values()) == list(range(256, VOCAB_SIZE))
