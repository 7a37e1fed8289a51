"""The Hugging Face tokenizer against transformers itself (the oracle): the same ids for
text and for chats through each family's template, the same text back, streaming that never
splits a character, and the files' rules (chat_template.jinja, generation_config, tokens
only the config declares)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from text import (ByteTokenizer, ChatMessage, HFTokenizer, tokenizer_from_wire)
from text.chat_template import TemplateRefused

from . import hf_checkpoints as ckpt

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello, how are you?", "  leading and trailing spaces  ", "",
         "Caf\u00e9 cr\u00e8me \u65e5\u672c\u8a9e \U0001F600\U0001F680 \u2211x",
         "specials inline: <|im_start|>user<|im_end|> <s>x</s> <|eot_id|>",
         "new\nlines\n\n\ttabs", "\u00e9\u00e9\u00e9\U0001F600\U0001F600\u65e5"]

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hello there"}],
    "system, user, assistant, user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And \u65e5\u672c\u8a9e? \U0001F600"}],
    "text parts": [{"role": "user", "content": [{"type": "text", "text": "two "},
                                                {"type": "text", "text": "parts \u00e9"}]}],
    "user, assistant, user": [
        {"role": "user", "content": "  spaced  "}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Caf\u00e9 <|im_end|> inside"}],
    "empty content and a name": [{"role": "user", "content": "", "name": "ann"},
                                 {"role": "user", "content": "x"}],
}
# which conversations each family's template accepts (Mistral's: alternating user and
# assistant, string content)
ACCEPTS = {"llama3": set(CONVERSATIONS), "chatml": set(CONVERSATIONS),
           "json": set(CONVERSATIONS), "mistral": {"one user turn", "user, assistant, user"}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: make(root / name) for name, make in ckpt.FAMILIES.items()}


@pytest.fixture(scope="module")
def pairs(checkpoints):
    """(ours, transformers') per family."""
    return {name: (HFTokenizer.from_path(path),
                   transformers.AutoTokenizer.from_pretrained(str(path)))
            for name, path in checkpoints.items()}


def ours_messages(messages: list[dict]) -> list[ChatMessage]:
    out = []
    for m in messages:
        c = m.get("content")
        content = c if isinstance(c, str) or c is None else tuple(p["text"] for p in c)
        out.append(ChatMessage(m["role"], content, m.get("name")))
    return out


def oracle_chat(theirs, messages, add_generation_prompt=True) -> list[int]:
    return theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                      tokenize=True, return_dict=False)


@pytest.mark.parametrize("family", sorted(ckpt.FAMILIES))
def test_encode_and_decode_equal_transformers(pairs, family):
    ours, theirs = pairs[family]
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert array_ids(ours.encode_le32(text)) == ids
    every_id = list(range(ours.vocab_size))
    assert ours.decode(every_id) == theirs.decode(every_id, skip_special_tokens=True)
    assert ours.vocab_size == len(theirs)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id


def array_ids(wire: bytes) -> list[int]:
    from array import array
    return array("I", wire).tolist()


