"""The default tokenizer: byte-level, with a few special tokens and a chat template.

It needs no download. Token ids 0-255 are the UTF-8 bytes; special tokens follow.
``fingerprint`` names the exact tokenizer and template, so that a router refuses replicas
that would read token ids differently.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Sequence

import numpy as np

from .base import ChatMessage, Detokenizer, Tokenizer, utf8

BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
SPECIAL_TOKENS = {"<|bos|>": BOS, "<|eos|>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
VOCAB_SIZE = 260
TEMPLATE_VERSION = "chatml-bytes-1"
ROLES = ("system", "user", "assistant", "tool", "developer")


_LE32_IM_START = np.array([IM_START], dtype="<u4")
_LE32_IM_END_NL = np.array([IM_END, ord("\n")], dtype="<u4")
_LE32_GENERATION = np.array([IM_START, *b"assistant\n"], dtype="<u4")


def _le32(prefix: list[int], data: bytes) -> bytes:
    """``prefix`` then the bytes of ``data``, one token each, as little-endian uint32."""
    out = np.empty(len(prefix) + len(data), dtype="<u4")
    out[:len(prefix)] = prefix
    out[len(prefix):] = np.frombuffer(data, dtype=np.uint8)
    return out.tobytes()


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens, plus ``SPECIAL_TOKENS``. Decoding is lossless for text."""

    name = "byte-level"
    vocab_size = VOCAB_SIZE
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(utf8(text))
        return [BOS, *ids] if add_bos else ids

    def encode_le32(self, text: str, add_bos: bool = True) -> bytes:
        """``encode`` as little-endian uint32 bytes, the wire form of token ids (what the
        router sends), built without a Python int per token."""
        return _le32([BOS] if add_bos else [], utf8(text))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
                    ) -> list[int]:
        """ChatML-style: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""
        return np.frombuffer(self.render_chat_le32(messages, add_generation_prompt),
                             dtype="<u4").tolist()

    def render_chat_le32(self, messages: Sequence[ChatMessage],
                         add_generation_prompt: bool = True) -> bytes:
        """``render_chat`` as little-endian uint32 bytes (see ``encode_le32``)."""
        parts = [np.array([BOS], dtype="<u4")]
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise ValueError(f"unknown chat role {m.role!r}; use one of {', '.join(ROLES)}")
            try:
                content = utf8(m.text())
            except ValueError as exc:
                raise ValueError(f"message {i}: {exc}") from None
            parts.append(_LE32_IM_START)
            parts.append(np.frombuffer(f"{m.role}\n".encode() + content, dtype=np.uint8))
            parts.append(_LE32_IM_END_NL)
        if add_generation_prompt:
            parts.append(_LE32_GENERATION)
        return np.concatenate(parts, dtype="<u4").tobytes()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS, IM_END})

    @property
    def fingerprint(self) -> str:
        spec = {"name": self.name, "vocab": VOCAB_SIZE, "special": SPECIAL_TOKENS,
                "template": TEMPLATE_VERSION}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    def detokenizer(self) -> IncrementalDecoder:
        return IncrementalDecoder()

    def wire(self) -> dict:
        return {"kind": "byte-level", "fingerprint": self.fingerprint}


class IncrementalDecoder(Detokenizer):
    """Turns a stream of token ids into text pieces without splitting UTF-8 characters;
    invalid bytes become U+FFFD exactly as ``bytes.decode(errors="replace")`` would."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        if token >= 256:
            return ""
        return self._decoder.decode(bytes((token,)))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
