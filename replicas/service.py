"""ReplicaService: tokenizer, KV-cache manager, engine and scheduler behind one object.

The HTTP layer parses, calls a method here, and formats; every rule about what a request
may ask for lives here and raises ``APIError``.
"""

from __future__ import annotations

import asyncio
import binascii
import logging
import math
import sys
import time
import uuid
from array import array
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pybase64

from kvcache import KVCacheManager, ReuseScope

from wire import tracing as otel
from wire.errors import APIError
from wire.probe import LoadSnapshot, ProbeAnswer
from wire.schemas import (ChatCompletionRequest, CompletionRequest, ModelCard,
                          ProbeRequest, _GenerationParams, chat_messages)

from .engines import make_engine
from .engines.base import Engine, SamplingParams
from .kv_sizing import plan_kv_pages
from .metrics import ReplicaMetrics
from .scheduler import QueueFull, Scheduler, SchedulerConfig
from .sequence import FinishEvent, Sequence, TokenEvent
from .settings import ReplicaSettings
from text import load_tokenizer

log = logging.getLogger("replicas")


def _check_vocabularies(tokenizer: int, model: int | None) -> None:
    """A tokenizer with more ids than the model has embeddings would make the engine fail
    on the first such id: refuse the pair at start-up."""
    if model is not None and tokenizer > model:
        raise ValueError(f"the tokenizer has {tokenizer} token ids but the model embeds only "
                         f"{model}: ids {model}..{tokenizer - 1} would fail in the engine; "
                         "serve the checkpoint with its own tokenizer")


