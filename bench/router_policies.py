"""Routing policies side by side on one seeded shared-prefix workload, through the router.

Workload (same for every policy): ``--groups`` groups (16) of ``--per-group`` prompts (12);
each prompt is its group's system prompt (1,023 random characters: with BOS exactly 1,024
tokens, 32 blocks, under the byte-level tokenizer) plus a distinct ~64-token question;
``max_tokens`` 8; streaming with usage. Arrivals are open loop, Poisson at ``--rate``
requests/s (20), in a seeded shuffled order. Every request carries ``x-session-id:
group-N`` (only ``session`` reads it). Cluster, fresh for each policy (empty caches): 4 sim
replicas at speed-up 1 (realistic timing: 20k prefill tokens/s, 2 ms per step), each with
KV pages for about a quarter of the groups' system prompts (``ceil(groups / replicas)``
system prompts plus 32 pages for requests in flight: 160 pages of 32 tokens by default),
and one router (``--policy NAME --seed S``).

Per policy: token hit rate (sum cached / sum prompt tokens, from ``usage``), TTFT (time from
sending the request to the first chunk carrying text, as the client sees it) mean, p50 and
p99, end-to-end latency, load imbalance (max / mean over the replicas of prefill tokens
computed = prompt - cached, attributed by ``x-replica``), requests per replica, failures,
and the replicas' prefill utilisation (prefill tokens computed / (replicas x 20k tokens/s x
run time)): at the default rate round robin keeps it well below 1. For reference, the same
request sequence fed to one LRU cache with all replicas' pages (pooled bound) and the share
of prompt tokens that repeat an earlier prefix (infinite bound), as BENCHMARKS.md defines them.

    .venv/bin/python -m bench.router_policies [--quick] [--policies prefix,round_robin]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import time

import aiohttp
import numpy as np

from kvcache import CacheConfig, FullAttention, KVCacheManager
from loadtest.processes import ServerProcess
from text import ByteTokenizer

from ._common import metric_sum, percentiles_ms, print_table, write_result
from .router_overhead import dead, start_replica

POLICIES = ("prefix", "approx_prefix", "round_robin", "random", "least_loaded",
            "power_of_two", "session")
TOKENS_PER_BLOCK = 32
SIM_PREFILL_TOKENS_PER_S = 20_000.0  # the sim engine's default, at speed-up 1


# --------------------------------------------------------------------------- workload

def workload(groups: int, per_group: int, system_chars: int, question_chars: int,
             seed: int) -> list[tuple[int, str]]:
    """(group, prompt) in arrival order (seeded shuffle)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    systems = []
    for g in range(groups):
        head = f"[system prompt of group {g:02d}] "
        systems.append(head + "".join(rng.choice(letters)
                                      for _ in range(system_chars - len(head))))
    reqs = []
    for g in range(groups):
        for q in range(per_group):
            head = f" question {g}-{q}: "
            tail = "".join(rng.choice(letters) for _ in range(question_chars - len(head) - 1))
            reqs.append((g, systems[g] + head + tail + "?"))
    rng.shuffle(reqs)
    return reqs


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival offsets (s) for ``n`` requests at ``rate`` per second."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()


def bounds(prompts: list[str], pooled_pages: int, max_tokens: int) -> dict:
    """Pooled bound (one LRU cache with every replica's pages, same sequence) and infinite
    bound (share of prompt tokens that repeat a prefix of an earlier prompt)."""
    tok = ByteTokenizer()
    seqs = [tok.encode(p) for p in prompts]
    total = sum(len(s) for s in seqs)
    mgr = KVCacheManager(CacheConfig(tokens_per_block=TOKENS_PER_BLOCK, num_pages=pooled_pages,
                                     life_cycles=(FullAttention(),), enable_partial_reuse=True))
    pooled = 0
    for s in seqs:  # as a replica does: match prompt[:-1], then compute the rest + outputs
        cache = mgr.create_kv_cache(s[:-1])
        try:
            reused = cache.num_reused_tokens
            pooled += reused
            outputs = [97] * max_tokens
            if not cache.resize(len(s) + max_tokens):
                raise RuntimeError("pooled bound: pool too small for one request")
            cache.commit(s[reused:] + outputs)
        finally:
            cache.close()
    arrays = [np.asarray(s, dtype=np.int64) for s in seqs]
    repeat = 0
    for i, a in enumerate(arrays):
        best = 0
        for b in arrays[:i]:
            m = min(len(a), len(b)) - 1  # at most prompt - 1, like cached_tokens
            if m <= best:
                continue
            neq = np.flatnonzero(a[:m] != b[:m])
            best = max(best, int(neq[0]) if neq.size else m)
        repeat += best
    return {"pooled_bound": pooled / total, "infinite_bound": repeat / total,
            "prompt_tokens": total, "pooled_pages": pooled_pages}


