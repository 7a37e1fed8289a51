"""Tenants: who a request is for (its API key), their cache salt, and their limits.

With ``--api-keys FILE`` (``router/api_keys.py``) every request names its tenant by
``Authorization: Bearer KEY``; a tenant's keys share its limits and its cache.

    tenants = Tenants(load_api_keys(path), secret, clock=time.monotonic)
    tenant = tenants.authenticate(api_key)        # APIError 401, or the default tenant
    admission = tenant.admit(prompt_tokens)       # APIError 429 / 400; counted from here
    try: ... finally: admission.release()         # the concurrency slot

Requests per minute and prompt tokens per minute are exact sliding windows of 60 s: what
was admitted at t counts until t + 60 s, and not an instant longer. A refused request
counts against nothing. The counters live in this router process only: several routers
each enforce their own.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from wire.errors import APIError

from .api_keys import INLINE_DEFAULT, REJECT, ApiKeysFile, InlineDefault, Limits, key_hash

WINDOW_S = 60.0
# why a request was refused: the error code of its answer, and a metric label
REQUESTS, TOKENS, CONCURRENCY = "rate_limit_requests", "rate_limit_tokens", "concurrency_limit"
TOO_LARGE = "prompt_over_token_limit"
REFUSALS = (REQUESTS, TOKENS, CONCURRENCY, TOO_LARGE)
_COMPACT_AT = 1024  # window entries that left it, dropped from memory in one go


class SlidingWindow:
    """Amounts admitted in the last ``span_s`` seconds, exactly: an amount admitted at ``t``
    counts in ``[t, t + span_s)``. Admitting is O(1) amortised; the instant a refused amount
    would fit is a bisection over cumulative sums. Memory: an entry per admission still in
    the window, plus those that left since the last compaction: at most the larger of
    ``_COMPACT_AT`` and the number still in the window."""

    def __init__(self, limit: int, span_s: float = WINDOW_S) -> None:
        self.limit, self.span = limit, span_s
        self._times: list[float] = []  # admission instants, oldest first
        self._ends: list[int] = []  # amount admitted up to and including each entry
        self._head = 0  # entries before it have left the window
        self._total = 0  # amount ever admitted (the last of _ends)
        self._left = 0  # amount that has left the window (_ends[_head - 1])

    def used(self, now: float) -> int:
        self._expire(now)
        return self._total - self._left

    def free_at(self, amount: int, now: float) -> float | None:
        """None if ``amount`` fits now; else the instant it will (if nothing else is
        admitted before). ``amount`` must not exceed the limit: it would never fit."""
        if amount > self.limit:
            raise ValueError(f"{amount} never fits in a window of {self.limit}")
        excess = self.used(now) + amount - self.limit
        if excess <= 0:
            return None
        # the oldest entries leave first: the one whose leaving frees ``excess``
        i = bisect_left(self._ends, self._left + excess, self._head)
        return self._times[i] + self.span

    def add(self, amount: int, now: float) -> None:
        self._total += amount
        self._times.append(now)
        self._ends.append(self._total)

    def _expire(self, now: float) -> None:
        times, head, span = self._times, self._head, self.span
        while head < len(times) and times[head] + span <= now:
            head += 1
        if head == self._head:
            return
        self._left = self._ends[head - 1]
        if head >= _COMPACT_AT and 2 * head >= len(times):  # each entry moves at most once
            del times[:head], self._ends[:head]
            head = 0
        self._head = head


@dataclass(frozen=True)
class Refusal:
    """Why a tenant's request is refused, and how many seconds from now it would pass if
    nothing else were admitted first (None: never, or not known: a concurrency slot frees
    when some request ends)."""

    reason: str  # one of REFUSALS
    retry_after_s: float | None = None


class Admission:
    """An admitted request's concurrency slot, until ``release`` (exactly once)."""

    __slots__ = ("tenant", "_held")

    def __init__(self, tenant: Tenant) -> None:
        self.tenant, self._held = tenant, True
        tenant.in_flight += 1

    def release(self) -> None:
        if not self._held:
            raise RuntimeError(f"a request of tenant {self.tenant.name} was released twice")
        self._held = False
        self.tenant.in_flight -= 1


