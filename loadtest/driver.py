"""The load driver: sends a workload to any OpenAI-compatible base URL and times each answer.

    config = DriverConfig(url="http://127.0.0.1:8000", rate=20.0, seed=0)
    result = run(shared_prefix(8, 8, 1024, 64, 32, seed=0), config)
    report.build_report(result)

Every request is streamed (``stream: true``, ``stream_options.include_usage: true``) so the
driver sees the first token and every chunk after it. When requests are due:

- ``rate`` set (open loop): inter-arrival times are gamma-distributed with shape
  ``burstiness`` and mean ``1 / rate`` (as SGLang's bench_serving: 1 is Poisson, smaller is
  burstier, larger more regular), or exactly ``1 / rate`` with ``constant_rate``. The first
  request is due at 0. The gaps are drawn from ``random.Random(seed)``.
- no ``rate`` and the workload carries ``arrival_s`` (traces): at ``arrival_s * time_scale``.
- otherwise all are due at once and ``concurrency`` paces them (closed loop).

``concurrency`` caps the requests in flight in every mode (a due request waits for a slot,
first come first served). Sessions: a request with a ``session`` is sent only after the
previous request of that session in workload order has finished (successfully or not), so
a turn is sent at ``max(due time, end of the previous turn)`` and waits for its slot after
that. The run ends when every request has finished, or at ``max_seconds``, when requests in
flight are cancelled (recorded with an error) and those not yet sent are counted as not sent.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import aiohttp

from .progress import Progress
from .workloads import Request

CANCELLED = "cancelled: max_seconds reached"


@dataclass(frozen=True)
class DriverConfig:
    url: str
    model: str | None = None  # None: the first id of GET {url}/v1/models
    rate: float | None = None  # requests/s (open loop); None: see the module docstring
    burstiness: float = 1.0  # gamma shape of the inter-arrival times (1: Poisson)
    constant_rate: bool = False  # exactly 1 / rate apart instead of gamma gaps
    time_scale: float = 1.0  # multiplies a workload's own arrival_s (0.5: twice as fast)
    concurrency: int | None = None  # most requests in flight; None: no cap
    max_seconds: float | None = None  # stop the run after this long
    request_timeout_s: float = 300.0  # per request, connection to last byte
    seed: int = 0
    ignore_eos: bool = True  # ask for exactly max_tokens (servers that don't know it ignore it)
    session_header: str = "x-session-id"  # carries Request.session (the router's default)
    api_key: str | None = None  # sent as a bearer token
    # more front ends beside ``url`` (several independent routers before the same
    # replicas): a request of a session always goes to the same one (hash of the session),
    # others go to each in turn, as a load balancer in front of them would send them
    more_urls: tuple[str, ...] = ()
    # read our router's replica list from GET {url}/stats (the report counts replicas that
    # got nothing); off for other routers, which may forward the GET to a worker as a
    # request of its own (vLLM's router does, and counts a routing decision for it)
    discover_replicas: bool = True

    def __post_init__(self) -> None:
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0, got {self.max_seconds}")


@dataclass
class RequestRecord:
    """What happened to one request; times are seconds (see ``report.py`` for each field)."""

    request_id: str
    session: str | None
    group: int | None
    scheduled_s: float | None
    start_s: float
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    replica: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunResult:
    url: str
    model: str
    config: DriverConfig
    records: list[RequestRecord]
    requests_total: int
    duration_s: float
    started_at: str  # ISO 8601, UTC
    replicas: list[str] | None = None  # the router's replicas (GET /stats), when it says
    stopped_early: bool = False  # max_seconds ended the run

    @property
    def not_sent(self) -> int:
        return self.requests_total - len(self.records)


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, constant: bool = False,
                    seed: int = 0) -> list[float]:
    """Due times (s from the start) of ``n`` requests at ``rate`` per second; the first is 0."""
    if constant:
        return [i / rate for i in range(n)]
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.gammavariate(burstiness, scale)
    return offsets


def schedule(requests: Sequence[Request], config: DriverConfig) -> list[float | None]:
    """Each request's due time, or ``None`` for "as soon as a slot is free"."""
    if config.rate is not None:
        return list(arrival_offsets(len(requests), config.rate, config.burstiness,
                                    config.constant_rate, config.seed))
    if any(r.arrival_s is not None for r in requests):
        return [(r.arrival_s or 0.0) * config.time_scale for r in requests]
    return [None] * len(requests)