# --------------------------------------------------------------------------- driver

async def drive(url: str, reqs: list[tuple[int, str]], offsets: list[float],
                max_tokens: int, timeout_s: float) -> tuple[list[dict], float]:
    """Open loop: request i is sent at offsets[i] after the start, whatever came back."""
    results: list[dict] = []

    async def one(session: aiohttp.ClientSession, i: int, start: float) -> None:
        group, prompt = reqs[i]
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        headers = {"x-session-id": f"group-{group}"}
        rec = {"i": i, "group": group, "ok": False, "replica": None, "ttft_ns": None,
               "e2e_ns": None, "usage": None, "error": None,
               "late_ms": (time.perf_counter() - start - offsets[i]) * 1e3}
        t0 = time.perf_counter_ns()
        try:
            async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
                rec["replica"] = r.headers.get("x-replica")
                if r.status != 200:
                    rec["error"] = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                else:
                    done = False
                    async for line in r.content:
                        if not line.startswith(b"data: "):
                            continue
                        payload = line[6:].strip()
                        if payload == b"[DONE]":
                            done = True
                            break
                        chunk = json.loads(payload)
                        if "error" in chunk:
                            rec["error"] = f"stream error: {chunk['error'].get('message')}"
                            break
                        if rec["ttft_ns"] is None and any(
                                c.get("text") for c in chunk.get("choices") or ()):
                            rec["ttft_ns"] = time.perf_counter_ns() - t0
                        if chunk.get("usage"):
                            rec["usage"] = chunk["usage"]
                    rec["e2e_ns"] = time.perf_counter_ns() - t0
                    if rec["error"] is None:
                        if not done:
                            rec["error"] = "stream ended without [DONE]"
                        elif rec["usage"] is None or rec["ttft_ns"] is None:
                            rec["error"] = "no usage or no text in the stream"
                        else:
                            rec["ok"] = True
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        results.append(rec)

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, i, start) for i in range(len(reqs))))
        elapsed = time.perf_counter() - start
    results.sort(key=lambda r: r["i"])
    return results, elapsed


