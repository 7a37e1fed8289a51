"""Tenants and their limits (router/tenants.py, router/api_keys.py), on a fake clock: exact
counts at the window's edges, exact Retry-After, token limits on the tokenized prompt,
concurrency slots, salts, authentication, and the API keys file's errors. No sleeps."""

from __future__ import annotations

import asyncio
import hashlib
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from router.api_keys import ApiKeysFile, Limits, load_api_keys
from router.app import create_app
from router.settings import RouterSettings, parse_args
from router.stats import RouterStats, stats_view
from router.tenants import (CONCURRENCY, REQUESTS, TOKENS, TOO_LARGE, Admission, Refusal,
                            SlidingWindow, Tenant, Tenants, tenant_salt)
from wire.errors import APIError

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    """A ``time.monotonic`` the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tenant(clock: Clock, **limits) -> Tenant:
    return Tenant("acme", Limits(**limits), "salt", clock)


def refused(t: Tenant, prompt_tokens: int = 1) -> APIError:
    with pytest.raises(APIError) as info:
        t.admit(prompt_tokens)
    return info.value


def before(x: float) -> float:
    """The float just below ``x``: one tick earlier."""
    return math.nextafter(x, -math.inf)


# -- the sliding window ----------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 20),
       steps=st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 7.25, 30.0, 59.75, 60.0, 61.0]),
                                st.integers(1, 20)), max_size=120))
def test_the_window_agrees_with_a_slow_reference(limit, steps):
    """Admit whatever fits, step by step; at each step ``used`` and ``free_at`` equal what a
    scan of every admission ever made says (counted in [t, t + 60))."""
    window = SlidingWindow(limit)
    admitted: list[tuple[float, int]] = []
    now = 0.0
    for dt, amount in steps:
        now += dt
        amount = min(amount, limit)
        live = [(t, a) for t, a in admitted if t + 60.0 > now]
        assert window.used(now) == sum(a for _, a in live)
        expected = None
        if sum(a for _, a in live) + amount > limit:
            # the earliest entry whose leaving makes room
            freed = 0
            for t, a in live:
                freed += a
                if sum(a for _, a in live) - freed + amount <= limit:
                    expected = t + 60.0
                    break
        assert window.free_at(amount, now) == expected
        if expected is None:
            window.add(amount, now)
            admitted.append((now, amount))


def test_the_window_forgets_what_left_it():
    window = SlidingWindow(1)
    for i in range(5000):
        assert window.free_at(1, 60.0 * i) is None
        window.add(1, 60.0 * i)
    assert len(window._times) <= 1024 + 1  # bounded: what left was dropped
    assert window.used(60.0 * 4999) == 1


def test_an_amount_over_the_limit_never_fits():
    with pytest.raises(ValueError, match="never fits"):
        SlidingWindow(5).free_at(6, 0.0)


# -- requests per minute -----------------------------------------------------------------

@pytest.mark.parametrize("gaps, retry_after", [
    ((0.0, 0.0, 0.0), 60),  # all at once: the oldest leaves in 60 s
    ((0.0, 20.0, 20.0), 20),  # the oldest came 40 s before: 20 s
    ((0.0, 0.25, 29.5), 31),  # 30.25 s from now: rounded up
])
def test_the_nth_request_passes_the_next_waits_exactly(gaps, retry_after):
    clock = Clock()
    t = tenant(clock, requests_per_minute=3)
    first = clock.now
    times = []
    for gap in gaps:
        clock.now += gap
        times.append(clock.now)
        t.admit(1).release()
    err = refused(t)
    assert (err.status, err.type, err.code) == (429, "rate_limit_error", REQUESTS)
    assert err.headers == {"Retry-After": str(retry_after)}
    assert "3 requests per minute" in err.message
    assert t.try_admit(1) == Refusal(REQUESTS, first + 60.0 - clock.now)
    clock.now = before(first + 60.0)  # a tick before the oldest leaves: still refused
    assert isinstance(t.try_admit(1), Refusal)
    clock.now = first + 60.0  # the instant it leaves: passes
    assert isinstance(t.try_admit(1), Admission)
    still = sum(1 for at in times if at + 60.0 > clock.now)  # the others that came later
    assert t.request_window.used(clock.now) == 1 + still
    assert (t.requests, t.refused[REQUESTS]) == (4, 3)


def test_refused_requests_count_against_nothing():
    clock = Clock()
    t = tenant(clock, requests_per_minute=2)
    t.admit(1)
    clock.now += 10
    t.admit(1)
    for _ in range(50):  # hammering while full does not push the window out
        clock.now += 0.5
        refused(t)
    clock.now = 1000.0 + 60.0  # the first leaves at 60 s, as if nothing had been refused
    t.admit(1)
    assert t.request_window.used(clock.now) == 2
    assert (t.requests, t.refused[REQUESTS]) == (3, 50)


# -- prompt tokens per minute ------------------------------------------------------------

def test_token_limits_count_the_tokenized_prompt():
    clock = Clock()
    t = tenant(clock, prompt_tokens_per_minute=100)
    t.admit(60)
    clock.now += 15
    t.admit(30)  # 90 in the window
    t.admit(10)  # exactly the limit: passes
    clock.now += 5
    err = refused(t, 1)  # 101 would be over
    assert (err.status, err.code, err.headers) == (429, TOKENS, {"Retry-After": "40"})
    assert "100 prompt tokens per minute" in err.message
    clock.now = 1000.0 + 60.0  # the 60 leave: 40 used, 60 free
    assert isinstance(t.try_admit(60), Admission)
    # 100 in the window again (30 + 10 + 60); 35 tokens need the 30 and the 10 to leave
    assert t.try_admit(35) == Refusal(TOKENS, 15.0)
    assert t.token_window.used(clock.now) == 100


def test_a_prompt_over_the_token_limit_is_a_400_never_retried():
    clock = Clock()
    t = tenant(clock, prompt_tokens_per_minute=100, requests_per_minute=5)
    err = refused(t, 101)
    assert (err.status, err.type, err.code) == (400, "invalid_request_error", TOO_LARGE)
    assert "101 tokens" in err.message and "100 prompt tokens per minute" in err.message
    assert "Retry-After" not in err.headers
    assert isinstance(t.try_admit(100), Admission)  # at the limit: passes, nothing counted
    assert t.request_window.used(clock.now) == 1
    assert t.refused == {REQUESTS: 0, TOKENS: 0, CONCURRENCY: 0, TOO_LARGE: 1}


def test_when_both_windows_are_full_the_later_one_decides():
    clock = Clock()
    t = tenant(clock, requests_per_minute=2, prompt_tokens_per_minute=10)
    t.admit(1)  # at 1000
    clock.now = 1030.0
    t.admit(9)  # both windows full
    clock.now = 1040.0
    # one token: both windows have room at 1060 (the first request leaves, with its token)
    assert t.try_admit(1) == Refusal(REQUESTS, 20.0)
    # two tokens: the 9 of 1030 must leave too, at 1090
    err = refused(t, 2)
    assert (err.code, err.headers["Retry-After"]) == (TOKENS, "50")
    clock.now = 1060.0
    t.admit(1)
    clock.now = before(1090.0)
    assert isinstance(t.try_admit(2), Refusal)
    clock.now = 1090.0
    assert isinstance(t.try_admit(2), Admission)
    # the refusal just before 1090 was a tie (both free at 1090): named after requests
    assert t.refused == {REQUESTS: 2, TOKENS: 1, CONCURRENCY: 0, TOO_LARGE: 0}


# -- concurrency ---------------------------------------------------------------------------

def test_a_concurrency_slot_is_held_until_released():
    clock = Clock()
    t = tenant(clock, concurrent_requests=2)
    a, b = t.admit(1), t.admit(1)
    err = refused(t)
    assert (err.status, err.code, err.headers) == (429, CONCURRENCY, {"Retry-After": "1"})
    a.release()  # finished
    c = t.admit(1)
    assert t.in_flight == 2
    b.release()
    c.release()
    assert t.in_flight == 0
    with pytest.raises(RuntimeError, match="released twice"):
        c.release()
    assert (t.requests, t.refused[CONCURRENCY]) == (3, 1)


def test_a_cancelled_request_gives_its_slot_back():
    """As ``router.app``'s handler does: admit, then ``finally: release``; the client
    leaving cancels the handler."""
    t = tenant(Clock(), concurrent_requests=1)
    started = asyncio.Event()

    async def handler():
        admission = t.admit(1)
        try:
            started.set()
            await asyncio.Event().wait()  # streaming, until the client leaves
        finally:
            admission.release()

    async def scenario():
        task = asyncio.create_task(handler())
        await started.wait()
        assert t.in_flight == 1 and refused(t).code == CONCURRENCY
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert t.in_flight == 0
        t.admit(1).release()  # the next one passes

    asyncio.run(scenario())


def test_a_tenant_without_limits_takes_anything():
    t = tenant(Clock())
    slots = [t.admit(10**9) for _ in range(1000)]
    assert t.in_flight == 1000 and t.window_usage() == (None, None)
    for s in slots:
        s.release()


# -- keys, default, salts ------------------------------------------------------------------

SPEC = {
    "tenants": {
        "acme": {"keys": ["acme-key-1", "sha256:" + hashlib.sha256(b"acme-key-2").hexdigest()],
                 "limits": {"requests_per_minute": 3}},
        "beta": {"keys": ["beta-key"]},
        "guest": {"limits": {"requests_per_minute": 1}},
    },
    "default": "guest",
}


def tenants(spec: dict, secret: str | None = None, clock=None) -> Tenants:
    return Tenants(ApiKeysFile.model_validate(spec), secret, clock or Clock())


def test_keys_plain_or_hashed_name_their_tenant_and_others_get_the_default():
    ts = tenants(SPEC)
    assert ts.authenticate("acme-key-1") is ts.authenticate("acme-key-2") is ts.by_name["acme"]
    assert ts.authenticate("beta-key") is ts.by_name["beta"]
    assert ts.authenticate("unknown") is ts.authenticate(None) is ts.by_name["guest"]
    assert ts.unauthenticated == 0


def test_with_default_reject_an_unknown_or_missing_key_is_a_401():
    ts = tenants({"tenants": {"acme": {"keys": ["acme-key-1"]}}, "default": "reject"})
    for key, message in (("nope", "invalid API key"), (None, "no API key")):
        with pytest.raises(APIError) as info:
            ts.authenticate(key)
        err = info.value
        assert (err.status, err.type, err.code) == (401, "authentication_error",
                                                    "invalid_api_key")
        assert err.message.startswith(message) and "nope" not in err.message
    assert ts.unauthenticated == 2


def test_an_inline_default_is_a_tenant_of_its_own():
    ts = tenants({"tenants": {"acme": {"keys": ["k"]}},
                  "default": {"limits": {"concurrent_requests": 1}}})
    guest = ts.authenticate("anything")
    assert guest.name == "default" and guest.limits.concurrent_requests == 1
    assert ts.authenticate(None) is guest and ts.default is guest


def test_salts_are_per_tenant_name():
    ts = tenants(SPEC)
    acme, beta = ts.by_name["acme"], ts.by_name["beta"]
    expected = hashlib.sha256(b"tenant:acme").hexdigest()[:32]
    assert acme.salt(None) == expected == tenant_salt(None, "acme")
    assert acme.salt("mine") == expected + "/mine"  # the client narrows its own sharing
    assert beta.salt(None) != acme.salt(None)
    keyed = tenants(SPEC, secret="s3cret").by_name["acme"]
    assert keyed.salt(None) == tenant_salt("s3cret", "acme") != expected
    assert tenant_salt("s3cret", "acme") != tenant_salt("other", "acme")


# -- the API keys file ---------------------------------------------------------------------

GOOD = """\
tenants:
  acme:
    keys: [acme-key]
    limits: {requests_per_minute: 600}
  beta:
    keys: ["sha256:%s"]
