import pytest
from hypothesis import given, strategies as st

from text import (BOS, EOS, IM_END, IM_START, ByteTokenizer, ChatMessage,
                                IncrementalDecoder)

tok = ByteTokenizer()


@given(st.text())
def test_encode_decode_round_trip(text):
    ids = tok.encode(text)
    assert ids[0] == BOS and all(0 <= t < tok.vocab_size for t in ids)
    assert tok.decode(ids) == text


@given(st.text())
def test_incremental_decoding_equals_whole_decoding(text):
    dec = IncrementalDecoder()
    pieces = [dec.push(t) for t in tok.encode(text, add_bos=False)] + [dec.flush()]
    assert "".join(pieces) == text


@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text()),
                min_size=1, max_size=4))
def test_chat_template_is_a_prefix_of_longer_conversations(turns):
    messages = [ChatMessage(r, c) for r, c in turns]
    shorter = tok.render_chat(messages, add_generation_prompt=False)
    longer = tok.render_chat(messages + [ChatMessage("user", "more")])
    assert longer[: len(shorter)] == shorter  # what makes multi-turn prefix reuse work
    assert shorter.count(IM_START) == shorter.count(IM_END) == len(messages)


def test_chat_template_exact_tokens():
    ids = tok.render_chat([ChatMessage("user", "hi")])
    assert ids == [BOS, IM_START, *b"user\nhi", IM_END, ord("\n"), IM_START, *b"assistant\n"]


def test_unpaired_surrogates_are_refused_by_position():
    with pytest.raises(ValueError, match="unpaired surrogate U\\+D800 at character 2"):
        tok.encode("ab\ud800")
    with pytest.raises(ValueError, match="unpaired surrogate U\\+DC00 at character 0"):
        tok.encode_le32("\udc00x")
    with pytest.raises(ValueError, match="^message 1: text has an unpaired surrogate U\\+DBFF"):
        tok.render_chat_le32([ChatMessage("user", "fine"), ChatMessage("user", "\udbff")])
    assert tok.encode("\U0001F600") == [BOS, 0xF0, 0x9F, 0x98, 0x80]  # a pair is fine


def test_specials_do_not_decode_and_fingerprint_is_stable():
    assert tok.decode([BOS, 104, 105, EOS]) == "hi"
    assert tok.fingerprint == ByteTokenizer().fingerprint
    assert len(tok.fingerprint) == 16


@given(st.text(), st.booleans())
def test_wire_form_equals_token_ids(text, bos):
    from array import array
    assert array("I", tok.encode_le32(text, add_bos=bos)).tolist() == tok.encode(text, bos)


@given(st.lists(st.tuples(st.sampled_from(["system", "user", "tool"]), st.text()),
                max_size=4), st.booleans())
def test_chat_wire_form_is_the_template_token_by_token(turns, generation):
    from array import array
    messages = [ChatMessage(r, c) for r, c in turns]
    expected = [BOS]
    for m in messages:
        expected += [IM_START, *f"{m.role}\n{m.content}".encode(), IM_END, ord("\n")]
    if generation:
        expected += [IM_START, *b"assistant\n"]
    assert array("I", tok.render_chat_le32(messages, generation)).tolist() == expected
    assert tok.render_chat(messages, generation) == expected
