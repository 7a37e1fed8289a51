"""``python -m router --port 8000 --replicas http://127.0.0.1:9001,http://127.0.0.1:9002``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from pydantic import ValidationError

from .app import RouterApp, create_app
from .server import HTTPServer
from .settings import RouterSettings, parse_args

try:
    import uvloop
except ImportError:  # uvloop is optional (uvicorn[standard] brings it on Linux and macOS)
    uvloop = None


async def serve(settings: RouterSettings, app: RouterApp) -> None:
    """Check the replicas, serve until SIGINT/SIGTERM, finish what runs, stop."""
    await app.service.start()
    try:
        if settings.http_server == "native":
            server = HTTPServer(app.asgi, app.routes, settings.max_body_bytes,
                                keepalive_s=settings.keepalive_s,
                                grace_s=settings.shutdown_grace_s,
                                head_timeout_s=settings.head_timeout_s,
                                body_timeout_s=settings.body_timeout_s,
                                max_connections=settings.max_connections)
            await server.serve(settings.host, settings.port)
        elif settings.http_server == "uvicorn":
            await _serve_uvicorn(settings, app)
        else:
            await _serve_granian(settings, app)
    finally:
        await app.service.stop()


async def _serve_uvicorn(settings: RouterSettings, app: RouterApp) -> None:
    import uvicorn

    from .asgi import ProxyASGI
    config = uvicorn.Config(
        ProxyASGI(app.asgi, app.routes, settings.max_body_bytes), host=settings.host,
        port=settings.port, http="httptools", loop="none", lifespan="off",
        access_log=False, log_level=settings.log_level.lower(), server_header=False,
        timeout_keep_alive=max(1, round(settings.keepalive_s)),
        timeout_graceful_shutdown=round(settings.shutdown_grace_s),
        limit_concurrency=settings.max_connections)
    server = uvicorn.Server(config)
    # uvicorn re-raises a captured SIGINT/SIGTERM after serving (exit 130 for a clean stop):
    # stop it through its own handle_exit instead, as the native server stops
    server.capture_signals = contextlib.nullcontext
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.handle_exit, sig, None)
    await server.serve()


async def _serve_granian(settings: RouterSettings, app: RouterApp) -> None:
    try:
        from granian.constants import HTTPModes, Interfaces
        from granian.http import HTTP1Settings
        from granian.server.embed import Server
    except ImportError:
        raise SystemExit("--http-server granian needs granian: pip install granian") from None

    from .asgi import ProxyASGI
    server = Server(ProxyASGI(app.asgi, app.routes, settings.max_body_bytes),
                    address=settings.host, port=settings.port, interface=Interfaces.ASGINL,
                    http=HTTPModes.http1, websockets=False, log_access=False,
                    http1_settings=HTTP1Settings(
                        header_read_timeout=round(settings.head_timeout_s * 1000)))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.signal_handler_interrupt)
    await server.serve()


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_args(argv)
        logging.basicConfig(level=settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s %(message)s")
        # At "info" every routed request logs its decision: skip the per-record work this
        # format never shows (the logging HOWTO's "Optimization": thread, process and
        # caller lookups; the process id is a getpid() system call on every record)
        logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
        logging._srcfile = None
        app = create_app(settings)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"python -m router: bad settings:\n{exc}", file=sys.stderr)
        return 2
    if not settings.replicas and not settings.discover_dns:
        logging.getLogger("router").warning("no --replicas or --discover-dns given: nothing "
                                            "to route to until one is added through the "
                                            "admin API")
    try:
        if uvloop is not None:
            uvloop.run(serve(settings, app))
        else:
            asyncio.run(serve(settings, app))
    except OSError as exc:  # the port is taken, the host is not ours ...
        logging.getLogger("router").error("cannot serve on %s:%d: %s", settings.host,
                                          settings.port, exc)
        return 1
    except KeyboardInterrupt:  # a signal before serving began
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
