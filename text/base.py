"""What every tokenizer offers the replica and the router: one interface, two kinds.

``ByteTokenizer`` (byte-level, the default: no files) and ``HFTokenizer`` (a Hugging Face
tokenizer.json with its chat template) both implement ``Tokenizer``. The router imports this
package without torch.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

from wire.chat import ChatMessage, Content

__all__ = ["ChatMessage", "Content", "Detokenizer", "Tokenizer", "le32", "utf8"]


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; ValueError (naming the position) for a lone surrogate, which JSON
    can carry as an unpaired ``\\ud800``-style escape but no text can contain."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text has an unpaired surrogate U+{ord(text[exc.start]):04X} at "
                         f"character {exc.start}: not valid Unicode (a \\uD8xx escape must "
                         "be followed by its \\uDCxx pair)") from None


def le32(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, the wire form (what the router sends)."""
    return np.asarray(ids, dtype="<u4").tobytes()


class Detokenizer(abc.ABC):
    """Turns generated token ids into text pieces, one push per token, never splitting a
    UTF-8 character; the pieces joined (with ``flush``) are the text of all the ids."""

    @abc.abstractmethod
    def push(self, token: int) -> str:
        """The text this token completes ("" while a character is still incomplete)."""

    @abc.abstractmethod
    def flush(self) -> str:
        """What is still held back, at the end of the sequence."""


class Tokenizer(abc.ABC):
    """Text <-> token ids, the chat template, and what identifies both (``fingerprint``)."""

    name: str

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a generated sequence (finish_reason "stop")."""

    @property
    @abc.abstractmethod
    def fingerprint(self) -> str:
        """Equal for two tokenizers exactly when they tokenize and render chats alike."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids, with the special tokens this tokenizer adds to one."""

    def encode_le32(self, text: str) -> bytes:
        """``encode`` in the wire form (``le32``)."""
        return le32(self.encode(text))

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens left out."""

    @abc.abstractmethod
    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
                    ) -> list[int]:
        """A conversation's ids through the chat template; ValueError for what the
        template refuses or cannot render."""

    def render_chat_le32(self, messages: Sequence[ChatMessage],
                         add_generation_prompt: bool = True) -> bytes:
        """``render_chat`` in the wire form (``le32``)."""
        return le32(self.render_chat(messages, add_generation_prompt))

    @abc.abstractmethod
    def detokenizer(self) -> Detokenizer:
        """A fresh incremental decoder for one generated sequence."""

    @abc.abstractmethod
    def wire(self) -> dict:
        """What ``GET /tokenizer`` answers: enough for ``tokenizer_from_wire`` to build the
        same tokenizer (same fingerprint) elsewhere."""

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Older name of ``eos_token_ids``."""
        return self.eos_token_ids
