"""The default tokenizer: byte-level, with a few special tokens and a chat template.

It needs no download, and the router imports it to tokenize once for all replicas. Token
ids 0-255 are the UTF-8 bytes; special tokens follow. ``fingerprint`` names the exact
tokenizer and template, so that a router refuses replicas that would read token ids
differently.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
SPECIAL_TOKENS = {"<|bos|>": BOS, "<|eos|>": EOS, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
VOCAB_SIZE = 260
TEMPLATE_VERSION = "chatml-bytes-1"
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus ``SPECIAL_TOKENS``. Decoding is lossless for text."""

    name = "byte-level"
    vocab_size = VOCAB_SIZE
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
                    ) -> list[int]:
        """ChatML-style: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""
        ids = [BOS]
        for m in messages:
            if m.role not in ROLES:
                raise ValueError(f"unknown chat role {m.role!r}; use one of {', '.join(ROLES)}")
            ids.append(IM_START)
            ids.extend(f"{m.role}\n{m.content}".encode("utf-8"))
            ids.append(IM_END)
            ids.append(ord("\n"))
        if add_generation_prompt:
            ids.append(IM_START)
            ids.extend(b"assistant\n")
        return ids

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({EOS, IM_END})

    @property
    def fingerprint(self) -> str:
        spec = {"name": self.name, "vocab": VOCAB_SIZE, "special": SPECIAL_TOKENS,
                "template": TEMPLATE_VERSION}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


class IncrementalDecoder:
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
