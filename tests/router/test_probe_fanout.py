"""Probe fan-out: an answer that settles the choice ends the wait; the rest are read on
(for the load they report) until the deadline, then abandoned."""

import asyncio
import json

from router.settings import RouterSettings
from router.upstream import ProbeNotAwaited, ProbeResult, Upstream


def answer(reuse: int) -> bytes:
    body = json.dumps({"num_tokens": reuse, "num_tokens_before_hybrid_pruning": reuse,
                       "num_prompt_tokens": 100, "load": {"running": 0}}).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


class ProbeServer:
    """Answers the first request at once (a warm-up), every later probe with ``reuse``
    after ``delay`` seconds (None: never)."""

    def __init__(self, reuse: int, delay: float | None) -> None:
        self.reuse, self.delay, self.probes = reuse, delay, 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.probes += 1
                if self.probes > 1:
                    await asyncio.sleep(3600 if self.delay is None else self.delay)
                writer.write(answer(self.reuse))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def fan_out(servers, settle_on, deadline_ms=300.0, after_s=0.0):
    """Probe every server once (twice: a warm-up fills the pool), ending early on the first
    answer whose reuse is ``settle_on``; what on_answer saw, when, and the results."""
    urls = [await s.start() for s in servers]
    up = Upstream(RouterSettings(probe_deadline_ms=deadline_ms))
    loop = asyncio.get_running_loop()
    seen = []

    def on_answer(url, result):
        seen.append((urls.index(url), type(result).__name__, round(loop.time() - t0, 2)))
        return isinstance(result, ProbeResult) and result.num_tokens == settle_on

    try:
        for s in servers:  # open the connections first (the first probe pays for them)
            await up.client.fetch("POST", urls[servers.index(s)], "/warm", b"{}")
        t0 = loop.time()
        out = await up.probe_all(urls, b"{}", on_answer)
        took = loop.time() - t0
        await asyncio.sleep(after_s)
        return seen, {urls.index(u): r for u, r in out.items()}, took, up.client.idle_connections()
    finally:
        up.client.close()
        for s in servers:
            s.server.close()


def test_a_settling_answer_ends_the_wait_and_the_rest_are_read_on():
    servers = [ProbeServer(99, 0.0), ProbeServer(50, 0.1), ProbeServer(50, None)]
    seen, out, took, idle = asyncio.run(fan_out(servers, settle_on=99, after_s=0.5))
    assert took < 0.08  # not the 0.1 s of the second, nor the 0.3 s deadline
    assert isinstance(out[0], ProbeResult) and out[0].num_tokens == 99
    assert isinstance(out[1], ProbeNotAwaited) and isinstance(out[2], ProbeNotAwaited)
    # after the choice: the second's answer is read (for its load), the third abandoned at
    # the deadline; the first two connections go back to the pool, the third is closed
    assert [(i, kind) for i, kind, _ in seen] == [(0, "ProbeResult"), (1, "ProbeResult"),
                                                 (2, "TimeoutError")]
    assert 0.25 <= seen[2][2] < 0.45 and idle == 2


def test_without_a_settling_answer_the_wait_lasts_until_the_deadline():
    servers = [ProbeServer(10, 0.0), ProbeServer(20, None)]
    seen, out, took, idle = asyncio.run(fan_out(servers, settle_on=99, deadline_ms=150))
    assert 0.14 <= took < 0.3
    assert out[0].num_tokens == 10 and isinstance(out[1], TimeoutError)
    assert [(i, kind) for i, kind, _ in seen] == [(0, "ProbeResult")]  # timeouts: by result
    assert idle == 1


def test_all_answers_before_a_settling_one_end_the_wait_normally():
    servers = [ProbeServer(10, 0.0), ProbeServer(20, 0.02)]
    seen, out, took, idle = asyncio.run(fan_out(servers, settle_on=99))
    assert took < 0.2 and [r.num_tokens for r in out.values()] == [10, 20]
    assert [(i, kind) for i, kind, _ in seen] == [(0, "ProbeResult")]  # the last ends it
    assert idle == 2
