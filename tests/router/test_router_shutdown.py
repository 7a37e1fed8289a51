"""``python -m router`` on SIGTERM: running requests finish, no new connection is taken, and
another signal ends what still runs at once."""

import signal
import time

import httpx
import pytest

from tests.router.cluster import cluster

# ~20 ms per generated token: a stream of 40 tokens takes about a second
SLOW = ("--sim-step-overhead-s", "0.02")


def stream_events(router, max_tokens: int):
    """An open streaming request through the router; yields its data lines."""
    body = {"prompt": "hello", "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield line


def test_sigterm_lets_a_running_stream_finish_then_the_router_exits():
    with cluster(1, replica_args=SLOW) as (router, _):
        events = stream_events(router, 40)
        first = next(events)
        router.signal(signal.SIGTERM)
        rest = list(events)
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
        assert len(rest) >= 40  # every token, the finish, [DONE]
        assert router.proc.wait(10) == 0


def refuses_connections(router, tries: int = 500) -> None:
    """Wait until the router's listening socket is closed (a bounded poll)."""
    for _ in range(tries):
        try:
            httpx.get(router.url + "/health", timeout=5)
        except httpx.ConnectError:
            return
        time.sleep(0.01)
    raise AssertionError(f"{router.url} still takes connections after SIGTERM")


def test_after_sigterm_new_connections_are_refused_and_a_second_signal_ends_it_now():
    with cluster(1, replica_args=SLOW) as (router, _):
        events = stream_events(router, 2000)  # ~40 s
        next(events)
        router.signal(signal.SIGTERM)
        refuses_connections(router)
        # the stream still flows: 50 more events (~1 s of generation, more than was
        # buffered when the socket closed) arrive before the router is told to stop now
        assert all(next(events).startswith("data: {") for _ in range(50))
        assert router.proc.poll() is None
        router.signal(signal.SIGTERM)
        # well before the stream's 40 s: the second signal ended it, the stream did not
        assert router.proc.wait(10) == 0
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            list(events)  # the stream was cut, not finished