class Tenant:
    """One tenant: its limits (shared by all its keys), cache salt and counters."""

    def __init__(self, name: str, limits: Limits, salt: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.limits, self._salt, self._clock = name, limits, salt, clock
        rpm, tpm = limits.requests_per_minute, limits.prompt_tokens_per_minute
        self.request_window = SlidingWindow(rpm) if rpm is not None else None
        self.token_window = SlidingWindow(tpm) if tpm is not None else None
        self.in_flight = 0
        self.requests = 0  # admitted
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.prompt_tokens = self.cached_tokens = 0  # from the answers' usage

    def salt(self, client_salt: str | None) -> str:
        """The salt sent to replicas: the tenant's, narrowed by the client's own
        ``cache_salt`` (a client can split its tenant's sharing, never reach another's)."""
        return self._salt + (f"/{client_salt}" if client_salt else "")

    def try_admit(self, prompt_tokens: int) -> Admission | Refusal:
        """Admit a request of ``prompt_tokens`` (the tokenized prompt) now, or say why not.
        Only an admitted request counts against the windows."""
        now = self._clock()
        tokens = self.token_window
        if tokens is not None and prompt_tokens > tokens.limit:
            return self._refuse(Refusal(TOO_LARGE))
        waits = [(window.free_at(amount, now), reason) for window, amount, reason in
                 ((self.request_window, 1, REQUESTS), (tokens, prompt_tokens, TOKENS))
                 if window is not None]
        late = max(((at, reason) for at, reason in waits if at is not None),
                   key=lambda wait: wait[0], default=None)  # a tie: the first, requests
        if late is not None:  # passes once every window has room: the latest of them
            return self._refuse(Refusal(late[1], late[0] - now))
        cap = self.limits.concurrent_requests
        if cap is not None and self.in_flight >= cap:
            return self._refuse(Refusal(CONCURRENCY))
        for window, amount in ((self.request_window, 1), (tokens, prompt_tokens)):
            if window is not None:
                window.add(amount, now)
        self.requests += 1
        return Admission(self)

    def admit(self, prompt_tokens: int) -> Admission:
        """``try_admit``, with a refusal as the client's error: 429 with ``Retry-After``
        (whole seconds, rounded up: the request passes then, if nothing else is admitted
        before), or 400 for a prompt larger than the tokens-per-minute limit (it never
        passes, so a client must not retry it)."""
        result = self.try_admit(prompt_tokens)
        if isinstance(result, Refusal):
            raise _refusal_error(self, result, prompt_tokens)
        return result

    def answered(self, prompt_tokens: int, cached_tokens: int) -> None:
        """An answer's usage (for the hit rate: cached / prompt tokens)."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def window_usage(self) -> tuple[int | None, int | None]:
        """(requests, prompt tokens) admitted in the last 60 s; None where unlimited."""
        now = self._clock()
        return tuple(w.used(now) if w is not None else None  # type: ignore[return-value]
                     for w in (self.request_window, self.token_window))

    def _refuse(self, refusal: Refusal) -> Refusal:
        self.refused[refusal.reason] += 1
        return refusal


_WINDOW_LIMITS = {REQUESTS: "requests_per_minute", TOKENS: "prompt_tokens_per_minute"}


def _refusal_error(tenant: Tenant, refusal: Refusal, prompt_tokens: int) -> APIError:
    limits, name = tenant.limits, tenant.name
    if refusal.reason == TOO_LARGE:
        return APIError(400, f"the prompt has {prompt_tokens} tokens, more than tenant "
                        f"{name}'s limit of {limits.prompt_tokens_per_minute} prompt tokens "
                        "per minute: it can never pass", code=TOO_LARGE)
    if refusal.reason == CONCURRENCY:
        retry_after = 1  # a slot frees when one of the tenant's requests ends: unknown
        message = (f"tenant {name} has {limits.concurrent_requests} requests running, its "
                   "limit (concurrent_requests)")
    else:
        field = _WINDOW_LIMITS[refusal.reason]
        retry_after = max(1, math.ceil(refusal.retry_after_s))
        message = (f"tenant {name} is over its limit of {getattr(limits, field)} "
                   f"{field.replace('_', ' ')} ({field}); retry in {retry_after} s")
    return APIError(429, message, type="rate_limit_error", code=refusal.reason,
                    headers={"Retry-After": str(retry_after)})


class Tenants:
    """The tenants of an API keys file, looked up by key."""

    def __init__(self, spec: ApiKeysFile, secret: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        def make(name: str, limits: Limits) -> Tenant:
            return Tenant(name, limits, tenant_salt(secret, name), clock)

        self.by_name = {name: make(name, t.limits) for name, t in spec.tenants.items()}
        # Keys are looked up by their SHA-256 in a dict, not compared one by one: what a
        # lookup's timing can reveal is where the *hash* of a guess lands, which says
        # nothing usable about any key (finding a key from its hash is a preimage attack).
        # hmac.compare_digest over every key would cost O(keys) per request for no gain.
        self._by_hash = {digest: self.by_name[name]
                         for name, t in spec.tenants.items() for digest in t.keys}
        default = spec.default
        if isinstance(default, InlineDefault):
            self.by_name[INLINE_DEFAULT] = make(INLINE_DEFAULT, default.limits)
            default = INLINE_DEFAULT
        self.default: Tenant | None = None if default == REJECT else self.by_name[default]
        self.unauthenticated = 0  # requests refused 401

    def authenticate(self, api_key: str | None) -> Tenant:
        """The key's tenant; the default tenant for an unknown or missing key; else
        APIError 401."""
        tenant = self._by_hash.get(key_hash(api_key)) if api_key else None
        if tenant is not None:
            return tenant
        if self.default is not None:
            return self.default
        self.unauthenticated += 1
        raise APIError(401, "invalid API key" if api_key else
                       "no API key: send it as `Authorization: Bearer KEY`",
                       type="authentication_error", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})


def tenant_salt(secret: str | None, name: str) -> str:
    """A tenant's salt: HMAC-SHA256(``--tenant-secret``, "tenant:" + name) when a secret is
    set (replicas cannot tell which tenant a salt is), else SHA-256 of the same; 32 hex
    digits either way. Tenants never share a salt, a tenant's keys always do."""
    data = f"tenant:{name}".encode()
    digest = (hmac.new(secret.encode(), data, hashlib.sha256) if secret is not None
              else hashlib.sha256(data))
    return digest.hexdigest()[:32]
