"""Reading a replica's answer, and the errors a replica's answer can be.

Our replicas are always asked to stream (with usage), whatever the client asked: their
response headers then mean "queued", their first content event (generated text, a finish
reason, usage or an error) "prefill done", and a client that did not ask for a stream gets
the events collected into one response. Until the first content event nothing has reached
the client, so the router may retry elsewhere (``forward``). Other back ends
(``--backend openai``) are relayed as they answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator


from wire import jsonwire

from .http1 import Response

DONE = b"data: [DONE]\n\n"


class UpstreamError(Exception):
    """A replica's answer that cannot go to the client as a success. ``retryable``: the
    request was not at fault, another replica (or a later try) may answer it; else the
    replica's answer goes to the client as it is. ``status`` is what the client gets."""

    retryable: bool = False

    def __init__(self, message: str, status: int, retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class UpstreamFailed(UpstreamError):
    """The replica failed before its first content event (or before a collected answer
    was complete), or answered 429 or 5xx: try the next replica."""

    retryable = True

    def __init__(self, message: str, status: int = 502, retry_after: str | None = None) -> None:
        super().__init__(message, status, retry_after)


class UpstreamRefused(UpstreamError):
    """The replica ``replica`` answered a deterministic client error (4xx): passed to the
    client as it is, never retried."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str], replica: str) -> None:
        super().__init__(f"upstream answered {status}", status)
        self.body = body
        self.headers = headers
        self.replica = replica


def error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def parse_chunk(payload: bytes) -> dict | None:
    """An SSE data payload as a JSON object; None if it is not one."""
    try:
        chunk = jsonwire.loads(payload)
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None


def is_content(chunk: dict | None) -> bool:
    """Does a chunk (``parse_chunk``) carry generated text, a finish reason, usage or an
    error? Something unreadable counts too: not ours to judge, the client sees it."""
    if chunk is None or "error" in chunk or chunk.get("usage"):
        return True
    for choice in chunk.get("choices") or ():
        if choice.get("finish_reason") or choice.get("text") or \
                (choice.get("delta") or {}).get("content"):
            return True
    return False


class UpstreamAnswer:
    """A replica's answer to a forwarded request, read up to its first content event
    (``read_to_first_content``), then relayed (``rest``) or collected (``chunks``)."""

    def __init__(self, response: Response, idle_timeout: float) -> None:
        self.response = response
        self.idle_timeout = idle_timeout
        self.buffered: list[bytes] = []  # events read up to the first content event
        self._buffered_chunks: list[dict | None] = []  # the same, parsed (not DONE)
        self.first_content_at: float | None = None
        self.usage: dict | None = None
        self.finished = False  # [DONE] seen

    async def read_to_first_content(self) -> None:
        """Read events until the first content event (or [DONE]); UpstreamFailed if the
        stream breaks or ends before. The caller bounds the time (``first_byte_timeout_s``,
        from sending)."""
        try:
            while (event := await self._next_event()) is not None:
                self.buffered.append(event)
                if event is DONE:
                    self.first_content_at = time.monotonic()
                    return
                chunk = self._parse(event)
                self._buffered_chunks.append(chunk)
                if is_content(chunk):
                    self.first_content_at = time.monotonic()
                    return
        except ConnectionError as exc:
            raise UpstreamFailed("replica failed before its first token: "
                                 f"{describe(exc)}") from exc
        raise UpstreamFailed("replica closed the stream before its first token")

    async def rest(self) -> AsyncIterator[bytes]:
        """Events after the buffered ones, as bytes (usage noted). Raises ConnectionError
        if the stream breaks."""
        try:
            while (event := await self._next_event()) is not None:
                if b"\"usage\"" in event:
                    self._parse(event)
                yield event
        except TimeoutError as exc:
            raise ConnectionError(describe(exc)) from exc
        if not self.finished:
            raise ConnectionError("replica closed the stream early")

    async def chunks(self) -> list[dict]:
        """Every chunk of the answer, parsed once (for ``collect``). Raises ConnectionError
        if the stream breaks or carries something that is not a JSON object."""
        chunks = list(self._buffered_chunks)
        try:
            while (event := await self._next_event()) is not None:
                if event is not DONE:
                    chunks.append(self._parse(event))
        except TimeoutError as exc:
            raise ConnectionError(describe(exc)) from exc
        if not self.finished:
            raise ConnectionError("replica closed the stream early")
        if None in chunks:
            raise ConnectionError("replica sent an event that is not a JSON object")
        return chunks

    def _parse(self, event: bytes) -> dict | None:
        chunk = parse_chunk(event[6:])
        if chunk is not None and chunk.get("usage"):
            self.usage = chunk["usage"]
        return chunk

    async def _next_event(self) -> bytes | None:
        """The next ``data:`` event (with its blank line), DONE, or None after DONE or at
        the end of the body."""
        if self.finished:
            return None
        while (line := await self.response.readline(self.idle_timeout)) is not None:
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                self.finished = True
                return DONE
            return line + b"\n\n"
        return None

    def close(self) -> None:
        """A complete answer's connection is already back in the pool; an unfinished one is
        closed (which is also how the replica learns that the client went away)."""
        if self.finished:
            self.response.release()
        else:
            self.response.close()


def collect(chunks: list[dict], chat: bool) -> dict:
    """Fold a stream's chunks (parsed) into one non-streaming response body."""
    text, finish, usage, head = [], None, None, None
    for chunk in chunks:
        if "error" in chunk:
            raise ConnectionError(chunk["error"].get("message", "upstream error"))
        head = head or chunk
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                text.append(piece)
            finish = choice.get("finish_reason") or finish
        usage = chunk.get("usage") or usage
    if head is None:
        raise ConnectionError("replica sent no chunk")
    content = "".join(text)
    choice = ({"index": 0, "message": {"role": "assistant", "content": content},
               "finish_reason": finish, "logprobs": None} if chat else
              {"index": 0, "text": content, "finish_reason": finish, "logprobs": None})
    return {"id": head.get("id"), "object": "chat.completion" if chat else "text_completion",
            "created": head.get("created"), "model": head.get("model"), "choices": [choice],
            "usage": usage}


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}".rstrip(": ")
