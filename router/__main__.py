"""``python -m router --port 8000 --replicas http://127.0.0.1:9001,http://127.0.0.1:9002``."""

from __future__ import annotations

import asyncio
import logging
import sys

from pydantic import ValidationError

from . import http_server
from .app import RouterApp, create_app
from .asgi import ProxyASGI
from .settings import RouterSettings, parse_args

try:
    import uvloop
except ImportError:  # uvloop is optional (uvicorn[standard] brings it on Linux and macOS)
    uvloop = None


async def serve(settings: RouterSettings, app: RouterApp) -> None:
    """Check the replicas, serve until SIGINT/SIGTERM, finish what runs, stop."""
    await app.service.start()
    try:
        await http_server.serve(ProxyASGI(app.asgi, app.routes), settings)
    finally:
        await app.service.stop()


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