@pytest.mark.parametrize("family", sorted(ckpt.FAMILIES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation", [True, False])
def test_chat_ids_equal_apply_chat_template(pairs, family, conversation, generation):
    ours, theirs = pairs[family]
    messages = CONVERSATIONS[conversation]
    if conversation not in ACCEPTS[family]:
        with pytest.raises(Exception):
            oracle_chat(theirs, messages, generation)
        with pytest.raises(ValueError, match="the chat template"):
            ours.render_chat(ours_messages(messages), generation)
        return
    want = oracle_chat(theirs, messages, generation)
    assert ours.render_chat(ours_messages(messages), generation) == want
    assert array_ids(ours.render_chat_le32(ours_messages(messages), generation)) == want
    assert ours.render_text(ours_messages(messages), generation) == theirs.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=False)


def test_exact_llama3_rendering(pairs):
    ours, _ = pairs["llama3"]
    text = ours.render_text([ChatMessage("system", " s "), ChatMessage("user", "hi")])
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\ns<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = ours.render_chat([ChatMessage("user", "hi")])
    assert ids[0] == ours.bos_token_id and ids.count(ours.bos_token_id) == 1  # no second BOS


def test_raise_exception_is_a_value_error_with_the_templates_message(pairs):
    ours, theirs = pairs["mistral"]
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        oracle_chat(theirs, messages)
    with pytest.raises(TemplateRefused, match="^the chat template refused the messages: "
                                              "Conversation roles must alternate"):
        ours.render_chat(ours_messages(messages))
    with pytest.raises(ValueError, match="Only user and assistant roles are supported"):
        ours.render_chat([ChatMessage("user", "a"), ChatMessage("system", "x")])


# some characters the tokenizers were trained on, some not (byte fallback, lone bytes)
MULTIBYTE = ("\u00e9t\u00e9 \u65e5\u672c\u8a9e\U0001F600 na\u00efve \u2211\u221e! "
             "\u00fcber \u4e16\u754c\U0001F389\U0001F9EA \u0416")


@pytest.mark.parametrize("family", sorted(ckpt.FAMILIES))
def test_streaming_never_splits_a_character(pairs, family):
    ours, theirs = pairs[family]
    ids = ours._encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE) // 2  # many characters take several tokens here
    single = [t for t in ids if "\ufffd" in ours.decode([t])]
    assert single, "the text should have characters split across tokens"
    for k in range(len(ids) + 1):
        dec = ours.detokenizer()
        pieces = [dec.push(t) for t in ids[:k]]
        streamed = "".join(pieces)
        assert "\ufffd" not in streamed, (k, pieces)
        assert MULTIBYTE.startswith(streamed), (k, pieces)
        whole = theirs.decode(ids[:k], skip_special_tokens=True)
        if "\ufffd" not in whole:  # cut between characters: exactly transformers' text
            assert streamed + dec.flush() == whole
        # (cut inside one, a byte-fallback decoder turns the whole run of byte tokens
        # into U+FFFDs, what was streamed included: no stream can take text back)
    dec = ours.detokenizer()
    assert "".join(dec.push(t) for t in ids) == MULTIBYTE and dec.flush() == ""


def test_streaming_skips_special_tokens_and_keeps_spaces(pairs):
    ours, _ = pairs["mistral"]  # its decoder strips the first space of a text
    ids = ours.encode("Hello there, caf\u00e9") + [ours.eos_token_id]
    dec = ours.detokenizer()
    pieces = [dec.push(t) for t in ids]
    assert "".join(pieces) + dec.flush() == "Hello there, caf\u00e9" == ours.decode(ids)
    assert pieces[-1] == ""  # the eos adds no text