class ReplicaService:
    def __init__(self, settings: ReplicaSettings, engine: Engine | None = None,
                 tracer_provider=None) -> None:
        """``tracer_provider``: an OpenTelemetry TracerProvider to trace with instead of
        what the settings and the OTEL_* environment say (tests inject one)."""
        self.settings = settings
        # None: off (the usual case); asked for without the extra: a start-up error, before
        # a checkpoint is loaded
        self.tracing = _tracing(settings, tracer_provider)
        # a checkpoint's tokenizer (or --tokenizer's), else byte-level
        self.tokenizer = load_tokenizer(settings.tokenizer or _checkpoint_tokenizer(settings))
        self.engine = engine or make_engine(settings, self.tokenizer)
        _check_vocabularies(self.tokenizer.vocab_size, self.engine.vocab_size)
        plan = plan_kv_pages(settings, self.engine)
        cfg = self.engine.cache_config(plan.num_pages, settings.tokens_per_block,
                                       settings.enable_partial_reuse)
        self.manager = KVCacheManager(cfg, self.engine.page_layouts())
        names = self.engine.pool_names() if hasattr(self.engine, "pool_names") else None
        log.info("%s", plan.describe(cfg.tokens_per_block, len(cfg.life_cycles), names))
        self.engine.bind(self.manager)
        self.model_id = settings.served_model_name or _default_model_id(settings,
                                                                         self.engine.name)
        self.max_model_len = min(settings.max_model_len or self.engine.max_model_len,
                                 self.engine.max_model_len)
        self.metrics = ReplicaMetrics(self.model_id)
        self.scheduler = Scheduler(self.manager, self.engine, SchedulerConfig(
            max_num_seqs=settings.max_num_seqs, max_batched_tokens=settings.max_batched_tokens,
            snapshot_interval_blocks=settings.snapshot_interval_blocks,
            max_waiting=settings.max_waiting), observer=self.metrics)
        self.metrics.bind(self.scheduler)
        self.created = int(time.time())
        self.ready = False
        self.draining = False
        self._task: asyncio.Task | None = None

    # -- life --------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self.scheduler.run(), name="scheduler")
        self.ready = True

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work, let in-flight requests finish. True if all finished in time."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while not self.scheduler.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.scheduler.idle

    async def stop(self) -> None:
        self.ready = False
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.engine.close()
        if self.tracing is not None:  # the spans still batched go out now
            await asyncio.to_thread(self.tracing.shutdown)

    # -- models and probes -------------------------------------------------------------

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_id, created=self.created,
                         tokenizer_fingerprint=self.tokenizer.fingerprint,
                         tokens_per_block=self.manager.config.tokens_per_block,
                         max_model_len=self.max_model_len, engine=self.engine.describe())

    def probe(self, req: ProbeRequest) -> ProbeAnswer:
        if req.prompt is not None:
            tokens = array("I", self._encode(req.prompt))
        elif req.messages is not None:
            tokens = array("I", self._render(req.messages))
        elif req.token_ids is not None:
            tokens = array("I", self._checked_ids(req.token_ids, "token_ids"))
        else:
            tokens = self._checked_array(_decode_b64(req.token_ids_b64, "token_ids_b64"),
                                         "token_ids_b64")
        probe = self.manager.probe_reuse(tokens[:-1], scope=_scope(req.cache_salt))
        return ProbeAnswer(probe.num_tokens, probe.num_tokens_before_hybrid_pruning,
                           len(tokens), self.load())

    def load(self) -> LoadSnapshot:
        s = self.manager.stats()
        return LoadSnapshot(len(self.scheduler.running), len(self.scheduler.waiting),
                            self.scheduler.queued_prefill_tokens(), s.free_pages, s.num_pages,
                            s.cached_pages, float(self.engine.prefill_tokens_per_s),
                            self.scheduler.config.max_num_seqs, self.draining)

    # -- generation --------------------------------------------------------------------

    def completion_tokens(self, req: CompletionRequest) -> list[int]:
        self._check_model(req)
        given = self._given_ids(req)
        if given is not None:
            return given
        p = req.prompt
        text = p if isinstance(p, str) else p[0] if isinstance(p[0], str) else None
        if text is not None:
            return self._encode(text)
        if isinstance(p[0], list):
            return self._checked_ids(p[0], "prompt")
        return self._checked_ids(p, "prompt")

    def chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        self._check_model(req)
        given = self._given_ids(req)
        return given if given is not None else self._render(req.messages)

    def _given_ids(self, req) -> list[int] | None:
        """Token ids the request carries already (the router's), checked; else None."""
        if req.prompt_token_ids_b64 is not None:
            return self._checked_array(_decode_b64(req.prompt_token_ids_b64,
                                                   "prompt_token_ids_b64"),
                                       "prompt_token_ids_b64").tolist()
        if req.prompt_token_ids is not None:
            return self._checked_ids(req.prompt_token_ids, "prompt_token_ids")
        return None

    def new_sequence(self, tokens: list[int], req: _GenerationParams, default_max: int,
                     request_id: str | None = None) -> Sequence:
        if self.draining:
            raise APIError(503, "replica is draining", type="server_error",
                           code="draining")
        max_tokens = self._output_tokens(tokens, req, default_max)
        return Sequence(id=request_id or uuid.uuid4().hex, prompt=tokens, max_tokens=max_tokens,
                        sampling=SamplingParams(req.temperature, req.top_p, req.seed),
                        scope=_scope(req.cache_salt),
                        stop_token_ids=self.tokenizer.eos_token_ids)

    def rendered(self, tokens: list[int], req: _GenerationParams, default_max: int,
                 request_id: str) -> dict:
        """What ``new_sequence`` would run, as vLLM's render endpoints answer it
        (``RenderedPrompt``), refused as it would be (context length, pool size)."""
        return {"request_id": request_id, "token_ids": tokens, "features": None,
                "sampling_params": {"max_tokens": self._output_tokens(tokens, req, default_max),
                                    "temperature": req.temperature, "top_p": req.top_p,
                                    "seed": req.seed, "stop": req.stop or []},
                "model": self.model_id, "stream": req.stream, "cache_salt": req.cache_salt}

    def _output_tokens(self, tokens: list[int], req: _GenerationParams,
                       default_max: int) -> int:
        """How many tokens a request may generate; APIError 400 when it cannot run."""
        room = self.max_model_len - len(tokens)
        if room < 1:
            raise APIError(400, f"prompt has {len(tokens)} tokens; this model's maximum "
                           f"context length is {self.max_model_len}", param="prompt",
                           code="context_length_exceeded")
        max_tokens = req.output_limit()
        if max_tokens is None:
            max_tokens = min(default_max, room)
        elif len(tokens) + max_tokens > self.max_model_len:
            raise APIError(400, f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) "
                           f"exceeds the maximum context length {self.max_model_len}",
                           param="max_tokens", code="context_length_exceeded")
        self._check_fits_pool(len(tokens) + max_tokens)
        return max_tokens

    def submit(self, seq: Sequence) -> None:
        """Queue ``seq``; 429 when the admission queue is full."""
        try:
            self.scheduler.submit(seq)
        except QueueFull:
            self.metrics.rejected.labels(self.model_id, "queue_full").inc()
            raise APIError(429, "too many requests are waiting; retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None

    async def events(self, seq: Sequence) -> AsyncIterator[TokenEvent | FinishEvent]:
        """A submitted sequence's events; leaving early aborts it (its pages are freed)."""
        try:
            while True:
                event = await seq.events.get()
                yield event
                if isinstance(event, FinishEvent):
                    return
        finally:
            self.scheduler.abort(seq)

    def stop_sequence(self, seq: Sequence) -> None:
        self.scheduler.abort(seq, "stop")

    # -- checks ------------------------------------------------------------------------

    def _check_model(self, req: _GenerationParams) -> None:
        if req.model is not None and req.model != self.model_id:
            raise APIError(404, f"model {req.model!r} is not served here; this replica "
                           f"serves {self.model_id!r}", param="model", code="model_not_found")

    def _checked_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{param} must not be empty", param=param)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{param} has token id {bad}, outside the vocabulary "
                           f"[0, {vocab})", param=param, code="invalid_token_id")
        return list(ids)

    def _checked_array(self, ids: array, param: str) -> array:
        """Like ``_checked_ids`` for an ``array('I')`` (unsigned: only the top can be bad)."""
        if not ids:
            raise APIError(400, f"{param} must not be empty", param=param)
        top = int(np.frombuffer(ids, dtype=np.uint32).max())
        if top >= self.tokenizer.vocab_size:
            raise APIError(400, f"{param} has token id {top}, outside the vocabulary "
                           f"[0, {self.tokenizer.vocab_size})", param=param,
                           code="invalid_token_id")
        return ids

    def _check_fits_pool(self, total_tokens: int) -> None:
        """A sequence holds a page of every block in the full-attention pool (a window
        pool needs fewer): refuse what could never fit, rather than queue it forever."""
        cfg = self.manager.config
        full = self.manager.layout.full
        pages = cfg.pool_pages[full] if full is not None else max(cfg.pool_pages)
        blocks = math.ceil(total_tokens / cfg.tokens_per_block)
        if blocks > pages:
            raise APIError(400, f"prompt + max_tokens ({total_tokens} tokens) needs {blocks} "
                           f"KV pages but this replica has {pages}",
                           param="max_tokens", code="context_length_exceeded")

    def _encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except ValueError as exc:
            raise APIError(400, f"prompt: {exc}", param="prompt") from None

    def _render(self, messages) -> list[int]:
        try:
            return self.tokenizer.render_chat(chat_messages(messages))
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None


