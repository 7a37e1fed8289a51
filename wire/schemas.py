"""Wire schemas of a replica (and of the router, which speaks the same API).

Requests ignore unknown fields (clients such as gateways add their own); values are checked
here so that every bad input becomes a 400 with an OpenAI-style error body.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .chat import ChatMessage
from .probe import LoadSnapshot, ProbeAnswer  # noqa: F401 (the probe's models, here too)

MAX_STOP_SEQUENCES = 4


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: str
    text: Optional[str] = None


class ChatMessageIn(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None

    def parts(self) -> Union[str, tuple[str, ...], None]:
        """The content as a chat template sees it: text, the texts of its parts, or None;
        ValueError for parts other than text (images, audio: not supported)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported; "
                                 "send text parts")
            texts.append(part.text)
        return tuple(texts)

    def text(self) -> str:
        parts = self.parts()
        return "" if parts is None else parts if isinstance(parts, str) else "".join(parts)


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """Wire messages as the tokenizers take them (the replica's and the router's alike);
    ValueError for content they cannot hold (parts other than text)."""
    return [ChatMessage(m.role, m.parts(), m.name) for m in messages]


class _GenerationParams(_Request):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    cache_salt: Optional[str] = Field(default=None, max_length=256)
    n: int = 1
    logprobs: Union[bool, int, None] = None
    top_logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    user: Optional[str] = None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: Optional[int]) -> Optional[int]:
        if v not in (None, 1):
            raise ValueError("best_of is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v not in (None, False):
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v):
        if v not in (None, 0):
            raise ValueError("top_logprobs are not supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def output_limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_GenerationParams):
    prompt: Union[str, list[int], list[str], list[list[int]], None] = None
    prompt_token_ids: Optional[list[int]] = None
    # Base64 of little-endian uint32 ids: what the router sends (compact, fast to parse).
    prompt_token_ids_b64: Optional[str] = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if self.prompt_token_ids_b64 is not None:
            return self
        if self.prompt_token_ids is not None:
            if not self.prompt_token_ids:
                raise ValueError("prompt_token_ids must not be empty")
            return self
        p = self.prompt
        if p is None or p == "" or p == []:
            raise ValueError("prompt is required and must not be empty")
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("batched prompts are not supported; send one prompt")
            if not p[0]:
                raise ValueError("prompt must not be empty")
        return self


class ChatCompletionRequest(_GenerationParams):
    messages: list[ChatMessageIn] = Field(min_length=1)
    tools: Optional[list[Any]] = None
    # Set by the router after tokenizing (the rendered template), list or base64 form.
    prompt_token_ids: Optional[list[int]] = None
    prompt_token_ids_b64: Optional[str] = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tools are not supported")
        return v


class ProbeRequest(_Request):
    """Exactly one of ``prompt``, ``messages``, ``token_ids`` or ``token_ids_b64``."""

    prompt: Optional[str] = None
    messages: Optional[list[ChatMessageIn]] = None
    token_ids: Optional[list[int]] = None
    token_ids_b64: Optional[str] = None
    cache_salt: Optional[str] = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _exactly_one(self) -> ProbeRequest:
        given = [k for k in ("prompt", "messages", "token_ids", "token_ids_b64")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, messages, token_ids, token_ids_b64"
                             f" (got {', '.join(given) or 'none'})")
        return self


# -- responses ---------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Optional[str]
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Optional[str]
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefix-router"
    tokenizer_fingerprint: str
    tokens_per_block: int
    probe_reuse: bool = True
    max_model_len: int
    engine: dict[str, Any] = {}


class RenderedSampling(BaseModel):
    """The sampling a rendered request would run with (the part of vLLM's
    ``SamplingParams`` this replica has)."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: Optional[int] = None
    stop: list[str]


class RenderedPrompt(BaseModel):
    """``POST /v1/completions/render`` (a list of one: batched prompts are refused) and
    ``POST /v1/chat/completions/render``: the request as this replica would run it, in the
    shape of vLLM's render answer (its ``GenerateRequest``), so that routers that tokenize
    through it (vLLM's router, llm-d's token producer) can match prefixes; ``token_ids``
    are exactly the prompt a completion of the same body would compute."""

    request_id: str
    token_ids: list[int]
    features: None = None  # multimodal features: none here
    sampling_params: RenderedSampling
    model: str
    stream: bool
    cache_salt: Optional[str] = None


class TokenizerInfo(BaseModel):
    """``GET /tokenizer``: what a router needs to tokenize and render chats as this replica
    does. ``byte-level``: nothing more; ``hf``: the files' contents (tokenizer.json as text,
    the two configs as JSON, chat_template.jinja when the checkpoint has one)."""

    kind: Literal["byte-level", "hf"]
    fingerprint: str
    tokenizer_json: Optional[str] = None
    tokenizer_config: Optional[dict[str, Any]] = None
    generation_config: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Status(BaseModel):
    """``/health`` (always ``ok``) and ``/ready`` when ready."""

    status: str


class ServedModel(BaseModel):
    """A model as the router lists it (the union of its replicas' models)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefix-router"


class ServedModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ServedModel]


# -- /stats ------------------------------------------------------------------------------

class PoolStatsOut(BaseModel):
    """One pool of a replica's KV cache (one life cycle of its model's layers)."""

    life_cycle: str  # full_attention, sliding_window(W), recurrent
    num_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    evicted_pages: int  # recurrent: snapshots evicted
    block_pages: int = 0  # on cached blocks, needed or not (recurrent: snapshots kept)
    layers: Optional[int] = None  # model layers whose cache lives here (None: not a model's)
    page_bytes: Optional[int] = None  # one page (None: no storage, e.g. the sim engine)


class KVCacheStatsOut(BaseModel):
    tokens_per_block: int
    num_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    cached_blocks: int
    pools: list[PoolStatsOut]
    evicted_blocks: int


class ReuseStatsOut(BaseModel):
    queries: int
    query_tokens: int
    hit_tokens: int
    hit_tokens_before_hybrid_pruning: int
    tokens_lost_to_hybrid_pruning: int  # the difference: no snapshot where attention could reuse
    token_hit_rate: float


class SchedulerStatsOut(BaseModel):
    running: int
    waiting: int
    steps: int
    preemptions: int


class ReplicaStats(BaseModel):
    """A replica's ``/stats``."""

    model: str
    engine: dict[str, Any]
    kv_cache: KVCacheStatsOut
    reuse: ReuseStatsOut
    scheduler: SchedulerStatsOut
    load: LoadSnapshot
