"""The torch engine on a Hugging Face checkpoint against transformers, same run, same model.

A random Llama-shaped checkpoint is written with transformers' ``save_pretrained`` (the
default: ~58M parameters, float32, for this CPU; ``--size 1b --dtype bfloat16 --device
cuda`` for a GPU), then loaded twice: by ``TorchEngine.from_checkpoint`` (on the KV pages)
and by ``transformers.AutoModelForCausalLM``. Measured, each the median of ``--reps``:

- prefill: tokens/s of one ``--prompt``-token prompt (2048), ours (one engine step through
  the pages) against transformers' forward;
- decode: tokens/s of ``--batch`` (16) sequences of 128 prompt tokens decoding
  ``--new-tokens`` (32) greedy tokens together, ours (one engine step per token over all
  sequences) against ``generate`` on the same batch (its decode time: ``generate`` of
  new-tokens + 1 minus ``generate`` of 1, so both exclude the prompt's prefill);
- TTFT of a 2048-token prompt whose first 90% is cached, against the same prompt uncached
  (ours; the prompt's compute to its first token, as the scheduler runs it).

Both sides compute on the engine's one compute thread (transformers' calls are handed to
it), so that a single OpenMP team serves both: run on the main thread, transformers' team
spin-waits after each call and takes the cores from ours (that cost ours ~30% of decode).

Targets (issue 14): ours >= transformers for prefill and decode; cached/uncached <= 0.25.

    .venv/bin/python -m bench.hf_engine                 # ~3-5 minutes on 2 cores
    .venv/bin/python -m bench.hf_engine --quick         # smoke run
    python -m bench.hf_engine --size 1b --dtype bfloat16 --device cuda   # bench/gpu_check.sh
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench._common import print_table, write_result

SIZES = {  # hidden, layers, heads, kv heads, intermediate, vocab
    "60m": (512, 8, 8, 4, 1536, 32000),
    "1b": (2048, 16, 16, 8, 5632, 32000),
    "quick": (256, 4, 4, 2, 768, 8000),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hf_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="60m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt", type=int, default=2048, help="prefill / TTFT prompt tokens")
    p.add_argument("--batch", type=int, default=16, help="concurrent decoding sequences")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--checkpoint", default=None, help="use this checkpoint directory")
    p.add_argument("--quick", action="store_true", help="small, fast smoke run")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/NAME.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.prompt, args.batch, args.new_tokens, args.reps = "quick", 512, 4, 8, 2
    return args


def make_checkpoint(directory: Path, size: str, dtype: str) -> int:
    """A random Llama checkpoint in ``directory``; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter, vocab = SIZES[size]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=inter, vocab_size=vocab,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