def _tracing(settings: ReplicaSettings, provider):
    """``ReplicaTracing`` when tracing is on, else None (then nothing imports opentelemetry's
    SDK, and replicas.tracing is never imported)."""
    tracing = otel.setup(settings.otel_endpoint, "replica", "replicas", provider)
    if tracing is None:
        return None
    from .tracing import ReplicaTracing
    return ReplicaTracing(tracing)


def _default_model_id(settings: ReplicaSettings, engine: str) -> str:
    """The checkpoint directory's name; a sim replica with ``--tokenizer`` is named after
    the tokenizer's directory; else ``<engine>-byte-lm``."""
    if settings.model is not None:
        return Path(settings.model).resolve().name
    if settings.tokenizer is not None:
        path = Path(settings.tokenizer).resolve()
        return f"{engine}-{(path.parent if path.is_file() else path).name}"
    return f"{engine}-byte-lm"


def _scope(cache_salt: str | None) -> ReuseScope:
    return ReuseScope(salt=cache_salt) if cache_salt else ReuseScope()


def _decode_b64(data: str, param: str) -> array:
    """Base64 of little-endian uint32 token ids -> ``array('I')``."""
    try:
        raw = pybase64.b64decode(data, validate=True)  # SIMD: ~25x binascii on 16 KiB
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param} is not valid base64", param=param) from None
    if len(raw) % 4:
        raise APIError(400, f"{param} must hold little-endian uint32 values (a multiple "
                       "of 4 bytes)", param=param)
    ids = array("I")
    ids.frombytes(raw)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids


def new_request_id() -> str:
    return uuid.uuid4().hex


def _checkpoint_tokenizer(settings: ReplicaSettings) -> str | None:
    """The checkpoint's tokenizer: required for the torch engine; for the sim engine, which
    reads a checkpoint's config only, byte-level when the directory has none."""
    model = settings.model
    if model is None or settings.engine == "torch":
        return model
    return model if (Path(model) / "tokenizer.json").is_file() else None
