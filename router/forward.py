"""Forwarding a routed request: one retry executor, and the accounting of each attempt.

``forward`` tries the decision's replicas best first (at most ``--max-attempts``, further
ones only while the retry budget allows) as long as nothing has reached the client. An
attempt sends the request and reads the replica's answer up to its first content event
(``proxy.UpstreamAnswer``), then hands it to a deliverer, which decides what a failure
after that point means:

    stream     relayed as it comes; a break ends it with an error event (retrying would
               repeat what the client already has): forward returns
    collected  read whole first; a failure before it is complete (UpstreamFailed) moves
               on to the next replica, as a failure before the first content event does

Each attempt's ``AttemptAccounting`` is opened when it starts and ended in one place, the
``finally`` of ``forward``'s loop, whatever way the attempt ends: answered, failed, a
client error passed on, cancelled (the client left, or the total timeout).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from .http1 import Response
from .policies import Decision
from .proxy import UpstreamAnswer, UpstreamError, UpstreamFailed, UpstreamRefused, describe
from .registry import Replica
from .requests import Prepared

if TYPE_CHECKING:
    from .service import RouterService

T = TypeVar("T")


class RetryBudget:
    """Retries allowed in the last ``window_s``: a floor plus a share of the requests."""

    def __init__(self, ratio: float, floor_per_s: float = 5.0, window_s: float = 10.0) -> None:
        self.ratio, self.floor, self.window = ratio, floor_per_s * window_s, window_s
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def request(self) -> None:
        self._requests.append(time.monotonic())

    def allow(self) -> bool:
        now = time.monotonic()
        for q in (self._requests, self._retries):
            while q and now - q[0] > self.window:
                q.popleft()
        if len(self._retries) < self.floor + self.ratio * len(self._requests):
            self._retries.append(now)
            return True
        return False


class AttemptAccounting:
    """The accounting of one attempt on one replica: what the router has open there
    (``in_flight``, tokens not queued yet), the policy's view of it, the circuit breaker,
    usage counts and the request's outcome (``router_requests``).

    What happened on the way is noted here by whoever sees it (``failure``, ``usage``,
    ``answering``); ``forward`` calls ``end`` exactly once per attempt.
    """

    trace = None  # the attempt's "forward" span when tracing is on (router.tracing.AttemptTrace)

    def __init__(self, svc: RouterService, p: Prepared, decision: Decision,
                 replica: Replica) -> None:
        self.svc, self.p, self.replica, self.decision = svc, p, replica, decision
        self.reason = decision.reason.split(" (")[0]  # router_decisions{reason}
        self.probed = next(c for c in decision.candidates if c.name == replica.url)
        self.started = time.monotonic()
        self.estimate = max(0, p.route.num_tokens - max(self.probed.reuse or 0,
                                                         self.probed.pending_reuse))
        self.failure: str | None = None  # the replica's fault: counts against its circuit
        self.usage: dict | None = None  # a complete answer's usage
        self.outcome: str | None = None  # set once the client gets this attempt's answer
        self._queued = self._ended = False
        replica.in_flight += 1
        replica.unqueued_tokens += self.estimate
        svc.registry.started(replica)
        svc.policy.on_routed(p.route, replica.url)

    def queued(self) -> None:
        """The replica has the request (its answer's head came)."""
        if not self._queued:
            self._queued = True
            self.replica.unqueued_tokens -= self.estimate

    def first_content(self, at: float) -> None:
        """The replica's first content event came at ``at``: its prefill is done."""
        self.svc.policy.on_prefill_done(self.p.route, self.replica.url)
        self.replica.stats.ttft_s.append(at - self.started)
        self.svc.metrics.first_token(self.replica.url, at - self.started)
        if self.trace is not None:
            self.trace.first_token(at)

    def answering(self) -> None:
        """The client gets this attempt's answer (no other replica will be tried): count
        the decision now, the outcome at the end ("ok" unless noted otherwise)."""
        self.outcome = "ok"
        self.svc.metrics.decided(self.replica.url, self.reason)

    def end(self) -> None:
        if self._ended:
            raise RuntimeError(f"the attempt on {self.replica.url} was accounted twice")
        self._ended = True
        self.queued()
        svc, replica = self.svc, self.replica
        replica.in_flight -= 1
        svc.policy.on_finished(self.p.route, replica.url)
        if self.failure is None:
            svc.registry.succeeded(replica)
        else:
            svc.registry.failed(replica, self.failure)
        if self.usage:
            self._count(self.usage)
        if self.outcome is not None:
            svc.metrics.outcome(replica.url, self.outcome)
        if self.trace is not None:
            self.trace.ended(self)

    def _count(self, usage: dict) -> None:
        stats = self.replica.stats
        stats.requests += 1
        stats.prompt_tokens += usage.get("prompt_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
        stats.cached_tokens += cached
        if self.probed.reuse is not None:
            stats.probed_tokens += self.probed.reuse
            stats.probed_tokens_before_pruning += self.probed.reuse_before_pruning or 0
        expected = self.probed.expected_reuse
        if expected is not None:  # what the policy expected against what it got
            stats.expected_tokens += expected
            stats.over_predicted_tokens += max(0, expected - cached)
            self.svc.metrics.expected(self.replica.url, expected, cached)
        if self.replica.url == self.decision.chosen:
            self.decision.cached_tokens = cached
        self.svc.metrics.finished(self.replica.url, usage.get("prompt_tokens", 0), cached)
        if self.p.tenant is not None:  # --api-keys: the tenant's hit rate
            self.p.tenant.answered(usage.get("prompt_tokens", 0), cached)


Deliver = Callable[[AttemptAccounting, UpstreamAnswer], Awaitable[T]]


async def forward(svc: RouterService, p: Prepared, decision: Decision, arrived: float,
                  deliver: Deliver[T]) -> T:
    """Try the decision's replicas best first until one's answer is delivered; returns
    what ``deliver`` returns.

    ``deliver(accounting, answer)`` gets an answer read up to its first content event (or
    only its head: a collected answer from ``--backend openai``). It raises UpstreamFailed
    for a failure that another replica may not have, and only while nothing has reached
    the client. Raises UpstreamRefused (a replica's client error, to pass on) or, when no
    replica is left to try, UpstreamFailed naming what went wrong on each.
    """
    svc.retries.request()
    errors: list[str] = []  # "replica: why", one per failed attempt
    last: UpstreamFailed | None = None
    held_back = False  # the retry budget refused an attempt
    for url in decision.ranked()[: svc.settings.max_attempts]:
        replica = svc.registry.get(url)
        if replica is None:  # removed since the decision
            continue
        if errors:
            if not svc.retries.allow():
                held_back = True
                continue
            svc.metrics.retries.inc()
        accounting = AttemptAccounting(svc, p, decision, replica)
        if p.trace is not None:  # attempt numbers count from 1; a retry says why
            accounting.trace = p.trace.attempt(len(errors) + 1, url, p.path,
                                               None if last is None else str(last))
        answer = None
        try:
            answer = await _open(svc, p, accounting)
            svc.metrics.overhead.observe(accounting.started - arrived)
            return await deliver(accounting, answer)
        except UpstreamError as exc:
            if not exc.retryable:
                raise
            accounting.failure = str(exc)
            errors.append(f"{url}: {exc}")
            last = exc
        finally:
            if answer is not None:
                answer.close()
            accounting.end()
    raise _exhausted(errors, last, held_back)


def _exhausted(errors: list[str], last: UpstreamFailed | None,
               held_back: bool) -> UpstreamFailed:
    """The failure of a request no replica answered: the last attempt's status (a 429
    stays a 429, with its Retry-After), 503 if none was made."""
    if held_back:
        message = "retry budget exhausted after: " + "; ".join(errors)
    else:
        message = "no replica could take the request: " + (
            "; ".join(errors) or "the chosen replicas were removed")
    if last is None:
        return UpstreamFailed(message, 503)
    return UpstreamFailed(message, last.status, last.retry_after)


async def _open(svc: RouterService, p: Prepared,
                accounting: AttemptAccounting) -> UpstreamAnswer:
    """Send the request and read its answer up to the first content event when the
    replica streams it (our back end always does), all within ``first_byte_timeout_s``.
    Raises UpstreamError, having closed what it opened."""
    s, url = svc.settings, accounting.replica.url
    headers = {"content-type": "application/json", "x-request-id": p.request_id}
    if s.backend == "openai" and s.backend_api_key:
        headers["authorization"] = f"Bearer {s.backend_api_key}"
    streamed = p.stream or s.backend == "ours"
    if accounting.trace is not None:  # the replica continues the trace
        accounting.trace.inject(headers)
    response = answer = None
    try:
        async with asyncio.timeout(s.first_byte_timeout_s):
            response = await svc.upstream.post(url, p.path, p.body, headers)
            accounting.queued()
            if accounting.trace is not None:
                accounting.trace.responded(response.status)
            if response.status != 200:
                raise await _refusal(response, url, s.idle_timeout_s)
            answer = UpstreamAnswer(response, s.idle_timeout_s)
            if streamed:
                await answer.read_to_first_content()
    except (TimeoutError, OSError) as exc:
        if answer is not None:
            answer.close()
            raise UpstreamFailed("replica failed before its first token: "
                                 f"{describe(exc)}") from exc
        if response is not None:
            response.close()
            raise UpstreamFailed(f"replica answered {response.status} and then failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        raise UpstreamFailed(f"could not reach the replica: {type(exc).__name__}: {exc}"
                             ) from exc
    except BaseException:  # UpstreamError from reading, or cancelled (the client left)
        if answer is not None:
            answer.close()
        raise
    if streamed:
        accounting.first_content(answer.first_content_at)
    return answer


async def _refusal(response: Response, url: str, idle_timeout: float) -> UpstreamError:
    """What a replica's answer other than 200 means: UpstreamFailed for 429 and 5xx
    (another replica may take the request), else UpstreamRefused (passed on)."""
    try:
        body = await response.read(idle_timeout)
    finally:
        response.close()
    if response.status == 429 or response.status >= 500:
        return UpstreamFailed(f"replica answered {response.status}", response.status,
                              response.headers.get("retry-after"))
    return UpstreamRefused(response.status, body, dict(response.headers), url)