def test_chat_template_jinja_file_wins_over_the_config(tmp_path):
    path = ckpt.chatml(tmp_path / "qwen", template_file=True)
    ours = HFTokenizer.from_path(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    messages = CONVERSATIONS["system, user, assistant, user"]
    assert ours.chat_template == ckpt.CHATML_TEMPLATE
    assert ours.render_chat(ours_messages(messages)) == oracle_chat(theirs, messages)
    # the path of tokenizer.json names the same tokenizer (its directory's files)
    assert HFTokenizer.from_path(path / "tokenizer.json").fingerprint == ours.fingerprint


def test_eos_token_ids_from_generation_config_and_the_tokenizer(pairs, tmp_path):
    llama, _ = pairs["llama3"]
    tok = llama._tok
    assert llama.eos_token_ids == {tok.token_to_id("<|end_of_text|>"),
                                   tok.token_to_id("<|eot_id|>")}
    path = ckpt.llama3(tmp_path / "l3")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert HFTokenizer.from_path(path).eos_token_ids == {1, tok.token_to_id("<|eot_id|>")}
    (path / "generation_config.json").unlink()
    assert HFTokenizer.from_path(path).eos_token_ids == {tok.token_to_id("<|eot_id|>")}


def test_tokens_only_the_config_declares_and_add_bos_token(tmp_path):
    """A config naming special tokens and added tokens tokenizer.json lacks, and asking
    for add_bos_token: transformers adds the tokens and ignores add_bos_token (tokenizer.json
    decides what encode adds); so do we."""
    path = ckpt.chatml(tmp_path / "extra")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(bos_token="<|bos|>", add_bos_token=True, additional_special_tokens=["<|x|>"],
                  added_tokens_decoder={**config["added_tokens_decoder"], "500": {
                      "content": "<think>", "special": False, "normalized": False,
                      "lstrip": False, "rstrip": False, "single_word": False}})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = HFTokenizer.from_path(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    for text in ["<|bos|>a<think>b<|x|>c", "plain"]:
        assert ours.encode(text) == theirs.encode(text)
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(theirs)
    messages = CONVERSATIONS["one user turn"]
    assert ours.render_chat(ours_messages(messages)) == oracle_chat(theirs, messages)


def test_strftime_now_and_special_token_variables(tmp_path):
    path = ckpt.chatml(tmp_path / "date")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{{ pad_token }}{{ eos_token }}{{ strftime_now('%Y') }}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}"
                               "{% generation %}{{ bos_token is defined }}{% endgeneration %}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = HFTokenizer.from_path(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    messages = CONVERSATIONS["one user turn"]
    assert ours.render_chat(ours_messages(messages)) == oracle_chat(theirs, messages)


def test_refusals_say_what_is_wrong(tmp_path, pairs):
    path = ckpt.chatml(tmp_path / "none")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template; send a completion"):
        HFTokenizer.from_path(path).render_chat([ChatMessage("user", "x")])
    with pytest.raises(ValueError, match="tokenizer.json not found"):
        HFTokenizer.from_path(tmp_path)
    ours, _ = pairs["chatml"]
    with pytest.raises(ValueError, match="unpaired surrogate U\\+D800 at character 2"):
        ours.encode("ab\ud800")
    with pytest.raises(ValueError, match="^message 1: text has an unpaired surrogate"):
        ours.render_chat([ChatMessage("user", "ok"), ChatMessage("user", ("a", "\udc00"))])
    config["chat_template"] = "{% for m in messages %}{{ m.content }"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the chat template does not parse: line 1"):
        HFTokenizer.from_path(path)
    config["chat_template"] = "{{ ''.__class__.__mro__ }}"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TemplateRefused):  # the sandbox
        HFTokenizer.from_path(path).render_text([ChatMessage("user", "x")])


def test_fingerprint_covers_tokenizer_template_and_specials(checkpoints, tmp_path, pairs):
    prints = {name: ours.fingerprint for name, (ours, _) in pairs.items()}
    assert len(set(prints.values())) == len(prints)
    assert ByteTokenizer().fingerprint not in prints.values()
    path = ckpt.chatml(tmp_path / "fp")
    base = HFTokenizer.from_path(path).fingerprint
    assert base == prints["chatml"]  # the same files, written again: the same print
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json, indent=4))
    assert HFTokenizer.from_path(path).fingerprint == base  # whitespace does not count
    config = json.loads((path / "tokenizer_config.json").read_text())
    for change in ({"chat_template": ckpt.CHATML_TEMPLATE + " "}, {"eos_token": "<|endoftext|>"}):
        (path / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
        assert HFTokenizer.from_path(path).fingerprint != base, change
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert HFTokenizer.from_path(path).fingerprint != base


def test_wire_form_builds_the_same_tokenizer(pairs):
    for ours, _ in pairs.values():
        data = json.loads(json.dumps(ours.wire()))
        again = tokenizer_from_wire(data)
        assert again.fingerprint == ours.fingerprint
        assert again.encode(MULTIBYTE) == ours.encode(MULTIBYTE)
        with pytest.raises(ValueError, match="not the announced"):
            tokenizer_from_wire({**data, "fingerprint": "0" * 16})
    byte = tokenizer_from_wire(ByteTokenizer().wire())
    assert isinstance(byte, ByteTokenizer)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        tokenizer_from_wire({"kind": "sentencepiece"})


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@pytest.mark.parametrize("family", ["llama3", "mistral"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, content=TEXT)
def test_any_text_encodes_renders_and_streams_as_transformers(pairs, family, text, content):
    ours, theirs = pairs[family]
    assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": content}]
    assert ours.render_chat(ours_messages(messages)) == oracle_chat(theirs, messages)
    ids = ours.encode(text)
    dec = ours.detokenizer()
    pieces = [dec.push(t) for t in ids]
    assert "".join(pieces) + dec.flush() == theirs.decode(ids, skip_special_tokens=True)