def run(requests: Sequence[Request], config: DriverConfig,
        progress: Progress | None = None) -> RunResult:
    """Run the workload to the end (or ``max_seconds``); blocking."""
    return asyncio.run(run_load(requests, config, progress))


async def run_load(requests: Sequence[Request], config: DriverConfig,
                   progress: Progress | None = None) -> RunResult:
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique within a workload")
    connector = aiohttp.TCPConnector(limit=config.concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     headers=headers) as http:
        model = config.model or await fetch_model(http, config.url)
        replicas = (await discover_replicas(http, config.url)
                    if config.discover_replicas else None)
        return await _Run(http, config, model, requests, progress, replicas).go()


async def fetch_model(http: aiohttp.ClientSession, url: str) -> str:
    """The first model id that ``GET {url}/v1/models`` lists."""
    try:
        async with http.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
            data = await r.json(content_type=None)
            return data["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError,
            TypeError) as exc:
        raise RuntimeError(f"cannot read a model id from {url}/v1/models ({exc!r}); "
                           "pass the model name (--model)") from None


async def discover_replicas(http: aiohttp.ClientSession, url: str) -> list[str] | None:
    """Our router's replica URLs from ``GET {url}/stats``; ``None`` for other servers.

    Knowing every replica lets the report count the ones that received nothing."""
    try:
        async with http.get(url + "/stats", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                return None
            data = await r.json(content_type=None)
        replicas = data["replicas"]
        return [rep["url"] for rep in replicas if isinstance(rep["url"], str)]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
        return None


class _Run:
    def __init__(self, http: aiohttp.ClientSession, config: DriverConfig, model: str,
                 requests: Sequence[Request], progress: Progress | None,
                 replicas: list[str] | None) -> None:
        self.http = http
        self.config = config
        self.model = model
        self.requests = list(requests)
        self.progress = progress
        self.replicas = replicas
        self.records: list[RequestRecord] = []
        self.slots = asyncio.Semaphore(config.concurrency) if config.concurrency else None
        self.finished = {r.request_id: asyncio.Event() for r in self.requests}
        self.previous = _previous_in_session(self.requests)
        self.start = 0.0
        self._turn = 0  # requests without a session sent so far (more_urls: whose turn)

    async def go(self) -> RunResult:
        started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.start = time.perf_counter()
        due = schedule(self.requests, self.config)
        tasks = [asyncio.create_task(self._one(r, d)) for r, d in zip(self.requests, due)]
        done, pending = set(), set()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=self.config.max_seconds)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            t.result()  # a bug in the driver surfaces here instead of vanishing
        duration = time.perf_counter() - self.start
        if self.progress is not None:
            self.progress.close()
        return RunResult(self.config.url, self.model, self.config, self.records,
                         len(self.requests), duration, started_at, self.replicas,
                         stopped_early=bool(pending))

    async def _one(self, req: Request, due: float | None) -> None:
        try:
            if due is not None:
                await asyncio.sleep(max(0.0, self.start + due - time.perf_counter()))
            before = self.previous.get(req.request_id)
            if before is not None:
                await self.finished[before].wait()
            if self.slots is None:
                await self._send(req, due)
            else:
                async with self.slots:
                    await self._send(req, due)
        finally:
            self.finished[req.request_id].set()

    async def _send(self, req: Request, due: float | None) -> None:
        t0 = time.perf_counter()
        rec = RequestRecord(req.request_id, req.session, req.group, due, t0 - self.start)
        self.records.append(rec)
        headers = {self.config.session_header: req.session} if req.session else None
        try:
            async with self.http.post(self._front(req) + req.path, json=self._body(req),
                                      headers=headers) as resp:
                rec.status = resp.status
                rec.replica = resp.headers.get("x-replica")
                if resp.status != 200:
                    rec.error = _error_message(await resp.text(), resp.status)
                else:
                    await _read_stream(resp, rec, t0)
        except asyncio.CancelledError:
            rec.error = CANCELLED
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            # ValueError: aiohttp's "Line is too long" for an oversized SSE line
            rec.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        finally:
            rec.e2e_s = time.perf_counter() - t0
            if self.progress is not None and rec.error != CANCELLED:
                self.progress.update(rec.ok)

    def _front(self, req: Request) -> str:
        """The front end (router) this request goes to."""
        if not self.config.more_urls:
            return self.config.url
        fronts = (self.config.url, *self.config.more_urls)
        if req.session is not None:
            digest = hashlib.blake2b(req.session.encode(), digest_size=8).digest()
            return fronts[int.from_bytes(digest, "little") % len(fronts)]
        self._turn += 1
        return fronts[(self._turn - 1) % len(fronts)]

    def _body(self, req: Request) -> dict:
        body: dict = {"model": self.model, "max_tokens": req.max_tokens, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if req.messages is not None:
            body["messages"] = [dict(m) for m in req.messages]
        else:
            body["prompt"] = req.prompt
        return body


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float) -> None:
    """Reads SSE events: times the chunks that carry text, keeps the usage, looks for an
    error event and for ``[DONE]``; sets ``rec.ok`` when the stream ended properly."""
    last = None
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            rec.ok = rec.error is None
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            rec.error = f"not a JSON object in stream: {data[:200]!r}"
            return
        if chunk.get("error"):
            rec.error = _error_text(chunk["error"])
            continue  # a server sends [DONE] after the error; rec.ok stays False
        if chunk.get("usage"):
            _take_usage(rec, chunk["usage"])
        if _chunk_text(chunk):
            now = time.perf_counter()
            if rec.ttft_s is None:
                rec.ttft_s = now - t0
            else:
                rec.itl_s.append(now - last)
            last = now
    if rec.error is None:
        rec.error = "stream ended without data: [DONE]"


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


