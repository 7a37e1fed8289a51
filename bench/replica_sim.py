"""A sim-engine replica process over HTTP: requests/s it sustains, and /probe_reuse latency.

1. Throughput: closed loop, ``--concurrency`` clients, short prompts (a shared 1k-token
   system prompt + a distinct question) and ``--max-tokens`` outputs, for ``--seconds``.
   The sim engine runs with a large speed-up, so what is measured is the replica process
   itself (HTTP, validation, scheduler, KV-cache bookkeeping), not modelled compute.
2. Probe latency: ``/probe_reuse`` for an 8k-token prompt that the replica has cached, one
   request at a time, in each input form (token_ids_b64, token_ids, prompt text).

The load generator (aiohttp) shares the machine's two cores with the replica.

    .venv/bin/python -m bench.replica_sim [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import struct
import time

import aiohttp
import numpy as np

from loadtest.processes import ServerProcess

from ._common import percentiles_ms, print_table, write_result


async def _throughput(url: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    system = "You are a helpful assistant for a benchmark. " * 22  # ~1k tokens
    done, latencies, failures = 0, [], 0
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, cid: int) -> None:
        nonlocal done, failures
        i = 0
        while time.monotonic() < deadline:
            body = {"prompt": f"{system} Question {cid}-{i}?", "max_tokens": max_tokens}
            t0 = time.perf_counter_ns()
            async with session.post(url + "/v1/completions", json=body) as r:
                await r.read()
                if r.status == 200:
                    done += 1
                    latencies.append(time.perf_counter_ns() - t0)
                else:
                    failures += 1
            i += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(client(session, c) for c in range(concurrency)))
        elapsed = time.monotonic() - t0
    return {"requests": done, "failures": failures, "seconds": elapsed,
            "requests_per_s": done / elapsed, "tokens_out_per_s": done * max_tokens / elapsed,
            "latency": percentiles_ms(latencies)}


async def _probe_latency(url: str, tokens: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    text = "".join(chr(c) for c in rng.integers(97, 123, size=tokens - 1))
    ids = [256] + list(text.encode())
    b64 = base64.b64encode(struct.pack(f"<{len(ids)}I", *ids)).decode()
    forms = {"token_ids_b64": {"token_ids_b64": b64}, "token_ids": {"token_ids": ids},
             "prompt": {"prompt": text}}
    out = {}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions",
                                json={"prompt": text, "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
        for name, body in forms.items():
            samples = []
            for i in range(reps + 20):
                t0 = time.perf_counter_ns()
                async with session.post(url + "/probe_reuse", json=body) as r:
                    answer = await r.json()
                if i >= 20:
                    samples.append(time.perf_counter_ns() - t0)
            assert answer["num_tokens"] == len(ids) - 1, answer
            out[name] = percentiles_ms(samples)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--probe-tokens", type=int, default=8192)
    p.add_argument("--probe-reps", type=int, default=500)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.probe_reps = 3.0, 50
    with ServerProcess("replicas", "--engine", "sim", "--kv-pages", "4096",
                       "--sim-speedup", "1000", "--max-num-seqs", "256",
                       "--log-level", "warning") as rep:
        tp = asyncio.run(_throughput(rep.url, args.concurrency, args.seconds, args.max_tokens))
        probe = asyncio.run(_probe_latency(rep.url, args.probe_tokens, args.probe_reps))
    print(f"\nthroughput: {tp['requests_per_s']:.0f} requests/s "
          f"({tp['tokens_out_per_s']:.0f} output tokens/s), {tp['failures']} failures, "
          f"p50 {tp['latency']['p50_ms']:.1f} ms at concurrency {args.concurrency}")
    print_table(["/probe_reuse input", "p50 ms", "p99 ms"],
                [[k, f"{v['p50_ms']:.2f}", f"{v['p99_ms']:.2f}"] for k, v in probe.items()])
    if not args.no_write:
        write_result("replica_sim", {"args": vars(args),
                                     "throughput": tp, "probe_8k": probe})


if __name__ == "__main__":
    main()
