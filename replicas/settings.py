"""Replica settings: command-line flags > ``REPLICA_*`` environment > YAML file > defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from wire.settings import merge_settings, settings_from_argv

ENV_PREFIX = "REPLICA_"


class ReplicaSettings(BaseSettings):
    """Every setting of ``python -m replicas``; each field is also ``REPLICA_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=9001, ge=0, le=65535)
    engine: Literal["sim", "torch"] = "sim"
    # A Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json,
    # tokenizer_config.json, generation_config.json); without it the torch engine runs a
    # seeded preset (--preset) with the byte-level tokenizer. With --engine sim only its
    # config (the model's pools and reuse rules) and its tokenizer, if it has one, are read.
    model: Optional[str] = None
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None  # default: float32
    served_model_name: Optional[str] = None  # default: the checkpoint directory's name
    # A Hugging Face tokenizer (a directory with tokenizer.json, tokenizer_config.json,
    # generation_config.json; or a tokenizer.json) instead of the checkpoint's: with --engine
    # sim, a sim replica that tokenizes and renders chats as that model does.
    tokenizer: Optional[str] = None
    # KV cache
    # pages in every pool (N), or one count per pool (full,sliding...,recurrent: "4096,512,64");
    # unset: sized from memory (replicas/kv_sizing.py)
    kv_pages: Annotated[Optional[Union[int, tuple[int, ...]]], NoDecode] = None
    kv_memory_fraction: Optional[float] = Field(default=None, gt=0, le=1)
    # a KV budget in bytes, split between the pools as the memory share is (also for the sim
    # engine of a model: its pools are then sized as a torch replica's would be)
    kv_cache_bytes: Optional[int] = Field(default=None, ge=1)
    tokens_per_block: int = Field(default=32, ge=1)
    enable_partial_reuse: bool = True
    # scheduler and limits
    max_num_seqs: int = Field(default=64, ge=1)
    max_batched_tokens: int = Field(default=2048, ge=1)
    max_waiting: int = Field(default=512, ge=0)
    max_model_len: Optional[int] = Field(default=None, ge=2)
    # models with recurrent layers: also keep a snapshot every N blocks of a prefill (more
    # reuse for forks inside long prompts, one recurrent page each); unset: off
    snapshot_interval_blocks: Optional[int] = Field(default=None, ge=1)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    default_max_tokens: int = Field(default=16, ge=1)  # completions, as OpenAI's default
    default_chat_max_tokens: int = Field(default=256, ge=1)
    # security: bearer token for /probe_reuse and admin routes (unset: open)
    internal_token: Optional[str] = None
    # torch engine
    preset: str = "default"
    device: Optional[str] = None
    seed: int = 0
    # sim engine (see replicas/engines/sim.py)
    sim_prefill_tokens_per_s: float = Field(default=20_000.0, gt=0)
    sim_step_overhead_s: float = Field(default=0.002, ge=0)
    sim_per_seq_prefill_s: float = Field(default=0.0005, ge=0)
    sim_decode_per_seq_s: float = Field(default=0.0004, ge=0)
    sim_speedup: float = Field(default=1.0, gt=0)
    # fault injection for tests and drills (all off by default)
    fault_probe_delay_s: float = Field(default=0.0, ge=0)  # sleep before answering a probe
    fault_error_rate: float = Field(default=0.0, ge=0, le=1)  # share of completions -> 500
    fault_cut_stream_after: Optional[int] = Field(default=None, ge=0)  # drop streams after N
    # operations
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # idle keep-alive connections are closed after this long; longer than uvicorn's 5 s:
    # the router keeps warm connections to its replicas for up to upstream_keepalive_s (60)
    keepalive_s: float = Field(default=75.0, gt=0)
    # OpenTelemetry: an OTLP/HTTP collector (http://HOST:4318) to send traces to; tracing
    # is also on when the standard OTEL_* environment asks for it (wire/tracing.py). Needs
    # the otel extra (pip install prefix-router[otel])
    otel_endpoint: Optional[str] = None
    log_level: str = "info"


    @field_validator("kv_pages", mode="before")
    @classmethod
    def _page_counts(cls, value: Any) -> Any:
        """``N`` or ``"N"`` -> N; ``"4096,512,64"`` (a list in YAML) -> a tuple of them."""
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value,)
        elif isinstance(value, str):
            try:
                value = tuple(int(part) for part in value.split(","))
            except ValueError:
                raise ValueError(f"kv_pages {value!r}: give a page count (256) or one per "
                                 "pool, comma-separated (4096,512,64)") from None
        if not isinstance(value, (list, tuple)) or not value or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in value):
            raise ValueError(f"kv_pages {value!r}: page counts must be ints >= 1")
        return value[0] if len(value) == 1 else tuple(value)


def _check_engine_fields(settings: ReplicaSettings) -> ReplicaSettings:
    if settings.tokenizer is not None and settings.engine == "torch" and settings.model is None:
        raise ValueError(f"--tokenizer {settings.tokenizer!r} with a seeded preset: the "
                         "presets have the byte-level vocabulary; give --model DIR (its "
                         "tokenizer is used) or --engine sim")
    if settings.dtype is not None and settings.model is None:  # (sim: the pages' sizes)
        raise ValueError("--dtype applies to a checkpoint (--model DIR); the seeded presets "
                         "run in float32")
    return settings


def load_settings(cli: dict[str, Any], config_file: str | None = None) -> ReplicaSettings:
    return _check_engine_fields(merge_settings(ReplicaSettings, "replica", cli, config_file))


def parse_args(argv: list[str] | None = None) -> ReplicaSettings:
    return _check_engine_fields(settings_from_argv(
        ReplicaSettings, "replica", "python -m replicas",
        "A replica: an engine around one KV-cache manager, OpenAI-compatible.", argv))
