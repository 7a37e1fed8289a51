"""Peak host memory while loading a checkpoint (``replicas.checkpoint.load_checkpoint``).

A random Llama-shaped float32 checkpoint (~88M parameters, ~350 MB by default) is written
once, as one ``model.safetensors`` and as shards with an index. Each case loads it in a
fresh subprocess: after the imports and torch's one-off meta-device warm-up (~75 MB,
reported as ``meta_warmup_kb``: the fixed overhead), the subprocess resets its peak RSS
(``/proc/self/clear_refs``), loads, and reports ``VmHWM`` (peak resident set, file-backed
pages included) against its RSS before loading. Loading adds ``peak - before``; the target
is at most 1.2x the checkpoint's size (plus the fixed overhead) on the CPU, and far less
when loading to CUDA. Expected: the weights once plus the largest tensor in flight.

    .venv/bin/python -m bench.checkpoint_load            # ~1 min on 2 cores
    .venv/bin/python -m bench.checkpoint_load --quick    # a ~20M-parameter smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import print_table, write_result

TARGET_RATIO = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--device", default="cpu", help="cpu, cuda, or auto (CUDA when present)")
    p.add_argument("--shard-mb", type=int, default=100, help="shard size of the sharded copy")
    p.add_argument("--quick", action="store_true", help="small, fast smoke run")
    p.add_argument("--no-write", action="store_true", help="do not write the JSON result")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/NAME.json)")
    p.add_argument("--child", nargs=3, metavar=("DIR", "DTYPE", "DEVICE"),
                   help=argparse.SUPPRESS)  # internal: load once and report
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.vocab = 4, 512, 1024, 8000
    return args


def write_checkpoint(args: argparse.Namespace, directory: Path) -> int:
    """A random float32 Llama checkpoint, single-file in ``directory/single`` and sharded in
    ``directory/sharded``; returns the single file's size in bytes."""
    import torch
    from safetensors.torch import save_file

    from replicas.models import parse_config
    from replicas.models.llama import LlamaForCausalLM

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": args.vocab,
              "hidden_size": args.hidden, "intermediate_size": args.intermediate,
              "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
              "num_key_value_heads": max(1, args.hidden // 192), "head_dim": 64,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "dtype": "float32",
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in
                  LlamaForCausalLM(parse_config(config)).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    single, sharded = directory / "single", directory / "sharded"
    for d in (single, sharded):
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(config))
    save_file(tensors, single / "model.safetensors", metadata={"format": "pt"})
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.numel() * 4 > args.shard_mb << 20:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.numel() * 4
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, sharded / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return (single / "model.safetensors").stat().st_size


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(directory: str, dtype: str, device: str) -> None:
    """Load once; print the memory figures as JSON."""
    import torch

    from replicas.checkpoint import load_checkpoint

    imported = _status_kb("VmRSS")
    with torch.device("meta"):  # torch's first meta-device use costs ~75 MB, once
        torch.nn.Embedding(2, 2)
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started = time.perf_counter()
    model = load_checkpoint(directory, dtype, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    print(json.dumps({"meta_warmup_kb": before - imported, "rss_before_kb": before,
                      "peak_kb": _status_kb("VmHWM"),
                      "rss_after_kb": _status_kb("VmRSS"), "seconds": seconds,
                      "parameters": sum(p.numel() for p in model.parameters())}))


def run_case(directory: Path, dtype: str, device: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.checkpoint_load", "--child",
                          str(directory), dtype, device], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="checkpoint_load_") as tmp:
        size = write_checkpoint(args, Path(tmp))
        cases = [("single", "float32"), ("sharded", "float32"), ("single", "bfloat16")]
        rows, results = [], []
        for layout, dtype in cases:
            r = run_case(Path(tmp) / layout, dtype, device)
            added = (r["peak_kb"] - r["rss_before_kb"]) * 1024
            r.update(layout=layout, dtype=dtype, device=device, checkpoint_bytes=size,
                     added_bytes=added, added_over_checkpoint=added / size)
            results.append(r)
            rows.append([layout, dtype, device, f"{size / 2**20:.0f}",
                         f"{r['rss_before_kb'] / 1024:.0f}", f"{r['peak_kb'] / 1024:.0f}",
                         f"{added / 2**20:.0f}", f"{added / size:.2f}", f"{r['seconds']:.2f}"])
    print_table(["files", "dtype", "device", "ckpt MiB", "RSS before", "peak RSS",
                 "added MiB", "added/ckpt", "load s"], rows)
    worst = max(r["added_over_checkpoint"] for r in results if r["dtype"] == "float32")
    print(f"\nworst float32 case: loading added {worst:.2f}x the checkpoint's size "
          f"(target <= {TARGET_RATIO}x)")
    if not args.no_write:
        write_result("checkpoint_load", {
            "config": {k: getattr(args, k) for k in ("layers", "hidden", "intermediate",
                                                      "vocab", "shard_mb", "quick")},
            "target_added_over_checkpoint": TARGET_RATIO, "cases": results,
            "worst_float32_added_over_checkpoint": worst, "cpu_count": os.cpu_count()},
            args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