default: reject
""" % hashlib.sha256(b"beta-key").hexdigest()


@pytest.mark.parametrize("text, expected", [
    (None, "cannot read it: [Errno 2] No such file"),
    ("tenants: [unclosed\n", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping with `tenants:`"),
    ("tenants:\n  a: {keys: [k]}\n  a: {keys: [j]}\n", "'a' is given twice"),
    ("tenants: {a: {keys: [k], limits: {rpm: 3}}}\n", "tenants.a.limits.rpm: Extra inputs"),
    ("tenants: {a: {keys: [k], quota: 3}}\n", "tenants.a.quota: Extra inputs"),
    ("tenants: {a: {keys: [k]}}\nreject: true\n", "reject: Extra inputs"),
    ("tenants: {a: {keys: [k]}, b: {keys: [j, k]}}\n",
     "tenants.b.keys[1]: the key sha256:%s... is already tenants.a.keys[0]"
     % hashlib.sha256(b"k").hexdigest()[:12]),
    ("tenants: {a: {keys: [k]}, b: {keys: ['sha256:%s']}}\n" % hashlib.sha256(b"k").hexdigest(),
     "tenants.b.keys[0]: the key sha256:"),  # the same key, hashed
    ("tenants: {a: {keys: [k]}}\ndefault: zed\n",
     "default: 'zed' is neither 'reject' nor a tenant of this file (a)"),
    ("tenants: {a: {keys: [k]}}\ndefault: 3\n", "default: must be 'reject', a tenant's name"),
    ("tenants: {default: {keys: [k]}}\ndefault: {limits: {}}\n", "already has one"),
    ("tenants: {a: {keys: [k]}, b: {}}\n", "tenants.b: no keys, and it is not the default"),
    ("tenants: {a: {keys: ['sha256:12ab']}}\n", "tenants.a.keys[0]: starts with sha256:"),
    ("tenants: {a: {keys: ['two words']}}\n", "tenants.a.keys[0]: empty or holds whitespace"),
    ("tenants: {'a b': {keys: [k]}}\n", "tenants.a b (the name): 'a b' is not a tenant name"),
    ("tenants: {a: {keys: [k], limits: {concurrent_requests: 0}}}\n",
     "tenants.a.limits.concurrent_requests: Input should be greater than or equal to 1"),
    ("default: reject\n", "tenants: Field required"),
])
def test_a_bad_file_names_the_file_the_entry_and_the_field(tmp_path, text, expected):
    path = tmp_path / "keys.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_api_keys(str(path))
    message = str(info.value)
    assert message.startswith(f"--api-keys {path}: "), message
    assert expected in message, message


def test_an_error_never_echoes_a_plain_key(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: {a: {keys: [sk-live-7f3a]}, b: {keys: [sk-live-7f3a]}}\n")
    with pytest.raises(ValueError, match="already tenants.a.keys") as info:
        load_api_keys(str(path))
    assert "sk-live-7f3a" not in str(info.value)


def test_a_good_file_and_the_shipped_example_load(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(GOOD)
    ts = Tenants(load_api_keys(str(path)))
    assert ts.authenticate("beta-key").name == "beta" and ts.default is None
    example = Tenants(load_api_keys(str(ROOT / "config" / "api-keys.example.yaml")))
    assert len(example.by_name) >= 2
    assert example.authenticate("dev-key-acme-1").name == "acme"


def test_the_setting_from_flag_environment_and_config(tmp_path, monkeypatch):
    cfg = tmp_path / "r.yaml"
    assert RouterSettings().api_keys is None
    cfg.write_text("router:\n  api_keys: /etc/router/keys.yaml\n")
    assert parse_args(["--config", str(cfg)]).api_keys == "/etc/router/keys.yaml"
    monkeypatch.setenv("ROUTER_API_KEYS", "/env/keys.yaml")
    assert parse_args(["--config", str(cfg)]).api_keys == "/env/keys.yaml"
    assert parse_args(["--api-keys", "/flag.yaml"]).api_keys == "/flag.yaml"


def test_the_router_refuses_to_start_on_a_bad_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: {a: {keys: [k]}}\ndefault: nobody\n")
    done = subprocess.run([sys.executable, "-m", "router", "--api-keys", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--api-keys {path}: default: 'nobody' is neither" in done.stderr


# -- metrics and /stats --------------------------------------------------------------------

def test_metrics_and_stats_per_tenant(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(GOOD)
    app = create_app(RouterSettings(api_keys=str(path)))
    svc = app.service
    acme = svc.tenants.authenticate("acme-key")
    slot = acme.admit(40)
    acme.answered(40, 32)
    acme.admit(8).release()
    with pytest.raises(APIError):
        svc.tenants.authenticate("wrong")
    text = generate_latest(svc.metrics.registry).decode()
    for line in ('router_tenant_requests_total{tenant="acme"} 2.0',
                 'router_tenant_requests_total{tenant="beta"} 0.0',
                 'router_tenant_rejected_total{reason="unauthenticated",tenant=""} 1.0',
                 'router_tenant_rejected_total{reason="rate_limit_requests",tenant="acme"} 0.0',
                 'router_tenant_prompt_tokens_total{tenant="acme"} 40.0',
                 'router_tenant_cached_tokens_total{tenant="acme"} 32.0',
                 'router_tenant_in_flight{tenant="acme"} 1.0'):
        assert line in text, line
    view = RouterStats.model_validate(stats_view(svc)).tenants  # the declared schema holds
    assert (view.default, view.unauthenticated) == ("reject", 1)
    assert [t.name for t in view.tenants] == ["acme", "beta"]  # most requests first
    first = view.tenants[0]
    assert (first.requests, first.rejected, first.prompt_tokens, first.cached_tokens,
            first.hit_rate, first.in_flight) == (2, 0, 40, 32, 0.8, 1)
    assert first.limits.requests_per_minute == 600 and first.limits.concurrent_requests is None
    assert (first.requests_last_minute, first.prompt_tokens_last_minute) == (2, None)
    slot.release()


def test_without_api_keys_nothing_changes():
    app = create_app(RouterSettings())
    assert app.service.tenants is None and app.service.builder.tenants is None
    assert stats_view(app.service)["tenants"] is None
    assert "router_tenant" not in generate_latest(app.service.metrics.registry).decode()
