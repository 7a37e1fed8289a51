"""Hybrid and interleaved-window families on the torch engine against transformers.

A random checkpoint of a model family's shape is written with transformers'
``save_pretrained`` (float32 on this CPU; the shapes below are 50-100M parameters), then
loaded by ``TorchEngine.from_checkpoint`` (on the KV pages) and by transformers. Measured,
each the median of ``--reps``, ours and theirs interleaved:

- prefill: tokens/s of one ``--prompt``-token prompt (2048): one engine step through the
  pages against transformers' forward;
- decode: tokens/s of ``--batch`` (16) sequences of 128 prompt tokens decoding
  ``--new-tokens`` (32) greedy tokens together (transformers: ``generate`` of new + 1
  tokens minus ``generate`` of 1, so both exclude the prefill);
- a resumed turn: TTFT of a ``--prompt``-token turn whose first 90% is the previous turn's
  history (reused: the attention pages, and for recurrent layers the state snapshotted
  where that history ended), against the same prompt uncached (ours);
- the snapshot memory per sequence: the bytes of one recurrent page (every recurrent
  layer's states), beside one attention block's pages.

Targets (issue 22): ours >= transformers for prefill and decode; resumed / uncached <= 0.25.

    .venv/bin/python -m bench.hybrid_engine                     # both shapes, ~10 minutes
    .venv/bin/python -m bench.hybrid_engine --family gemma3 --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench._common import print_table, write_result
from bench.hf_engine import Ours, Theirs
from replicas.kv_sizing import page_bytes

VOCAB = 32000
QUICK_VOCAB = 4000


def gemma3_config(quick: bool):
    """Gemma 3's shape: 5 local (window 1024) : 1 global layers, GQA, a RoPE per kind."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=QUICK_VOCAB if quick else VOCAB, hidden_size=256 if quick else 640,
        intermediate_size=512 if quick else 2048, num_hidden_layers=6 if quick else 12,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64 if quick else 160,
        sliding_window=128 if quick else 1024, max_position_embeddings=8192,
        query_pre_attn_scalar=64 if quick else 160,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                            "factor": 8.0}})


def qwen3_next_config(quick: bool):
    """Qwen3-Next's shape: 3 Gated DeltaNet : 1 gated attention layers, MoE with a shared
    expert, RoPE on a quarter of each head."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=QUICK_VOCAB if quick else VOCAB, hidden_size=256 if quick else 512,
        num_hidden_layers=4 if quick else 8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32 if quick else 64, layer_types=None, full_attention_interval=4,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32 if quick else 64,
        linear_value_head_dim=32 if quick else 64, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128 if quick else 256,
        shared_expert_intermediate_size=256 if quick else 512, intermediate_size=1024,
        max_position_embeddings=8192)


FAMILIES = {"gemma3": gemma3_config, "qwen3-next": qwen3_next_config}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.hybrid_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", action="append", choices=sorted(FAMILIES),
                   help="repeatable; default: every family")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="small, fast smoke run")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.family = args.family or sorted(FAMILIES)
    if args.quick:
        args.prompt, args.batch, args.new_tokens, args.reps = 256, 4, 8, 2
    return args


def make_checkpoint(directory: Path, family: str, args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](args.quick))
    model = model.to(getattr(torch, args.dtype)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def measure(directory: Path, family: str, args) -> dict:
    rng = random.Random(0)
    vocab = QUICK_VOCAB if args.quick else VOCAB

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    ours = Ours(directory, args)
    theirs = Theirs(directory, args, ours.engine.compute_thread)
    n = args.prompt
    ours.prefill(prompt(n)), theirs.prefill(prompt(n))  # warm-up
    ours.mgr.clear_reusable_blocks()
    rows = []
    pairs = []
    for _ in range(args.reps):
        pairs.append((ours.prefill(prompt(n)), theirs.prefill(prompt(n))))
        ours.mgr.clear_reusable_blocks()
    p_ours, p_theirs = (statistics.median(x) for x in zip(*pairs))
    rows.append({"case": f"prefill, {n}-token prompt", "unit": "tokens/s",
                 "ours": n / p_ours, "transformers": n / p_theirs, "ratio": p_theirs / p_ours})
    batch = [prompt(128) for _ in range(args.batch)]
    pairs = [(ours.decode_seconds(batch, args.new_tokens),
              theirs.generate_seconds(batch, args.new_tokens + 1)
              - theirs.generate_seconds(batch, 1)) for _ in range(args.reps)]
    d_ours, d_theirs = (statistics.median(x) for x in zip(*pairs))
    tokens = args.batch * args.new_tokens
    rows.append({"case": f"decode, {args.batch} sequences x {args.new_tokens} tokens",
                 "unit": "tokens/s", "ours": tokens / d_ours, "transformers": tokens / d_theirs,
                 "ratio": d_theirs / d_ours})
    resumed, uncached, reused = [], [], []
    history = int(n * 0.9)
    for _ in range(args.reps):
        turn = prompt(history)
        ours.prefill(turn, keep=True)  # the last turn: its history ends here (a snapshot)
        follow_up = turn + prompt(n - history)
        reused.append(ours.mgr.probe_reuse(follow_up[:-1]).num_tokens)
        resumed.append(ours.prefill(follow_up))
        uncached.append(ours.prefill(prompt(n)))
        ours.mgr.clear_reusable_blocks()
    rows.append({"case": f"TTFT, {n}-token turn resuming a {history}-token history / "
                         "uncached", "unit": "ratio",
                 "ours": statistics.median(resumed) / statistics.median(uncached),
                 "resumed_s": statistics.median(resumed),
                 "uncached_s": statistics.median(uncached), "reused_tokens": reused})
    layouts = ours.engine.page_layouts()
    sizes = {name: page_bytes([layout])
             for name, layout in zip(ours.engine.pool_names(), layouts)}
    return {"rows": rows, "page_bytes": sizes,
            "snapshot_bytes_per_sequence": sizes.get("recurrent", 0),
            "pools": ours.engine.pool_names(), "layers": ours.engine.describe()["layers"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    results, table = {}, []
    for family in args.family:
        with tempfile.TemporaryDirectory(prefix=f"hybrid-{family}-") as tmp:
            print(f"writing a random {family}-shaped checkpoint ({args.dtype}) ...", flush=True)
            params = make_checkpoint(Path(tmp), family, args)
            print(f"  {params / 1e6:.1f}M parameters; measuring ...", flush=True)
            result = measure(Path(tmp), family, args)
        results[family] = {"parameters": params, **result}
        for r in result["rows"]:
            table.append([family, r["case"], f"{r['ours']:,.2f}",
                          f"{r.get('transformers', float('nan')):,.1f}",
                          f"{r.get('ratio', float('nan')):.2f}"])
        table.append([family, "snapshot bytes per sequence",
                      f"{result['snapshot_bytes_per_sequence']:,}", "", ""])
    print_table(["family", "case", "ours", "transformers", "ours / theirs"], table)
    if not args.no_write:
        write_result("hybrid_engine", {
            "benchmark": "hybrid_engine", "args": vars(args), "families": results,
            "seconds": time.perf_counter() - started,
            "targets": {"prefill_ratio_min": 1.0, "decode_ratio_min": 1.0,
                        "resumed_ttft_ratio_max": 0.25}}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
