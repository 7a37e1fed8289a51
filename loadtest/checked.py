"""One request through a router or replica, checked to the end: what the fault drills
(``bench/faults.py``, ``tests/faults``) and the soak (``bench/soak.py``) count.

A request is ``ok`` only when it got all it asked for: a ``200``, for a stream every event
up to ``data: [DONE]`` with no error event and the usage chunk (``stream_options:
include_usage``, which these requests always ask for) saying ``max_tokens`` tokens came,
for a whole answer a JSON body whose usage says the same and whose choice ended with
``finish_reason: length`` (the sim engine never stops early). ``started`` records whether a
stream's first content event reached the client before anything went wrong: a failure
before that is a request the router lost (it should have retried it elsewhere), one after
it can only be reported (the answer cannot be repeated). A client that disconnects on
purpose (``disconnect_after`` content events) is ``disconnected``, and ``ok`` if nothing
went wrong before it left.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import httpx


@dataclass
class Outcome:
    t0: float  # time.monotonic() when sent
    seconds: float
    stream: bool
    status: int | None = None  # None: no answer at all (connection error)
    replica: str | None = None  # x-replica of the answer
    started: bool = False  # a content event (or a whole 200 answer) reached the client
    done: bool = False  # data: [DONE] (stream) or a complete JSON body
    error: str | None = None  # error event, HTTP error body, exception or a failed check
    completion_tokens: int | None = None
    disconnected: bool = False  # left on purpose after disconnect_after content events

    @property
    def ok(self) -> bool:
        return self.error is None and (self.done or self.disconnected)

    @property
    def lost_before_start(self) -> bool:
        """Failed before anything of the answer reached the client."""
        return not self.ok and not self.started

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


async def checked_request(client: httpx.AsyncClient, path: str, body: dict,
                          disconnect_after: int | None = None) -> Outcome:
    """Send ``body`` (its ``stream`` and ``max_tokens`` decide what is expected) and check
    the answer as the module docstring says."""
    stream = bool(body.get("stream"))
    want = body.get("max_tokens")
    if stream:
        body = {**body, "stream_options": {"include_usage": True}}
    out = Outcome(time.monotonic(), 0.0, stream)
    try:
        if stream:
            await _stream(client, path, body, want, disconnect_after, out)
        else:
            r = await client.post(path, json=body)
            out.status, out.replica = r.status_code, r.headers.get("x-replica")
            _whole(r, want, out)
    except httpx.HTTPError as exc:
        out.error = out.error or f"{type(exc).__name__}: {exc}"
    out.seconds = time.monotonic() - out.t0
    return out


def _whole(r: httpx.Response, want: int | None, out: Outcome) -> None:
    if r.status_code != 200:
        out.error = f"HTTP {r.status_code}: {r.text[:200]}"
        return
    try:
        data = r.json()
        out.completion_tokens = data["usage"]["completion_tokens"]
        finish = data["choices"][0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        out.error = f"unreadable answer: {type(exc).__name__}: {exc}"
        return
    out.started = out.done = True
    if want is not None and (out.completion_tokens != want or finish != "length"):
        out.error = f"{out.completion_tokens} tokens, finish_reason {finish!r} (asked {want})"


async def _stream(client, path, body, want, disconnect_after, out: Outcome) -> None:
    async with client.stream("POST", path, json=body) as r:
        out.status, out.replica = r.status_code, r.headers.get("x-replica")
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        content = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                out.error = f"error event: {event['error'].get('message')}"
                continue  # [DONE] follows
            if event.get("usage"):
                out.completion_tokens = event["usage"].get("completion_tokens")
            if any(c.get("text") or (c.get("delta") or {}).get("content")
                   for c in event.get("choices") or ()):
                out.started = True
                content += 1
                if disconnect_after is not None and content >= disconnect_after:
                    out.disconnected = True
                    return  # leaving the block closes the connection mid-stream
    if out.error is None and not out.done:
        out.error = "the stream ended without data: [DONE]"
    elif out.error is None and want is not None and out.completion_tokens != want:
        out.error = f"usage says {out.completion_tokens} tokens (asked {want})"
