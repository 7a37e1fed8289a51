"""The probes' connections: a late probe gives its connection back instead of closing it,
and healthy replicas have warm connections waiting, so a burst of requests writes its
probes at once (bench/probe_misses.py measured the misses both prevented)."""

import asyncio
import contextlib

from router.service import RouterService
from router.settings import RouterSettings
from router.upstream import ProbeResult, Upstream
from tests.procs import Proc
from tests.waiting import until_async

PROBE_ANSWER = b'{"num_tokens": 64, "num_tokens_before_hybrid_pruning": 64, "load": {}}'


class GatedProbes:
    """A loopback server answering each probe only once ``gate`` is set; it counts the
    connections it accepted and notes each connection the client closed."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.connections = 0
        self.closed_by_client = 0
        self.answered = 0

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                gate = asyncio.ensure_future(self.gate.wait())
                eof = asyncio.ensure_future(reader.read(1))  # the client closing, or not
                await asyncio.wait((gate, eof), return_when=asyncio.FIRST_COMPLETED)
                if not eof.done():
                    eof.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await eof  # before the next read
                elif eof.result() == b"" or eof.exception() is not None:
                    gate.cancel()
                    self.closed_by_client += 1
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(PROBE_ANSWER), PROBE_ANSWER))
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1


def test_a_late_probe_gives_its_connection_back_once_answered():
    async def main():
        async with GatedProbes() as server:
            up = Upstream(RouterSettings(probe_deadline_ms=20, probe_late_grace_s=30,
                                         warm_connections=0))
            try:
                out = await up.probe_all([server.url], b"{}")
                assert isinstance(out[server.url], TimeoutError)  # the gate was shut
                assert up.client.idle_connections() == 0  # still waiting for its answer
                server.gate.set()
                await until_async(lambda: up.client.idle_connections() == 1, "pooled again")
                out = await up.probe_all([server.url], b"{}")
                assert isinstance(out[server.url], ProbeResult)
                assert out[server.url].answer.num_tokens == 64
                # one connection served both: the late one was not closed and re-opened
                assert (server.connections, server.answered, server.closed_by_client) == \
                    (1, 2, 0)
            finally:
                await up.close()
    asyncio.run(main())


def test_a_late_probe_never_answered_is_closed_after_its_grace():
    async def main():
        async with GatedProbes() as server:
            up = Upstream(RouterSettings(probe_deadline_ms=20, probe_late_grace_s=0.05,
                                         warm_connections=0))
            try:
                out = await up.probe_all([server.url], b"{}")
                assert isinstance(out[server.url], TimeoutError)
                await until_async(lambda: server.closed_by_client == 1, "the client closed it")
                assert (server.connections, server.answered) == (1, 0)
                assert up.client.idle_connections() == 0
            finally:
                await up.close()
    asyncio.run(main())


def test_warm_opens_connections_up_to_the_count_and_probes_use_them():
    async def main():
        async with GatedProbes() as server:
            server.gate.set()
            up = Upstream(RouterSettings(warm_connections=3))
            try:
                assert await up.warm(server.url) == 3
                await until_async(lambda: server.connections == 3, "three accepted")
                assert up.client.idle_connections() == 3
                assert await up.warm(server.url) == 0  # topped up already
                out = await up.probe_all([server.url], b"{}")
                assert isinstance(out[server.url], ProbeResult)
                assert server.connections == 3  # the probe took a warm one
                assert await up.warm(server.url) == 0
                assert up.client.idle_connections() == 3
                assert up.client.opened_to(server.url) == 3
            finally:
                await up.close()
    asyncio.run(main())


def test_warm_connections_zero_opens_none():
    async def main():
        async with GatedProbes() as server:
            up = Upstream(RouterSettings(warm_connections=0))
            try:
                assert await up.warm(server.url) == 0
                assert up.client.idle_connections() == 0
            finally:
                await up.close()
    asyncio.run(main())


def test_the_router_warms_connections_to_a_replica_it_admits():
    replica = Proc("replicas", "--engine", "sim", "--log-level", "warning")
    try:
        async def main():
            svc = RouterService(RouterSettings(replicas=[replica.url], warm_connections=5,
                                               health_interval_s=3600))
            await svc.start()
            try:
                (r,) = svc.registry.replicas.values()
                assert r.health.value == "healthy"
                assert svc.upstream.client.idle_connections() == 5
                # the admission checks reused one of them or opened their own
                opened = svc.upstream.client.opened_to(replica.url)
                assert 5 <= opened <= 6
                from prometheus_client import generate_latest

                from router.metrics import RouterMetrics
                text = generate_latest(RouterMetrics(svc).registry).decode()
                assert f'router_upstream_connections_opened_total{{replica="{replica.url}"}} ' \
                    f'{float(opened)}' in text
            finally:
                await svc.stop()
        asyncio.run(main())
    finally:
        replica.stop()


def test_idle_replica_connections_are_kept_below_the_replicas_keepalive():
    async def main():
        ours = Upstream(RouterSettings())
        other = Upstream(RouterSettings(backend="openai", policy="round_robin"))
        chosen = Upstream(RouterSettings(upstream_keepalive_s=12))
        try:
            # our replicas keep idle connections 75 s (--keepalive-s); uvicorn's default 5 s
            assert (ours.client.keepalive_s, other.client.keepalive_s,
                    chosen.client.keepalive_s) == (60.0, 4.0, 12.0)
        finally:
            for up in (ours, other, chosen):
                await up.close()
    asyncio.run(main())
