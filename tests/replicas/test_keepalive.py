"""The replica's idle keep-alive (``--keepalive-s``): long by default, since the router keeps
warm connections to it for up to 60 s; closed once it has passed."""

import asyncio
import socket

from replicas.settings import ReplicaSettings
from router.settings import RouterSettings
from router.upstream import Upstream
from tests.procs import Proc


def test_the_default_outlasts_the_routers_reuse_of_idle_connections():
    async def router_keepalive() -> float:
        up = Upstream(RouterSettings())
        await up.close()
        return up.client.keepalive_s

    assert ReplicaSettings().keepalive_s > asyncio.run(router_keepalive())


def test_an_idle_connection_is_closed_after_keepalive_s():
    replica = Proc("replicas", "--engine", "sim", "--log-level", "warning",
                   "--keepalive-s", "0.3")
    try:
        with socket.create_connection(("127.0.0.1", replica.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                data += sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 200 ")
            assert sock.recv(65536) == b""  # the server closed it (within the 10 s timeout)
    finally:
        replica.stop()
