"""Kept for older imports: the byte-level tokenizer now lives in ``replicas.text``."""

from .text.base import ChatMessage, utf8
from .text.byte_level import (BOS, EOS, IM_END, IM_START, ROLES, SPECIAL_TOKENS,
                              TEMPLATE_VERSION, VOCAB_SIZE, ByteTokenizer, IncrementalDecoder)

__all__ = ["BOS", "EOS", "IM_END", "IM_START", "ROLES", "SPECIAL_TOKENS", "TEMPLATE_VERSION",
           "VOCAB_SIZE", "ByteTokenizer", "ChatMessage", "IncrementalDecoder", "utf8"]
