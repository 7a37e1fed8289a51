"""Engines by name: ``sim`` (timing model; with ``--model DIR`` the pools and reuse rules of
that checkpoint's model, from its config alone) and ``torch`` (a transformer on the KV
pages: a Hugging Face checkpoint with ``--model DIR``, else a seeded preset)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Engine, SamplingParams, StepItem
from .sim import SimEngine, SimTiming, text_alphabet

if TYPE_CHECKING:
    from ..settings import ReplicaSettings
    from text import Tokenizer

__all__ = ["Engine", "SamplingParams", "SimEngine", "SimTiming", "StepItem", "make_engine",
           "text_alphabet"]


def make_engine(settings: ReplicaSettings, tokenizer: Tokenizer | None = None) -> Engine:
    """``tokenizer``: the replica's (the sim engine writes its letters in its ids)."""
    if settings.engine == "sim":
        timing = SimTiming(
            prefill_tokens_per_s=settings.sim_prefill_tokens_per_s,
            step_overhead_s=settings.sim_step_overhead_s,
            per_seq_prefill_s=settings.sim_per_seq_prefill_s,
            decode_per_seq_s=settings.sim_decode_per_seq_s,
            speedup=settings.sim_speedup,
        )
        spec, info = None, {}
        if settings.model is not None:  # the model's config: its pools and reuse rules
            from ..checkpoint import read_spec

            spec, args = read_spec(settings.model, settings.dtype)
            info = {"model": settings.model, "architecture": args.architecture}
        default_len = spec.max_model_len if spec is not None else 32768
        return SimEngine(timing, max_model_len=settings.max_model_len or default_len,
                         alphabet=text_alphabet(tokenizer) if tokenizer is not None else None,
                         spec=spec, info=info)
    if settings.engine == "torch":
        from .torch_engine import TorchEngine  # imports torch only when asked for

        if settings.model is not None:
            return TorchEngine.from_checkpoint(settings.model, dtype=settings.dtype,
                                               device=settings.device)
        overrides = {"max_model_len": settings.max_model_len} if settings.max_model_len else {}
        return TorchEngine.from_preset(settings.preset, device=settings.device,
                                       seed=settings.seed, **overrides)
    raise ValueError(f"unknown engine {settings.engine!r}; use 'sim' or 'torch'")