def summarise(results: list[dict], replica_urls: list[str], elapsed: float) -> dict:
    ok = [r for r in results if r["ok"]]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                 for r in ok)
    computed = {u: 0 for u in replica_urls}
    count = {u: 0 for u in replica_urls}
    for r in ok:
        u = r["replica"]
        c = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        computed[u] = computed.get(u, 0) + r["usage"]["prompt_tokens"] - c
        count[u] = count.get(u, 0) + 1
    mean = sum(computed.values()) / len(computed)
    ttft = [r["ttft_ns"] for r in ok]
    e2e = [r["e2e_ns"] for r in ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            key = re.sub(r"\d+", "N", str(r["error"]))[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(results),
        "ok": len(ok),
        "failures": len(results) - len(ok),
        "errors": errors,
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft": percentiles_ms(ttft) if ttft else None,
        "e2e": percentiles_ms(e2e) if e2e else None,
        "load_imbalance": max(computed.values()) / mean if mean else float("nan"),
        "prefill_tokens_computed": computed,
        "requests_per_replica": count,
        "seconds": elapsed,
        "prefill_utilisation": (sum(computed.values()) / SIM_PREFILL_TOKENS_PER_S
                                / len(replica_urls) / elapsed),
        "max_send_late_ms": max(r["late_ms"] for r in results),
    }


def run_policy(policy: str, args, reqs, offsets, pages: int) -> dict:
    with contextlib.ExitStack() as stack:
        reps = [stack.enter_context(start_replica(
            "--engine", "sim", "--kv-pages", str(pages),
            "--tokens-per-block", str(TOKENS_PER_BLOCK), "--sim-speedup", "1",
            "--log-level", "warning", "--seed", str(args.seed + i)))
            for i in range(args.replicas)]
        urls = [r.url for r in reps]
        router = stack.enter_context(ServerProcess(
            "router", "--replicas", ",".join(urls), "--policy", policy,
            "--tokens-per-block", str(TOKENS_PER_BLOCK), "--log-level", "warning",
            "--seed", str(args.seed)))
        results, elapsed = asyncio.run(drive(router.url, reqs, offsets, args.max_tokens,
                                             args.request_timeout_s))
        out = summarise(results, urls, elapsed)
        try:
            import httpx
            metrics = httpx.get(router.url + "/metrics", timeout=5).text
            out["probe_failures"] = metric_sum(metrics, "router_probe_failures_total")
            out["retries"] = metric_sum(metrics, "router_retries_total")
        except Exception as exc:  # the router is gone: say so, keep the figures
            out["metrics_error"] = repr(exc)
        out["replicas_died"] = dead(reps)
        if router.proc.poll() is not None:
            out["router_died"] = router.proc.returncode
        # rename replica URLs (ports change per cluster) to r0..rN for the JSON
        names = {u: f"r{i}" for i, u in enumerate(urls)}
        out["prefill_tokens_computed"] = {names.get(u, u): v for u, v in
                                          out["prefill_tokens_computed"].items()}
        out["requests_per_replica"] = {names.get(u, u): v for u, v in
                                       out["requests_per_replica"].items()}
    return out


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=12)
    p.add_argument("--system-chars", type=int, default=1023,
                   help="system prompt characters (tokens, without BOS)")
    p.add_argument("--question-chars", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kv-pages", type=int, default=None,
                   help="pages per replica (default: a quarter of the groups' system "
                        "prompts + 32)")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small, fast smoke run")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.per_group = 8, 6
        if args.policies == ",".join(POLICIES):
            args.policies = "prefix,round_robin,session"
    policies = [x for x in args.policies.split(",") if x]
    system_blocks = math.ceil((args.system_chars + 1) / TOKENS_PER_BLOCK)
    pages = args.kv_pages or (math.ceil(args.groups / args.replicas) * system_blocks + 32)
    reqs = workload(args.groups, args.per_group, args.system_chars, args.question_chars,
                    args.seed)
    offsets = arrivals(len(reqs), args.rate, args.seed)
    ref = bounds([pr for _, pr in reqs], pages * args.replicas, args.max_tokens)
    prompt_tokens = args.system_chars + args.question_chars + 1
    print(f"{len(reqs)} requests ({args.groups} groups x {args.per_group}), "
          f"{prompt_tokens}-token prompts ({args.system_chars + 1}-token system prompt per "
          f"group), max_tokens {args.max_tokens}, Poisson {args.rate:g}/s open loop; "
          f"{args.replicas} sim replicas at speed-up 1 with {pages} KV pages each "
          f"(~{(pages - 32) / system_blocks:.1f} system prompts); pooled bound "
          f"{ref['pooled_bound']:.3f}, infinite bound {ref['infinite_bound']:.3f}",
          flush=True)

    load_start = os.getloadavg()
    t0 = time.monotonic()
    per_policy: dict[str, dict] = {}
    for policy in policies:
        r = per_policy[policy] = run_policy(policy, args, reqs, offsets, pages)
        ttft = r["ttft"] or {}
        print(f"  {policy}: hit {r['hit_rate']:.3f}, TTFT mean "
              f"{ttft.get('mean_ms', float('nan')):.1f} ms, {r['failures']} failures"
              + (f", REPLICAS DIED: {r['replicas_died']}" if r["replicas_died"] else ""),
              flush=True)

    print(f"\nrouting policies: {len(reqs)} requests, Poisson {args.rate:g}/s, "
          f"{args.replicas} replicas x {pages} pages; pooled bound "
          f"{ref['pooled_bound']:.3f}, infinite bound {ref['infinite_bound']:.3f}")
    rows = []
    for policy, r in per_policy.items():
        t, e = r["ttft"] or {}, r["e2e"] or {}
        nan = float("nan")
        rows.append([policy, r["hit_rate"], t.get("mean_ms", nan), t.get("p50_ms", nan),
                     t.get("p99_ms", nan), e.get("mean_ms", nan), r["load_imbalance"],
                     "/".join(str(v) for v in r["requests_per_replica"].values()),
                     r["prefill_utilisation"], r["failures"],
                     int(r.get("probe_failures", 0))])
    print_table(["policy", "hit rate", "TTFT mean", "TTFT p50", "TTFT p99", "e2e mean",
                 "imbalance", "requests/replica", "prefill util", "failures", "probe fails"],
                rows)
    for policy, r in per_policy.items():
        if r["errors"]:
            print(f"{policy} errors: {r['errors']}")
        if r["replicas_died"]:
            print(f"{policy}: replicas died: {r['replicas_died']} (exit -13 = SIGPIPE)")
    elapsed = time.monotonic() - t0
    print(f"(run took {elapsed:.0f} s; ms for times; imbalance = max/mean prefill tokens "
          f"computed per replica)")
    if not args.no_write:
        write_result("router_policies", {
            "args": vars(args),
            "loadavg_at_start": load_start,
            "setup": {"requests": len(reqs), "prompt_tokens": prompt_tokens,
                      "system_prompt_tokens": args.system_chars + 1,
                      "kv_pages_per_replica": pages, "sim_speedup": 1,
                      "arrivals": f"Poisson {args.rate:g}/s, open loop, seeded"},
            "reference": ref,
            "policies": per_policy,
            "run_seconds": elapsed,
        }, args.out)


if __name__ == "__main__":
    main()