def _take_usage(rec: RequestRecord, usage: dict) -> None:
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")


def _error_message(text: str, status: int) -> str:
    try:
        return f"HTTP {status}: " + _error_text(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {text[:200]}"


def _error_text(error) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _previous_in_session(requests: Sequence[Request]) -> dict[str, str]:
    """request id -> id of the request of the same session just before it (list order)."""
    last: dict[str, str] = {}
    previous = {}
    for r in requests:
        if r.session is None:
            continue
        if r.session in last:
            previous[r.request_id] = last[r.session]
        last[r.session] = r.request_id
    return previous


# --------------------------------------------------------------------------- command line

def add_driver_arguments(parser: argparse.ArgumentParser) -> None:
    """The load flags of ``python -m loadtest run``."""
    g = parser.add_argument_group("load")
    g.add_argument("--url", required=True, help="OpenAI-compatible base URL (router or replica)")
    g.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    g.add_argument("--rate", type=float, help="open loop: requests per second")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 Poisson, <1 burstier (1)")
    g.add_argument("--constant-rate", action="store_true",
                   help="requests exactly 1/rate apart instead of random gaps")
    g.add_argument("--concurrency", type=int,
                   help="most requests in flight (alone: closed loop)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: multiply arrival times (0.5 replays twice as fast) (1)")
    g.add_argument("--max-seconds", type=float, default=3600.0,
                   help="stop the run after this long (3600)")
    g.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds per request (300)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server for exactly max_tokens (default on)")
    g.add_argument("--api-key", help="bearer token to send")
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed (0)")
    g.add_argument("--out", help="write the JSON report here")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def config_from_args(args: argparse.Namespace) -> DriverConfig:
    return DriverConfig(url=args.url.rstrip("/"), model=args.model, rate=args.rate,
                        burstiness=args.burstiness, constant_rate=args.constant_rate,
                        time_scale=args.time_scale, concurrency=args.concurrency,
                        max_seconds=args.max_seconds, request_timeout_s=args.request_timeout,
                        seed=args.seed, ignore_eos=args.ignore_eos, api_key=args.api_key)


def run_command(args: argparse.Namespace) -> int:
    """``python -m loadtest run``: build the workload, drive it, print and write the report.

    Exit status 0 when every request completed, 1 otherwise (the report is written either
    way), 2 for a bad combination of flags."""
    from . import report
    from .workloads import workload_from_args

    requests, workload = workload_from_args(args)
    config = config_from_args(args)
    if (config.rate is None and config.concurrency is None
            and all(r.arrival_s is None for r in requests)):
        print(f"--workload {args.workload} has no arrival times: give --rate and/or "
              "--concurrency", file=sys.stderr)
        return 2
    progress = None if args.no_progress else Progress(len(requests))
    result = run(requests, config, progress)
    doc = report.build_report(result, workload)
    if args.out:
        report.write_report(args.out, doc)
    print(report.format_table(doc))
    s = doc["summary"]
    return 0 if s["completed"] == s["requests"] else 1
