"""Turning a client's request into what the router routes and forwards.

Validation uses the replicas' wire schemas, so the router and a replica refuse the same
inputs with the same messages. For our back end the router tokenizes once (the same
tokenizer and template as the replicas) and forwards the token ids; internal fields are
the router's to set, never the client's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import random
import sys
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pybase64
from pydantic import ValidationError

from text import Tokenizer

from wire import jsonwire
from wire.errors import APIError, invalid
from wire.schemas import ChatCompletionRequest, CompletionRequest, chat_messages

from .policies import RouteRequest, text_keys
from .settings import RouterSettings
from .tenants import Tenant, Tenants

if TYPE_CHECKING:
    from .tracing import RequestTrace  # imports opentelemetry: only when tracing is on

INTERNAL_FIELDS = ("prompt_token_ids", "prompt_token_ids_b64")
TEXT_CHUNK_CHARS = 64  # approx_prefix unit for back ends the router cannot tokenize for


@dataclass
class Prepared:
    kind: str  # "completion" or "chat"
    path: str
    request_id: str
    model: str | None
    stream: bool
    include_usage: bool
    salt: str | None
    route: RouteRequest
    body: bytes  # what goes upstream
    probe_body: bytes = b""  # the /probe_reuse body (our back end)
    tenant: Tenant | None = None  # with --api-keys: whose request this is
    trace: RequestTrace | None = None  # when tracing is on: its spans (router.tracing)


def json_object(raw: bytes) -> dict:
    """The body as a JSON object; APIError 400 otherwise."""
    try:
        data = jsonwire.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def parse_body(raw: bytes, kind: str):
    """JSON body -> (dict, validated model); APIError 400 on anything malformed or not
    supported by our replicas."""
    data = json_object(raw)
    for name in INTERNAL_FIELDS:
        data.pop(name, None)
    schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return data, schema.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc.errors()) from None


def tenant_salt(secret: str | None, api_key: str | None, client_salt: str | None) -> str | None:
    """The salt sent to replicas without ``--api-keys`` (with it: ``Tenant.salt``, from the
    tenant's name). With a tenant secret: HMAC(secret, API key), narrowed by
    the client's own ``cache_salt``, so a client can split its own sharing but never reach
    another tenant's blocks. Without one (a single tenant), the client's salt as given."""
    if secret is None:
        return client_salt or None
    tenant = hmac.new(secret.encode(), (api_key or "").encode(), hashlib.sha256).hexdigest()
    return tenant[:32] + (f"/{client_salt}" if client_salt else "")


class RequestBuilder:
    def __init__(self, settings: RouterSettings, tokenizer: Tokenizer | None,
                 tenants: Tenants | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer  # None until known (loaded from a replica)
        self.tenants = tenants  # --api-keys: every request authenticates first
        self._session_header = settings.session_header.lower()
        # request ids: 128 random bits like uuid4().hex, without its getrandom() system
        # call per request (seeded from os.urandom; never from --seed, so ids never repeat
        # across restarts)
        self._ids = random.Random()

    def prepare(self, kind: str, raw: bytes, headers: dict[str, str]) -> Prepared:
        """``headers``: the client's, names in lower case."""
        request_id = headers.get("x-request-id") or "%032x" % self._ids.getrandbits(128)
        api_key = _bearer(headers.get("authorization"))
        # with --api-keys: 401 before anything else is looked at; the salt is the tenant's
        tenant = self.tenants.authenticate(api_key) if self.tenants is not None else None
        if self.settings.backend == "openai":
            return self._pass_through(kind, raw, headers, request_id, tenant)
        data, req = parse_body(raw, kind)
        salt = (tenant.salt(req.cache_salt) if tenant is not None else
                tenant_salt(self.settings.tenant_secret, api_key, req.cache_salt))
        session = headers.get(self._session_header) or req.user
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        ids = self._token_bytes(req, kind)  # little-endian uint32 token ids
        num_tokens = len(ids) // 4
        limit = self.settings.max_prompt_tokens
        if limit is not None and num_tokens > limit:
            raise APIError(400, f"prompt has {num_tokens} tokens; this router accepts at "
                           f"most {limit}", param="prompt", code="context_length_exceeded")
        tpb = self.settings.tokens_per_block
        route = RouteRequest(request_id, num_tokens, unit_tokens=tpb, session_key=session,
                             keys_from=(ids, tpb * 4, salt or ""))  # keys when first needed
        b64 = pybase64.b64encode(ids)  # SIMD: ~12x binascii on 16 KiB
        salt_json = b"null" if salt is None else jsonwire.dumps(salt)
        # base64 needs no JSON escaping: the large field is spliced in, not serialised (one
        # join: each ``+`` would copy it again)
        probe = b"".join((b'{"token_ids_b64":"', b64, b'","cache_salt":', salt_json, b"}"))
        return Prepared(kind, _path(kind), request_id, req.model, req.stream, include_usage,
                        salt, route, self._forward_body(data, kind, b64, salt), probe, tenant)

    def _pass_through(self, kind: str, raw: bytes, headers, request_id: str,
                      tenant: Tenant | None) -> Prepared:
        """Other back ends get the client's body unchanged; the router only reads enough of
        it to route (model, stream, a text rendering for approx_prefix)."""
        data = json_object(raw)
        field = "messages" if kind == "chat" else "prompt"
        if not data.get(field):
            raise APIError(400, f"{field} is required and must not be empty", param=field)
        text = json.dumps(data[field], separators=(",", ":"))
        session = headers.get(self._session_header) or data.get("user")
        route = RouteRequest(request_id, max(1, len(text) // 4),
                             text_keys(text, TEXT_CHUNK_CHARS), TEXT_CHUNK_CHARS // 4,
                             session if isinstance(session, str) else None)
        stream = data.get("stream") is True
        include_usage = bool((data.get("stream_options") or {}).get("include_usage"))
        model = data.get("model") if isinstance(data.get("model"), str) else None
        return Prepared(kind, _path(kind), request_id, model, stream, include_usage, None,
                        route, raw, tenant=tenant)

    def _token_bytes(self, req, kind: str) -> bytes:
        """The prompt's token ids as little-endian uint32 bytes (the wire form)."""
        tokenizer = self.tokenizer
        if tokenizer is None:  # none given, and no replica admitted yet to take it from
            raise APIError(503, "no healthy replica yet (the router takes its tokenizer from "
                           "the first one, or from --tokenizer DIR)", type="server_error",
                           code="no_replica", headers={"Retry-After": "1"})
        if kind == "chat":
            try:
                return tokenizer.render_chat_le32(chat_messages(req.messages))
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
        p = req.prompt
        text = p if isinstance(p, str) else p[0] if isinstance(p[0], str) else None
        if text is not None:
            try:
                return tokenizer.encode_le32(text)
            except ValueError as exc:
                raise APIError(400, f"prompt: {exc}", param="prompt") from None
        first = p[0]
        ids = first if isinstance(first, list) else p
        vocab = tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt has token id {bad}, outside the vocabulary "
                           f"[0, {vocab})", param="prompt", code="invalid_token_id")
        data = array("I", ids)
        if sys.byteorder != "little":
            data.byteswap()
        return data.tobytes()

    @staticmethod
    def _forward_body(data: dict, kind: str, tokens_b64: bytes, salt: str | None) -> bytes:
        body = dict(data)
        if kind == "completion":
            body.pop("prompt", None)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if salt:
            body["cache_salt"] = salt
        else:
            body.pop("cache_salt", None)
        head = jsonwire.dumps(body)  # never empty: "stream" is set
        return b"".join((head[:-1], b',"prompt_token_ids_b64":"', tokens_b64, b'"}'))


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


def _bearer(value: str | None) -> str | None:
    if value and value.lower().startswith("bearer "):
        return value[7:].strip() or None
    return None
