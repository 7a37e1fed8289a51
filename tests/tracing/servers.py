"""Sim replicas and a router in this process, each served by uvicorn on a free loopback port
in a thread of its own (as ``python -m replicas`` and ``python -m router`` build and serve
them), so that a test can hand each side a TracerProvider."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import httpx
import uvicorn

from replicas.app import create_app as create_replica_app
from replicas.coalesce import CoalescingHttpToolsProtocol
from replicas.service import ReplicaService
from replicas.settings import ReplicaSettings
from router import http_server
from router.app import create_app as create_router_app
from router.asgi import ProxyASGI
from router.service import RouterService
from router.settings import RouterSettings
from tests.waiting import until


@contextlib.contextmanager
def serving(config: uvicorn.Config, sock: socket.socket, start=None, stop=None):
    """Serve ``config`` on ``sock`` in a thread (``start`` / ``stop``: coroutine functions
    run on its loop around serving); stops it on leaving."""
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # not the main thread: no signals
    failed: list[BaseException] = []

    async def main() -> None:
        if start is not None:
            await start()
        try:
            await server.serve(sockets=[sock])
        finally:
            if stop is not None:
                await stop()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # seen by the test, not lost in the thread
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"
        assert not failed, f"the server failed: {failed[0]!r}"


def _socket() -> tuple[socket.socket, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def wait_ready(url: str) -> None:
    def ready() -> bool:
        try:
            return httpx.get(url + "/ready", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False
    until(ready, f"{url}/ready answers 200", tries=500, every=0.02)


@contextlib.contextmanager
def replica(tracer_provider=None, **settings):
    """A sim replica; yields its base URL."""
    s = ReplicaSettings(**{"engine": "sim", "kv_pages": 256, "log_level": "warning",
                           **settings})
    app = create_replica_app(s, ReplicaService(s, tracer_provider=tracer_provider))
    sock, url = _socket()
    config = uvicorn.Config(app, http=CoalescingHttpToolsProtocol, lifespan="on",
                            proxy_headers=False, server_header=False, access_log=False,
                            log_level="warning", timeout_graceful_shutdown=5)
    with serving(config, sock):
        wait_ready(url)
        yield url


@contextlib.contextmanager
def router(replicas: list[str], tracer_provider=None, **settings):
    """A router in front of ``replicas``; yields its base URL."""
    s = RouterSettings(**{"replicas": replicas, "log_level": "warning", "seed": 0,
                          **settings})
    app = create_router_app(s, RouterService(s, tracer_provider=tracer_provider))
    sock, url = _socket()
    config = http_server.config(ProxyASGI(app.asgi, app.routes), s)
    with serving(config, sock, app.service.start, app.service.stop):
        wait_ready(url)
        yield url


@contextlib.contextmanager
def cluster(n: int, router_provider=None, replica_provider=None,
            replica_settings: list[dict] | None = None, **router_settings):
    """``n`` sim replicas (one provider for all; ``replica_settings``: each one's) and a
    router; yields (router, replica URLs)."""
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(replica(replica_provider,
                                            **(replica_settings or [{}] * n)[i]))
                for i in range(n)]
        yield stack.enter_context(router(urls, router_provider, **router_settings)), urls
