"""Turning a sequence's token events into OpenAI responses: whole, or as SSE chunks.

Text is decoded incrementally (never splitting a UTF-8 character) and held back while it
could still be the start of a stop string, so a stop string never reaches the client.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from wire import jsonwire

from .sequence import FinishEvent, Sequence, TokenEvent
from .service import ReplicaService


class StopChecker:
    """Feeds text pieces; returns what is safe to emit and whether a stop string was hit."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._held = ""
        self._keep = max((len(s) for s in stops), default=1) - 1

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)], True
        cut = max(0, len(text) - self._keep) if self.stops else len(text)
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text


@dataclass
class Piece:
    text: str
    finish_reason: str | None = None
    error: str | None = None


async def text_pieces(service: ReplicaService, seq: Sequence, stops: list[str] | None
                      ) -> AsyncIterator[Piece]:
    """Text as it is generated, then one final piece with the finish reason."""
    decoder = service.tokenizer.detokenizer()
    checker = StopChecker(stops or [])
    async for event in service.events(seq):
        if isinstance(event, TokenEvent):
            if event.token in seq.stop_token_ids:  # an eos id ends the text, never joins it
                continue
            text, stopped = checker.feed(decoder.push(event.token))
            if stopped:
                service.stop_sequence(seq)
                yield Piece(text, "stop")
                return
            if text:
                yield Piece(text)
        elif isinstance(event, FinishEvent):
            tail, stopped = checker.feed(decoder.flush())
            tail = tail if stopped else tail + checker.flush()
            reason = "stop" if stopped else event.reason
            yield Piece(tail, reason, event.error)
            return


def usage(seq: Sequence) -> dict:
    prompt, completion = len(seq.prompt), len(seq.output)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": seq.cached_tokens or 0}}


class Formatter:
    """Builds completion or chat bodies and chunks for one request."""

    def __init__(self, kind: str, request_id: str, model: str) -> None:
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def whole(self, text: str, finish_reason: str, seq: Sequence) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason,
                      "logprobs": None}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(seq)}

    def chunk(self, text: str | None, finish_reason: str | None = None,
              first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason,
                      "logprobs": None}
        return self._sse({"id": self.id, "object": self._chunk_object(), "created": self.created,
                          "model": self.model, "choices": [choice]})

    def usage_chunk(self, seq: Sequence) -> str:
        return self._sse({"id": self.id, "object": self._chunk_object(),
                          "created": self.created, "model": self.model, "choices": [],
                          "usage": usage(seq)})

    @staticmethod
    def error_event(message: str, type: str = "server_error", code: str | None = None) -> str:
        return Formatter._sse({"error": {"message": message, "type": type, "param": None,
                                         "code": code}})

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @staticmethod
    def _sse(payload: dict) -> str:
        return f"data: {jsonwire.dumps(payload).decode()}\n\n"


DONE = "data: [DONE]\n\n"
