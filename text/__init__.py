"""Tokenizers behind one interface (``Tokenizer``): byte-level (the default, no files) and
Hugging Face (tokenizer.json + chat template). Shared by the replicas, the router and the
load tests (the router imports nothing from ``replicas``); it needs ``tokenizers``, ``jinja2``
and numpy, never torch."""

from __future__ import annotations

from pathlib import Path

from .base import ChatMessage, Detokenizer, Tokenizer, le32, utf8
from .byte_level import (BOS, EOS, IM_END, IM_START, ROLES, SPECIAL_TOKENS, TEMPLATE_VERSION,
                         VOCAB_SIZE, ByteTokenizer, IncrementalDecoder)
from .hf import HFDetokenizer, HFTokenizer, TokenizerFiles

__all__ = ["BOS", "EOS", "IM_END", "IM_START", "ROLES", "SPECIAL_TOKENS", "TEMPLATE_VERSION",
           "VOCAB_SIZE", "ByteTokenizer", "ChatMessage", "Detokenizer", "HFDetokenizer",
           "HFTokenizer", "IncrementalDecoder", "Tokenizer", "TokenizerFiles", "le32",
           "load_tokenizer", "tokenizer_from_wire", "utf8"]


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The Hugging Face tokenizer of a checkpoint directory (or of a tokenizer.json and
    the files beside it); the byte-level one for None."""
    return ByteTokenizer() if path is None else HFTokenizer.from_path(path)


def tokenizer_from_wire(data: dict) -> Tokenizer:
    """The tokenizer a replica's ``GET /tokenizer`` describes; ValueError if the answer is
    not one, or if what it builds has another fingerprint than the replica announced."""
    kind = data.get("kind")
    if kind == "byte-level":
        tok: Tokenizer = ByteTokenizer()
    elif kind == "hf":
        try:
            tok = HFTokenizer(TokenizerFiles.from_wire(data))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a tokenizer description: {type(exc).__name__}: {exc}"
                             ) from None
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte-level' or 'hf'")
    if data.get("fingerprint") != tok.fingerprint:
        raise ValueError(f"the tokenizer built from the answer has fingerprint "
                         f"{tok.fingerprint!r}, not the announced {data.get('fingerprint')!r}")
    return tok
