"""A chat message as the tokenizers render it (the wire schemas convert to it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

# A message's content: text, text parts (OpenAI's ``[{"type": "text", ...}]``), or none.
Content = Union[str, tuple[str, ...], None]


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: Content
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined, none as empty)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(self.content)