class Ours:
    def __init__(self, directory: Path, args) -> None:
        from kvcache import KVCacheManager
        from replicas.engines.torch_engine import TorchEngine

        self.engine = TorchEngine.from_checkpoint(directory, args.dtype, args.device)
        tpb = args.tokens_per_block
        pages = 2 * (-(-args.prompt // tpb)) + args.batch * (-(-(128 + args.new_tokens) // tpb))
        self.mgr = KVCacheManager(self.engine.cache_config(pages + 8, tpb, True),
                                  self.engine.page_layouts())
        self.engine.bind(self.mgr)

    def _item(self, cache, tokens, start, sample=True):
        from replicas.engines.base import SamplingParams, StepItem

        return StepItem("b", cache, tokens, start,
                        SamplingParams(temperature=0.0) if sample else None, {})

    def prefill(self, prompt: list[int], keep: bool = False) -> float:
        """Seconds to compute ``prompt`` past what is cached, to its first token."""
        cache = self.mgr.create_kv_cache(prompt[:-1])
        assert cache.resize(len(prompt))
        start = cache.num_reused_tokens

        async def run() -> float:  # as the scheduler runs a step: through engine.step
            t = time.perf_counter()
            await self.engine.step([self._item(cache, prompt[start:], start)])
            _sync(self.engine.device)
            return time.perf_counter() - t

        seconds = asyncio.run(run())
        if keep:
            cache.commit(prompt[start:])
        cache.close()
        return seconds

    def decode_seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        caches = [self.mgr.create_kv_cache(p[:-1]) for p in prompts]
        for cache in caches:
            assert cache.resize(len(prompts[0]) + new_tokens)
        items = [self._item(c, p, 0) for c, p in zip(caches, prompts)]

        async def run() -> float:
            last = await self.engine.step(items)
            for c, p in zip(caches, prompts):
                c.commit(p)
            t = time.perf_counter()
            for _ in range(new_tokens):
                step = [self._item(c, [tok], c.num_committed_tokens)
                        for c, tok in zip(caches, last)]
                last = await self.engine.step(step)
                for c, it in zip(caches, step):
                    c.commit(it.tokens)
            _sync(self.engine.device)
            return time.perf_counter() - t

        seconds = asyncio.run(run())
        for cache in caches:
            cache.close()
        self.mgr.clear_reusable_blocks()
        return seconds


class Theirs:
    """transformers' model, run on ``thread``: the engine's compute thread, so that both
    sides' kernels use one OpenMP team (a second team left spinning after its work would
    take the cores from whichever side ran next)."""

    def __init__(self, directory: Path, args, thread) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.thread = torch, thread
        self.device = torch.device(args.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=getattr(torch, args.dtype)).to(self.device).eval()

    def prefill(self, prompt: list[int]) -> float:
        return self.thread.submit(self._prefill, prompt).result()

    def generate_seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        return self.thread.submit(self._generate_seconds, prompts, new_tokens).result()

    def _prefill(self, prompt: list[int]) -> float:
        ids = self.torch.tensor([prompt], device=self.device)
        with self.torch.inference_mode():
            t = time.perf_counter()
            self.model(ids)
            _sync(self.device)
            return time.perf_counter() - t

    def _generate_seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = self.torch.tensor(prompts, device=self.device)
        with self.torch.inference_mode():
            t = time.perf_counter()
            self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=0)
            _sync(self.device)
            return time.perf_counter() - t


def _sync(device) -> None:
    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure(directory: Path, args) -> list[dict]:
    rng = random.Random(0)
    vocab = SIZES[args.size][5]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    ours = Ours(directory, args)
    theirs = Theirs(directory, args, ours.engine.compute_thread)
    ours.prefill(prompt(args.prompt)), theirs.prefill(prompt(args.prompt))  # warm-up
    rows = []
    n = args.prompt
    # Interleaved (ours, theirs, ours, ...), so that a change in the machine's speed during
    # the run (2 shared cores) falls on both alike.
    pairs = [(ours.prefill(prompt(n)), theirs.prefill(prompt(n))) for _ in range(args.reps)]
    p_ours = statistics.median(a for a, _ in pairs)
    p_theirs = statistics.median(b for _, b in pairs)
    rows.append({"case": f"prefill, {n}-token prompt", "unit": "tokens/s",
                 "ours": n / p_ours, "transformers": n / p_theirs,
                 "ratio": p_theirs / p_ours})
    batch = [prompt(128) for _ in range(args.batch)]
    pairs = [(ours.decode_seconds(batch, args.new_tokens),
              theirs.generate_seconds(batch, args.new_tokens + 1)
              - theirs.generate_seconds(batch, 1)) for _ in range(args.reps)]
    d_ours = statistics.median(a for a, _ in pairs)
    d_theirs = statistics.median(b for _, b in pairs)
    tokens = args.batch * args.new_tokens
    rows.append({"case": f"decode, {args.batch} sequences x {args.new_tokens} tokens",
                 "unit": "tokens/s", "ours": tokens / d_ours, "transformers": tokens / d_theirs,
                 "ratio": d_theirs / d_ours})
    cached, uncached = [], []
    shared = int(n * 0.9)
    for _ in range(args.reps):
        first = prompt(n)
        ours.prefill(first, keep=True)
        cached.append(ours.prefill(first[:shared] + prompt(n - shared)))
        uncached.append(ours.prefill(prompt(n)))
        ours.mgr.clear_reusable_blocks()
    rows.append({"case": f"TTFT, {n}-token prompt 90% cached / uncached", "unit": "ratio",
                 "ours": statistics.median(cached) / statistics.median(uncached),
                 "cached_s": statistics.median(cached),
                 "uncached_s": statistics.median(uncached)})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf-engine-") as tmp:
        directory = Path(args.checkpoint or tmp)
        params = None
        if args.checkpoint is None:
            print(f"writing a random Llama checkpoint ({args.size}, {args.dtype}) ...",
                  flush=True)
            params = make_checkpoint(directory, args.size, args.dtype)
        rows = measure(directory, args)
    table = [[r["case"], f"{r['ours']:,.1f}", f"{r.get('transformers', float('nan')):,.1f}",
              f"{r.get('ratio', float('nan')):.2f}"] for r in rows]
    print_table(["case", "ours", "transformers", "ours / theirs"], table)
    result = {"benchmark": "hf_engine", "args": vars(args), "parameters": params,
              "rows": rows, "seconds": time.perf_counter() - started,
              "targets": {"prefill_ratio_min": 1.0, "decode_ratio_min": 1.0,
                          "ttft_cached_ratio_max": 0.25}}
    if not args.no_write:
        write_result("hf_engine", result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
