"""The retry executor (router.forward) against scripted replicas, without sockets: which
replicas are asked, what the client's error says, and that every attempt's accounting ends
exactly once however the attempt ends."""

import asyncio

import pytest

from router.forward import RetryBudget, forward
from router.metrics import RouterMetrics
from router.policies import Candidate, Decision, RouteRequest
from router.proxy import UpstreamFailed, UpstreamRefused
from router.registry import Health
from router.requests import Prepared
from router.service import RouterService
from router.settings import RouterSettings

A, B, C = "http://a:1", "http://b:1", "http://c:1"


class FakeResponse:
    def __init__(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.status, self.body, self.headers = status, body, headers or {}

    async def read(self, idle_timeout=None) -> bytes:
        return self.body

    def close(self) -> None:
        pass


# what each replica does when asked: an exception to raise when sending, or an answer
REFUSED = ConnectionRefusedError("refused")
OK = FakeResponse(200, b"whole")
HALF = FakeResponse(200, b"half")  # breaks before the answer is complete (see _deliver)
BAD = FakeResponse(400, b'{"error": "bad"}', {"content-type": "application/json"})
BUSY = FakeResponse(429, b"", {"retry-after": "7"})
FAILING = FakeResponse(500)


async def _deliver(accounting, answer):
    """A collected answer: read whole, or UpstreamFailed if it breaks half-way."""
    body = await answer.response.read()
    if body == b"half":
        raise UpstreamFailed("replica failed before the answer was complete: cut", 503)
    accounting.answering()
    return accounting.replica.url, body


def _run(script: dict, max_attempts: int = 3, budget: RetryBudget | None = None,
         deliver=_deliver):
    """(result or raised exception, replicas asked in order, {url: (in_flight, failures,
    requests counted as outcomes)}) after forwarding one request through ``script``."""
    async def run():
        svc = RouterService(RouterSettings(backend="openai", policy="round_robin",
                                           max_attempts=max_attempts))
        svc.metrics = RouterMetrics(svc)
        if budget is not None:
            svc.retries = budget
        asked = []

        async def post(url, path, body, headers):
            asked.append(url)
            action = script[url]
            if isinstance(action, BaseException):
                raise action
            return action
        svc.upstream.post = post
        for url in (A, B, C):
            svc.registry.add(url).health = Health.HEALTHY
        p = Prepared("completion", "/v1/completions", "req-1", None, False, False, None,
                     RouteRequest("req-1", 10), b"{}")
        decision = Decision(A, "round robin", tuple(Candidate(u) for u in (A, B, C)))
        try:
            result = await forward(svc, p, decision, 0.0, deliver)
        except (UpstreamFailed, UpstreamRefused, asyncio.CancelledError) as exc:
            result = exc
        finally:
            await svc.upstream.close()
        ok = svc.metrics.requests
        state = {u: (r.in_flight, r.stats.failures, ok.labels(u, "ok").value)
                 for u, r in svc.registry.replicas.items()}
        return result, asked, state
    return asyncio.run(run())


def test_a_failure_before_the_answer_moves_on_to_the_next_replica():
    result, asked, state = _run({A: REFUSED, B: HALF, C: OK})
    assert result == (C, b"whole")
    assert asked == [A, B, C]
    assert state == {A: (0, 1, 0), B: (0, 1, 0), C: (0, 0, 1)}


def test_a_client_error_is_passed_on_at_once_and_is_not_the_replicas_fault():
    result, asked, state = _run({A: BAD, B: OK, C: OK})
    assert isinstance(result, UpstreamRefused)
    assert (result.status, result.body, result.replica) == (400, b'{"error": "bad"}', A)
    assert asked == [A]
    assert state == {A: (0, 0, 0), B: (0, 0, 0), C: (0, 0, 0)}


@pytest.mark.parametrize("script, max_attempts, status, retry_after, message", [
    ({A: BUSY, B: FAILING, C: BUSY}, 3, 429, "7",
     "no replica could take the request: http://a:1: replica answered 429; http://b:1: "
     "replica answered 500; http://c:1: replica answered 429"),
    ({A: FAILING, B: REFUSED, C: OK}, 2, 502, None,
     "no replica could take the request: http://a:1: replica answered 500; http://b:1: "
     "could not reach the replica: ConnectionRefusedError: refused"),
    ({A: REFUSED, B: HALF, C: OK}, 2, 503, None,
     "no replica could take the request: http://a:1: could not reach the replica: "
     "ConnectionRefusedError: refused; http://b:1: replica failed before the answer was "
     "complete: cut"),
])
def test_when_every_attempt_fails_the_error_names_each(script, max_attempts, status,
                                                       retry_after, message):
    result, asked, state = _run(script, max_attempts)
    assert isinstance(result, UpstreamFailed)
    assert (result.status, result.retry_after, str(result)) == (status, retry_after, message)
    assert asked == [A, B, C][:max_attempts]
    assert all(in_flight == 0 for in_flight, _, _ in state.values())


def test_an_exhausted_retry_budget_says_so():
    result, asked, state = _run({A: FAILING, B: OK, C: OK},
                                budget=RetryBudget(0.0, floor_per_s=0.0))
    assert isinstance(result, UpstreamFailed)
    assert (result.status, str(result)) == (
        500, "retry budget exhausted after: http://a:1: replica answered 500")
    assert asked == [A]
    assert state == {A: (0, 1, 0), B: (0, 0, 0), C: (0, 0, 0)}


def test_a_client_that_leaves_ends_the_attempt_without_blame():
    async def leave(accounting, answer):
        accounting.answering()  # a stream: the head went out, then the client left
        raise asyncio.CancelledError

    result, asked, state = _run({A: OK, B: OK, C: OK}, deliver=leave)
    assert isinstance(result, asyncio.CancelledError)
    assert asked == [A]
    assert state == {A: (0, 0, 1), B: (0, 0, 0), C: (0, 0, 0)}
