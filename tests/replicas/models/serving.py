"""Serve tiny checkpoints through the replica's own ``Scheduler`` and ``TorchEngine``, and
compare with transformers (the oracle).

``Served`` runs requests as a replica runs them: ``Scheduler.submit`` probes, admission
creates the cache from ``prompt[:-1]`` (reusing what the manager allows), prefill goes in
block-aligned chunks of at most ``max_batched_tokens``, decodes are batched, and a
sequence that cannot grow is preempted. Requests can join at a given engine step, so
steps mix prefill chunks and decodes of sequences of different lengths.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

import torch

from kvcache import KVCacheManager, ReuseScope
from replicas.checkpoint import read_spec
from replicas.engines.base import SamplingParams
from replicas.engines.sim import SimEngine, SimTiming
from replicas.engines.torch_engine import TorchEngine
from replicas.scheduler import Scheduler, SchedulerConfig
from replicas.sequence import FinishEvent, Sequence, TokenEvent

# bench/gpu_check.sh runs these on CUDA (our engine there; transformers stays the CPU oracle).
DEVICE = os.environ.get("REPLICAS_TEST_DEVICE", "cpu")
GREEDY = SamplingParams(temperature=0.0)
N_NEW = 16


@dataclass
class Result:
    prompt: list[int]
    tokens: list[int]
    cached_tokens: int
    cached_tokens_before_hybrid_pruning: int
    probed: int  # probe_reuse(prompt[:-1]).num_tokens at submission
    finish_reason: str


class Served:
    """One replica's engine, manager and scheduler over a checkpoint directory."""

    def __init__(self, directory, tokens_per_block: int = 8, pages: int | tuple = 128,
                 max_batched_tokens: int = 2048, max_num_seqs: int = 16,
                 partial_reuse: bool = True, engine: str = "torch") -> None:
        """``engine="sim"``: the sim engine of the checkpoint's config (its pools and reuse
        rules, no weights), at a high speed-up."""
        if engine == "sim":
            self.engine = SimEngine(SimTiming(speedup=1e6), spec=read_spec(directory)[0])
        else:
            self.engine = TorchEngine.from_checkpoint(directory, device=DEVICE)
        self.manager = KVCacheManager(
            self.engine.cache_config(pages, tokens_per_block, partial_reuse),
            self.engine.page_layouts())
        self.engine.bind(self.manager)
        self.scheduler = Scheduler(self.manager, self.engine, SchedulerConfig(
            max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens))
        self._count = 0

    def run(self, prompts: list[list[int]], arrive_at: list[int] | None = None,
            max_tokens: int = N_NEW) -> list[Result]:
        """Serve ``prompts`` greedily; prompt i joins after ``arrive_at[i]`` engine steps
        (default: all at once). Results in the order of ``prompts``."""
        return asyncio.run(self._run(prompts, arrive_at or [0] * len(prompts), max_tokens))

    def one(self, prompt: list[int], max_tokens: int = N_NEW) -> Result:
        return self.run([prompt], max_tokens=max_tokens)[0]

    async def _run(self, prompts, arrive_at, max_tokens) -> list[Result]:
        seqs = [self._sequence(p, max_tokens) for p in prompts]
        probes: dict[int, tuple[int, int]] = {}
        pending = sorted(range(len(seqs)), key=lambda i: arrive_at[i])
        step, engine_step = 0, self.engine.step

        def submit_due() -> None:
            while pending and arrive_at[pending[0]] <= step:
                i = pending.pop(0)
                probe = self.manager.probe_reuse(seqs[i].prompt[:-1], scope=seqs[i].scope)
                probes[i] = (probe.num_tokens, probe.num_tokens_before_hybrid_pruning)
                self.scheduler.submit(seqs[i])

        async def counting_step(items):
            nonlocal step
            out = await engine_step(items)
            step += 1
            submit_due()
            return out

        self.engine.step = counting_step
        loop = asyncio.create_task(self.scheduler.run())
        try:
            submit_due()
            while pending and self.scheduler.idle:  # nothing runs until the next arrival
                step = arrive_at[pending[0]]
                submit_due()
            results = [await self._drain(s) for s in seqs]
        finally:
            loop.cancel()
            self.engine.step = engine_step
        self.manager.check_invariants()
        return [Result(s.prompt, tokens, s.cached_tokens, s.cached_tokens_before_hybrid_pruning,
                       probes[i][0], s.finish_reason)
                for i, (s, tokens) in enumerate(zip(seqs, results))]

    def _sequence(self, prompt: list[int], max_tokens: int) -> Sequence:
        self._count += 1
        return Sequence(id=f"s{self._count}", prompt=list(prompt), max_tokens=max_tokens,
                        sampling=GREEDY, scope=ReuseScope(), stop_token_ids=frozenset())

    @staticmethod
    async def _drain(seq: Sequence) -> list[int]:
        tokens = []
        while True:
            event = await asyncio.wait_for(seq.events.get(), 60)
            if isinstance(event, TokenEvent):
                tokens.append(event.token)
            elif isinstance(event, FinishEvent):
                if event.error:
                    raise AssertionError(f"{seq.id} failed: {event.error}")
                return tokens


def hf_generate(model, prompt: list[int], n: int = N_NEW) -> list[int]:
    """transformers' greedy continuation of ``prompt``."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(prompt), V]`` of one forward over ``prompt``."""
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float()
