"""``python -m router --port 8000 --replicas http://127.0.0.1:9001,http://127.0.0.1:9002``."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError

from replicas.coalesce import CoalescingHttpToolsProtocol

from .app import create_app
from .settings import parse_args


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_args(argv)
        logging.basicConfig(level=settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s %(message)s")
        app = create_app(settings)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"python -m router: bad settings:\n{exc}", file=sys.stderr)
        return 2
    if not settings.replicas and not settings.discover_dns:
        logging.getLogger("router").warning("no --replicas or --discover-dns given: nothing "
                                            "to route to until one is added through the "
                                            "admin API")
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=False, http=CoalescingHttpToolsProtocol, proxy_headers=False,
                server_header=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
