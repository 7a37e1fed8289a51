"""The router's side of its conversations with replicas: probes, checks, forwarding.

All of it goes through one ``http1.Client`` (pooled keep-alive HTTP/1.1, see there for why
not a general client). Probes go out together under one deadline: each is written on a
pooled connection at once and its answer parsed as it arrives, without a task per probe;
whatever has not answered by the deadline counts as "no reuse known" and its connection is
closed, so a late probe never holds the request. The caller may end the wait earlier, when
an answer settles the choice (``Policy.settled``); the probes still out are then read on,
for the load they report, until the deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from replicas import jsonwire

from .http1 import Client, Response
from .settings import RouterSettings


@dataclass(slots=True)
class ProbeResult:
    num_tokens: int
    num_tokens_before_hybrid_pruning: int
    load: dict
    seconds: float


class ProbeFailed(Exception):
    pass


class ProbeNotAwaited(Exception):
    """The router chose before this probe answered (an answer already settled it)."""


class Upstream:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.client = Client(settings.connect_timeout_s)
        self._internal = ({"authorization": f"Bearer {settings.internal_token}"}
                          if settings.internal_token else {})
        self._probe_headers = {"content-type": "application/json", **self._internal}
        self._probe_heads: dict[str, bytes] = {}  # replica -> Client.head() of its probes

    async def close(self) -> None:
        self.client.close()

    # -- probes ------------------------------------------------------------------------

    async def probe_all(self, urls: list[str], body: bytes,
                        on_answer: Callable[[str, ProbeResult | Exception], bool] | None = None
                        ) -> dict[str, ProbeResult | Exception]:
        """Probe ``urls`` concurrently. Each answer (or failure) is passed to ``on_answer``
        as it arrives; when that returns True, the wait ends there: probes still out are
        reported as ``ProbeNotAwaited``, and their answers are still read (and passed to
        ``on_answer``, whose result then no longer matters) until the deadline, when what
        is still out is abandoned. Without an early end, whatever has not answered by the
        deadline is abandoned (its connection closed) and reported as a TimeoutError."""
        client, heads = self.client, self._probe_heads
        length = b"Content-Length: %d\r\n\r\n" % len(body)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        all_done = loop.create_future()
        remaining = 0
        collecting = True  # until the results are handed over
        out: dict[str, ProbeResult | Exception] = {}

        def answered(url: str, result: ProbeResult | Exception) -> None:
            nonlocal remaining
            remaining -= 1
            if collecting:
                out[url] = result
                if not all_done.done() and (remaining == 0 or (
                        on_answer is not None and on_answer(url, result))):
                    all_done.set_result(None)
            elif on_answer is not None:  # read on after an early end, for the load it reports
                on_answer(url, result)

        def response_done(url: str, response: Response) -> None:
            answered(url, _probe_result(response.status, response.body_now(),
                                        response.done_at - t0)
                     if response.complete else response.error or ProbeFailed("no answer"))

        def task_done(url: str, task: asyncio.Task) -> None:
            if task.cancelled():
                return
            exc = task.exception()
            if exc is not None:
                answered(url, exc)
            else:
                status, raw = task.result()
                answered(url, _probe_result(status, raw, time.perf_counter() - t0))

        def abandon(late: list[tuple[str, Response | asyncio.Task]]) -> None:
            """The deadline of probes read on after an early end: what is still out is
            closed, and reported as late."""
            for url, item in late:
                if isinstance(item, asyncio.Task):
                    if item.done():
                        continue
                    item.cancel()
                elif item.complete or item.error is not None:
                    continue
                else:
                    item.on_done = None
                    item.close()
                answered(url, TimeoutError("probe deadline passed"))

        sent: list[tuple[str, Response]] = []  # on pooled connections: no task per probe
        opening: list[tuple[str, asyncio.Task]] = []  # a connection to open first
        deadline_at = loop.time() + self.settings.probe_deadline_ms / 1e3
        try:
            for url in urls:
                try:
                    head = heads.get(url)
                    if head is None:
                        head = heads[url] = client.head("POST", url, "/probe_reuse",
                                                        self._probe_headers)
                    response = client.start("POST", url, head + length + body)
                except (ValueError, OSError) as exc:
                    out[url] = exc
                    continue
                remaining += 1
                if response is not None:
                    response.on_done = partial(response_done, url)
                    sent.append((url, response))
                else:
                    task = loop.create_task(client.fetch("POST", url, "/probe_reuse", body,
                                                         self._probe_headers))
                    task.add_done_callback(partial(task_done, url))
                    opening.append((url, task))
            if remaining:
                deadline = loop.call_at(deadline_at,
                                        lambda: all_done.done() or all_done.set_result(None))
                try:
                    await all_done
                finally:
                    deadline.cancel()
        finally:
            collecting = False
            early = all_done.done() and loop.time() < deadline_at
            if not all_done.done():  # this request was cancelled
                all_done.cancel()
            late: list[tuple[str, Response | asyncio.Task]] = []
            for url, response in sent:
                if url in out:
                    continue
                if early:  # read on until the deadline, for the load it reports
                    out[url] = ProbeNotAwaited("the choice was settled before it answered")
                    late.append((url, response))
                else:
                    response.on_done = None
                    response.close()
                    out[url] = TimeoutError("probe deadline passed")
            for url, task in opening:
                if url in out:
                    continue
                if early:
                    out[url] = ProbeNotAwaited("the choice was settled before it answered")
                    late.append((url, task))
                else:
                    task.cancel()
                    out[url] = TimeoutError("probe deadline passed")
            if late:
                loop.call_at(deadline_at, abandon, late)
        return out

    # -- checks ------------------------------------------------------------------------

    async def get_json(self, url: str, timeout: float) -> tuple[int, dict | None]:
        """GET a replica's JSON resource; (status, body or None if not JSON)."""
        headers = dict(self._internal)
        if self.settings.backend == "openai" and self.settings.backend_api_key:
            headers["authorization"] = f"Bearer {self.settings.backend_api_key}"
        base, path = _split(url)
        async with asyncio.timeout(timeout):
            status, body = await self.client.fetch("GET", base, path, b"", headers)
        try:
            return status, json.loads(body) if body else None
        except ValueError:
            return status, None

    async def is_ready(self, url: str) -> tuple[bool, str]:
        path = "/ready" if self.settings.backend == "ours" else "/health"
        try:
            status, _ = await self.get_json(url + path, self.settings.health_timeout_s)
        except (TimeoutError, OSError, ValueError) as exc:
            return False, f"{path}: {type(exc).__name__}: {exc}".rstrip(": ")
        return status == 200, f"{path} answered {status}"

    # -- forwarding --------------------------------------------------------------------

    async def post(self, url: str, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send a request and wait for the head of the answer; the caller reads the body
        (streamed) and closes the response."""
        return await self.client.request("POST", url, path, body, headers)


def _probe_result(status: int, raw: bytes, seconds: float) -> ProbeResult | ProbeFailed:
    """The probe's answer, or ProbeFailed saying why it is of no use."""
    if status != 200:
        return ProbeFailed(f"HTTP {status}")
    try:
        data = jsonwire.loads(raw)
        return ProbeResult(data["num_tokens"], data["num_tokens_before_hybrid_pruning"],
                           data.get("load") or {}, seconds)
    except (ValueError, KeyError, TypeError) as exc:
        return ProbeFailed(f"unreadable probe answer: {type(exc).__name__}: {exc}")


def _split(url: str) -> tuple[str, str]:
    """``http://h:p/a/b`` -> (``http://h:p``, ``/a/b``)."""
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host}", slash + path
