"""``python -m replicas --host 127.0.0.1 --port 9001 --engine sim --kv-pages 256``."""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn
from pydantic import ValidationError

from .app import create_app
from .coalesce import CoalescingHttpToolsProtocol
from .settings import ReplicaSettings, parse_args

log = logging.getLogger("replicas")


class DrainingServer(uvicorn.Server):
    """First SIGTERM/SIGINT: readiness turns 503, new requests are refused, in-flight ones
    finish (up to ``drain_timeout_s``), then the server exits. A second signal exits now."""

    def __init__(self, config: uvicorn.Config, settings: ReplicaSettings, service) -> None:
        super().__init__(config)
        self.settings = settings
        self.service = service
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining or not self.started:
            return super().handle_exit(sig, frame)
        self._draining = True
        log.info("signal %s: draining (up to %.0f s)", sig, self.settings.drain_timeout_s)
        asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        finished = await self.service.drain(self.settings.drain_timeout_s)
        log.info("drained: %s", "all requests finished" if finished else "timed out")
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    try:
        settings = parse_args(argv)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"python -m replicas: bad settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        app = create_app(settings)
    except (ValueError, OSError) as exc:  # a checkpoint or tokenizer that cannot be served
        print(f"python -m replicas: cannot start: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            http=CoalescingHttpToolsProtocol, proxy_headers=False,
                            server_header=False,
                            log_level=settings.log_level, access_log=False,
                            timeout_keep_alive=settings.keepalive_s,
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, settings, app.state.service)
    log.info("replica %s (%s engine, KV pages %s of %d tokens) on http://%s:%d",
             app.state.service.model_id, settings.engine,
             "/".join(map(str, app.state.service.manager.config.pool_pages)),
             settings.tokens_per_block,
             settings.host, settings.port)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
