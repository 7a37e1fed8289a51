"""Router settings: command-line flags > ``ROUTER_*`` environment > YAML file > defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from wire.settings import merge_settings, settings_from_argv

ENV_PREFIX = "ROUTER_"


class RouterSettings(BaseSettings):
    """Every setting of ``python -m router``; each field is also ``ROUTER_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # Replica base URLs, comma-separated on the command line and in the environment.
    replicas: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Replicas found through DNS (a Kubernetes headless Service): HOST:PORT, re-resolved
    # every discover_interval_s; each address becomes http://IP:PORT (same checks as any).
    discover_dns: Optional[str] = None
    discover_interval_s: float = Field(default=10.0, gt=0)
    backend: Literal["ours", "openai"] = "ours"
    policy: str = "prefix"
    seed: Optional[int] = None  # random tie-breaks; set for reproducible runs
    tokens_per_block: int = Field(default=32, ge=1)  # must match our replicas
    # The replicas' Hugging Face tokenizer: a checkpoint directory (tokenizer.json,
    # tokenizer_config.json, generation_config.json) or a tokenizer.json. Unset: loaded
    # from the first replica that answers GET /tokenizer. Our back end only.
    tokenizer: Optional[str] = None
    # probing
    probe_deadline_ms: float = Field(default=25.0, gt=0)
    probe_k: Optional[int] = Field(default=None, ge=0)  # replicas probed per request (None: all)
    # a probe past its deadline may still answer this long and give its connection back
    probe_late_grace_s: float = Field(default=1.0, gt=0)
    # idle keep-alive connections kept open to each healthy replica (topped up at every
    # health check): a burst of requests (a router started or restarted under load) then
    # writes its probes at once instead of first opening a connection per probe and replica
    warm_connections: int = Field(default=8, ge=0)
    # health and circuit breaking
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)
    # each healthy replica's KV pools (its GET /stats) for /stats and the dashboard, fetched
    # this often off the request path; our back end only
    kv_pools_interval_s: float = Field(default=2.0, gt=0)
    failure_threshold: int = Field(default=3, ge=1)  # consecutive failures that open the circuit
    open_seconds: float = Field(default=5.0, gt=0)  # then one trial request (half-open)
    # forwarding
    max_attempts: int = Field(default=3, ge=1)  # first try + retries on other replicas
    retry_budget_ratio: float = Field(default=0.2, ge=0)  # retries per request, long-run cap
    connect_timeout_s: float = Field(default=1.0, gt=0)
    # an idle connection to a replica is not reused after this long: below the replicas'
    # own keep-alive (ours: --keepalive-s 75; uvicorn's default, e.g. a vLLM server: 5 s).
    # Unset: 60 s for our replicas, 4 s for --backend openai
    upstream_keepalive_s: Optional[float] = Field(default=None, gt=0)
    first_byte_timeout_s: float = Field(default=60.0, gt=0)  # from sending to the first token
    idle_timeout_s: float = Field(default=60.0, gt=0)
    total_timeout_s: float = Field(default=600.0, gt=0)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    # the router's server (uvicorn): client connections idle this long are closed; on SIGTERM,
    # requests still running get this long to finish
    keepalive_s: float = Field(default=75.0, gt=0)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # against slow clients holding connections: a request head must be complete this long
    # after its first byte, a body must progress this often (else 408), and connections
    # past the cap get a 503 and are closed
    head_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    max_connections: int = Field(default=10_000, ge=1)
    max_prompt_tokens: Optional[int] = Field(default=None, ge=1)
    # security
    admin_token: Optional[str] = None  # admin endpoints are off unless set
    internal_token: Optional[str] = None  # bearer token our replicas require for /probe_reuse
    tenant_secret: Optional[str] = None  # HMAC key: tenant salts from API keys (no default)
    # API keys, their tenants and the tenants' limits (YAML: router/api_keys.py,
    # config/api-keys.example.yaml). Unset: no authentication, no limits
    api_keys: Optional[str] = None
    backend_api_key: Optional[str] = None  # sent upstream to `--backend openai` servers
    session_header: str = "x-session-id"
    decisions_kept: int = Field(default=100, ge=1)  # latest routing decisions in /stats
    # OpenTelemetry: an OTLP/HTTP collector (http://HOST:4318) to send traces to; tracing
    # is also on when the standard OTEL_* environment asks for it (wire/tracing.py). Needs
    # the otel extra (pip install prefix-router[otel])
    otel_endpoint: Optional[str] = None
    log_level: str = "info"

    @field_validator("replicas", mode="before")
    @classmethod
    def _split(cls, v):
        if isinstance(v, str):
            v = [u for u in (p.strip() for p in v.split(",")) if u]
        return v

    @field_validator("discover_dns")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None:
            host, _, port = v.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"discover_dns must be HOST:PORT, got {v!r}")
        return v

    @field_validator("replicas")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://")
        if len(set(v)) != len(v):
            raise ValueError("a replica URL is listed twice")
        return v


    @model_validator(mode="after")
    def _tokenizer_for_our_backend(self) -> RouterSettings:
        if self.tokenizer is not None and self.backend == "openai":
            raise ValueError("--tokenizer applies to our replicas; --backend openai forwards "
                             "bodies unchanged and tokenizes nothing")
        return self


def load_settings(cli: dict[str, Any], config_file: str | None = None) -> RouterSettings:
    return merge_settings(RouterSettings, "router", cli, config_file)


def parse_args(argv: list[str] | None = None) -> RouterSettings:
    return settings_from_argv(
        RouterSettings, "router", "python -m router",
        "Prefix-aware router in front of LLM replicas (OpenAI-compatible).", argv)
