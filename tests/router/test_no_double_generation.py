"""A completion runs once per client request, even when the replica's connection closes at
the worst moment: after the router's request reached the replica, before any byte of the
answer came back (what a server closing an idle keep-alive connection as the router reused
it looks like to the router). The router may not send that request again on a fresh
connection: the replica may have read it and be generating (issue 15; it used to)."""

import asyncio
import threading

import httpx

from bench._common import metric_sum
from tests.procs import Proc


class WorstMomentRelay:
    """A loopback TCP relay in front of a replica (its own event loop, in a thread). The
    first ``POST /v1/chat/completions`` it sees is forwarded to the replica, whose whole
    answer is then read and dropped (the replica finishes its generation), while the
    router's side of that connection is closed before any byte of the answer."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.chat_requests = 0
        self.cut = threading.Event()  # the worst moment happened
        self.drained = threading.Event()  # and the replica's answer to it was read in full
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            started.set()
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _serve(self, client_r, client_w) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        answers = asyncio.ensure_future(self._pump(up_r, client_w))
        try:
            while True:
                head = await client_r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await client_r.readexactly(length)
                worst = head.startswith(b"POST /v1/chat/completions ") and \
                    self.chat_requests == 0
                if head.startswith(b"POST /v1/chat/completions "):
                    self.chat_requests += 1
                if worst:
                    answers.cancel()
                    await asyncio.wait((answers,))  # it stopped reading the replica
                    up_w.write(head + body)  # the replica reads it and generates
                    client_w.transport.abort()  # the router sees the close, no answer
                    self.cut.set()
                    await self._drain(up_r)
                    self.drained.set()
                    up_w.close()
                    return
                up_w.write(head + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            answers.cancel()
            up_w.close()
            client_w.close()

    @staticmethod
    async def _pump(reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass

    @staticmethod
    async def _drain(reader) -> None:
        """Read the replica's streamed (chunked) answer to its end."""
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            more = await reader.read(65536)
            if not more:
                return
            data += more


def _generations(replica_url: str) -> float:
    """Requests the replica finished (any reason), from its /metrics."""
    return metric_sum(httpx.get(replica_url + "/metrics", timeout=10).text,
                      "replica_request_success_total")


def test_a_request_the_replica_may_have_read_is_never_sent_again():
    replica = Proc("replicas", "--engine", "sim", "--log-level", "warning")
    relay = router = None
    try:
        relay = WorstMomentRelay(replica.port)
        router = Proc("router", "--replicas", relay.url, "--log-level", "warning",
                      "--policy", "round_robin")
        body = {"model": "sim-byte-lm", "max_tokens": 8,
                "messages": [{"role": "user", "content": "hello"}]}
        with httpx.Client(base_url=router.url, timeout=60) as client:
            statuses = [client.post("/v1/chat/completions", json=body).status_code
                        for _ in range(3)]
        assert relay.cut.is_set() and relay.drained.wait(30)
        # the cut request failed (the only replica was the one that may have run it); the
        # others were answered; the replica ran each of the three exactly once
        assert statuses == [502, 200, 200]
        assert relay.chat_requests == 3
        assert _generations(replica.url) == 3
    finally:
        if router is not None:
            router.stop()
        if relay is not None:
            relay.close()
        replica.stop()
