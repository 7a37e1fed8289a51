"""A Hugging Face tokenizer: tokenizer.json through the ``tokenizers`` package, the chat
template through jinja2, both as ``transformers`` (5.x) reads a checkpoint directory.

What transformers' generic ``TokenizersBackend`` does, and so do we:

- tokenizer.json is the tokenizer: its normalizer, pre-tokenizer, model, post-processor
  (which adds BOS/EOS to a completion prompt) and added tokens. ``add_bos_token`` /
  ``add_eos_token`` in tokenizer_config.json are ignored when tokenizer.json exists
  (transformers drops them then); a tokenizer.json without a post-processor adds nothing.
- tokenizer_config.json names the special tokens (``bos_token``, ``eos_token``, ...;
  strings or AddedToken dicts), may add tokens (``added_tokens_decoder``,
  ``extra_special_tokens`` / ``additional_special_tokens``) that tokenizer.json lacks, and
  carries ``chat_template`` (a string, or named templates of which ``default`` is used),
  ``split_special_tokens`` and ``clean_up_tokenization_spaces``.
- chat_template.jinja, when present, is the chat template (it wins over the config's).
- A chat is rendered with the named special tokens as variables, then encoded without
  adding special tokens (the template writes them): ``apply_chat_template(messages,
  add_generation_prompt=True, tokenize=True)``.
- generation_config.json's ``eos_token_id`` (an int or a list) plus the tokenizer's
  ``eos_token`` end a generated sequence.

Model-specific tokenizer classes of transformers that rebuild a tokenizer from its vocabulary
(``tokenizer_class`` such as ``LlamaTokenizer`` with their own pre-tokenizer) are not
imitated: tokenizer.json is taken as written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from .base import ChatMessage, Detokenizer, Tokenizer, utf8
from .chat_template import compile_template, render

SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                            "cls_token", "mask_token")
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
             (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


@dataclass(frozen=True)
class TokenizerFiles:
    """The files of a checkpoint that define its tokenizer, as text and JSON."""

    tokenizer_json: str
    tokenizer_config: dict = field(default_factory=dict)
    generation_config: dict = field(default_factory=dict)
    chat_template: str | None = None  # chat_template.jinja, when the directory has one

    @classmethod
    def from_path(cls, path: str | Path) -> TokenizerFiles:
        """A checkpoint directory, or a tokenizer.json (its directory's other files are
        read too). ValueError saying what is missing or unreadable."""
        path = Path(path)
        if path.is_file():
            directory, tokenizer_json = path.parent, path
        else:
            directory, tokenizer_json = path, path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ValueError(f"{tokenizer_json} not found: a Hugging Face tokenizer needs "
                             "tokenizer.json (sentencepiece-only checkpoints are not "
                             "supported; convert them with transformers first)")
        template = directory / "chat_template.jinja"
        return cls(tokenizer_json=_read_text(tokenizer_json),
                   tokenizer_config=_read_json(directory / "tokenizer_config.json"),
                   generation_config=_read_json(directory / "generation_config.json"),
                   chat_template=_read_text(template) if template.is_file() else None)

    @classmethod
    def from_wire(cls, data: dict) -> TokenizerFiles:
        return cls(tokenizer_json=data["tokenizer_json"],
                   tokenizer_config=data.get("tokenizer_config") or {},
                   generation_config=data.get("generation_config") or {},
                   chat_template=data.get("chat_template"))


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8")  # no newline translation: exact content


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path))
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _content(value) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _added_token(value, special: bool) -> AddedToken:
    if isinstance(value, dict):
        return AddedToken(value["content"], single_word=value.get("single_word", False),
                          lstrip=value.get("lstrip", False), rstrip=value.get("rstrip", False),
                          normalized=value.get("normalized", not special),
                          special=value.get("special", special))
    return AddedToken(value, special=special, normalized=False)


class HFTokenizer(Tokenizer):
    """A checkpoint's tokenizer and chat template (see the module's docstring)."""

    name = "hf"

    def __init__(self, files: TokenizerFiles) -> None:
        self.files = files
        cfg = files.tokenizer_config
        try:
            self._tok = RustTokenizer.from_str(files.tokenizer_json)
        except Exception as exc:  # the Rust side raises plain Exception
            raise ValueError(f"tokenizer.json does not load: {exc}") from None
        self.special_tokens = {a: _content(cfg[a]) for a in SPECIAL_TOKEN_ATTRIBUTES
                               if _content(cfg.get(a)) is not None}
        self._add_config_tokens(cfg)
        self._tok.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        self._cleanup = bool(cfg.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE" or bool(cfg.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        self.chat_template = self._template_source(files, cfg)
        self._template = (compile_template(self.chat_template)
                          if self.chat_template is not None else None)
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self._eos_ids = self._eos_token_ids(files.generation_config)
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._fingerprint = self._compute_fingerprint()

    @classmethod
    def from_path(cls, path: str | Path) -> HFTokenizer:
        return cls(TokenizerFiles.from_path(path))

    # -- loading -----------------------------------------------------------------------

    def _add_config_tokens(self, cfg: dict) -> None:
        """Tokens the config declares and tokenizer.json lacks, added as transformers adds
        them: ``added_tokens_decoder`` in id order, then the named and extra special
        tokens (as special tokens)."""
        have = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        decoder = cfg.get("added_tokens_decoder") or {}
        missing = [_added_token(spec, bool(spec.get("special")))
                   for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0]))
                   if isinstance(spec, dict) and spec.get("content") not in have]
        if missing:
            self._tok.add_tokens(missing)
        extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        if isinstance(extra, dict):  # named extras: also template variables
            self.special_tokens.update({k: _content(v) for k, v in extra.items()
                                        if _content(v) is not None})
            extra = list(extra.values())
        specials = [cfg[a] for a in SPECIAL_TOKEN_ATTRIBUTES if _content(cfg.get(a))]
        specials += [v for v in extra if _content(v)]
        if specials:
            self._tok.add_special_tokens([_added_token(v, True) for v in specials])

    @staticmethod
    def _template_source(files: TokenizerFiles, cfg: dict) -> str | None:
        if files.chat_template is not None:
            return files.chat_template
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError("tokenizer_config.json has named chat templates "
                                 f"({', '.join(sorted(map(str, named)))}) but none is "
                                 "'default'; name the one to serve 'default'")
            template = named["default"]
        return template if isinstance(template, str) else None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _eos_token_ids(self, generation_config: dict) -> frozenset[int]:
        ids = generation_config.get("eos_token_id")
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return frozenset(int(i) for i in ids)

    def _compute_fingerprint(self) -> str:
        """Over what decides token ids and rendered chats: tokenizer.json's content (as
        parsed JSON: whitespace does not count), the effective added tokens, the special
        tokens, the template, the stop ids and the decoding switches."""
        canonical = json.dumps(json.loads(self.files.tokenizer_json), sort_keys=True,
                               separators=(",", ":"), ensure_ascii=False)
        added = sorted((i, t.content, t.special, t.lstrip, t.rstrip, t.single_word,
                        t.normalized) for i, t in self._tok.get_added_tokens_decoder().items())
        spec = {"kind": self.name,
                "tokenizer_json": hashlib.sha256(canonical.encode()).hexdigest(),
                "added_tokens": added, "special_tokens": self.special_tokens,
                "chat_template": self.chat_template, "eos_token_ids": sorted(self._eos_ids),
                "split_special_tokens": self._tok.encode_special_tokens,
                "cleanup": self._cleanup}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    # -- the interface -----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_ids

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # tokenizers' answer to a lone surrogate; say where it is
            utf8(text)
            raise

    def decode(self, ids: Sequence[int]) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=True)
        if self._cleanup:
            for old, new in _CLEANUPS:
                text = text.replace(old, new)
        return text

    def render_text(self, messages: Sequence[ChatMessage],
                    add_generation_prompt: bool = True) -> str:
        """The conversation through the chat template, as text."""
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template; send a "
                             "completion (prompt) instead")
        return render(self._template, [_message_dict(i, m) for i, m in enumerate(messages)],
                      add_generation_prompt, self.special_tokens)

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
                    ) -> list[int]:
        return self._encode(self.render_text(messages, add_generation_prompt),
                            add_special_tokens=False)

    def detokenizer(self) -> HFDetokenizer:
        return HFDetokenizer(self)

    def wire(self) -> dict:
        f = self.files
        return {"kind": "hf", "fingerprint": self.fingerprint,
                "tokenizer_json": f.tokenizer_json, "tokenizer_config": f.tokenizer_config,
                "generation_config": f.generation_config, "chat_template": f.chat_template}


def _message_dict(index: int, m: ChatMessage) -> dict:
    """A message as transformers hands it to a template: keys whose value is None left out,
    text parts as ``{"type": "text", "text": ...}``."""
    content = m.content
    for text in (content,) if isinstance(content, str) else content or ():
        try:
            utf8(text)
        except ValueError as exc:
            raise ValueError(f"message {index}: {exc}") from None
    out: dict = {"role": m.role}
    if isinstance(content, tuple):
        out["content"] = [{"type": "text", "text": t} for t in content]
    elif content is not None:
        out["content"] = content
    if m.name is not None:
        out["name"] = m.name
    return out


class HFDetokenizer(Detokenizer):
    """Incremental decoding by differences of two short decodes.

    Decoding a window that starts a few tokens back (``_prefix``) gives the text of the new
    tokens in context (spaces a decoder strips at the start of a text, merged bytes); what
    the window decodes to beyond the already emitted part (up to ``_read``) is the new text.
    While that ends in U+FFFD the last token ended inside a UTF-8 character, so it is held
    until the character is complete (or the sequence ends). Joined, the pieces are the
    decode of all the ids.
    """

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self._decode = tokenizer.decode
        self._ids: list[int] = []
        self._prefix = 0  # the window's start
        self._read = 0  # tokens before this are emitted

    def push(self, token: int) -> str:
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self._ids[self._prefix:]
        done = self._decode(window[: self._read - self._prefix])
        text = self._decode(window)
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]
