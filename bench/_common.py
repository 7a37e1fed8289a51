"""Shared helpers for the benchmarks: timing, percentiles, tree filling, tables, JSON.

Each benchmark is one module (``python -m bench.NAME``); this module holds what they share.
Timings use ``time.perf_counter_ns``; every timed loop is preceded by ``gc.collect()`` and a
warm-up, and runs with the cyclic GC paused (as ``timeit`` does) unless ``--keep-gc``.
"""

from __future__ import annotations

import gc
import http.server
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VOCAB = 32_000


# --------------------------------------------------------------------------- timing

def percentiles_ms(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50/p90/p99/min/mean of nanosecond samples, in milliseconds."""
    a = np.asarray(samples_ns, dtype=np.float64) / 1e6
    return {
        "p50_ms": float(np.percentile(a, 50)),
        "p90_ms": float(np.percentile(a, 90)),
        "p99_ms": float(np.percentile(a, 99)),
        "min_ms": float(a.min()),
        "mean_ms": float(a.mean()),
        "reps": int(a.size),
    }


def time_calls(fn: Callable[[], Any], reps: int, warmup: int, keep_gc: bool = False,
               max_seconds: float | None = None) -> dict[str, float]:
    """Call ``fn`` ``warmup`` times, then time ``reps`` calls one by one.

    Stops early (with at least 20 samples) once ``max_seconds`` of timed work has run, so a
    slow implementation cannot blow the time budget.
    """
    for _ in range(warmup):
        fn()
    gc.collect()
    was_enabled = gc.isenabled()
    if not keep_gc:
        gc.disable()
    samples: list[int] = []
    clock = time.perf_counter_ns
    deadline = None if max_seconds is None else clock() + int(max_seconds * 1e9)
    try:
        for i in range(reps):
            t0 = clock()
            fn()
            t1 = clock()
            samples.append(t1 - t0)
            if deadline is not None and i >= 20 and t1 > deadline:
                break
    finally:
        if was_enabled:
            gc.enable()
    return percentiles_ms(samples)


# --------------------------------------------------------------------------- tokens

def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    """``n`` uniform random token ids from a 32k vocabulary, as a Python list."""
    return rng.integers(0, VOCAB, size=n, dtype=np.int64).tolist()


# --------------------------------------------------------------------------- tree filling

def cache_sequence(mgr: Any, tokens: list[int], scope: Any = None) -> int:
    """Create a cache on ``tokens``, commit all of them, close it. Returns reused tokens.

    Committed full blocks (and, with partial reuse, the last partial block) stay cached.
    """
    cache = mgr.create_kv_cache(tokens, scope=scope)
    try:
        reused = cache.num_reused_tokens
        if not cache.resize(len(tokens)):
            raise RuntimeError(
                f"resize({len(tokens)}) failed: pool too small "
                f"(stats: {mgr.stats()!r}); raise num_pages")
        cache.commit(tokens[reused:])
    finally:
        cache.close()
    return reused


class Filler:
    """Adds distinct random sequences to a manager's tree until it holds a target number of
    cached blocks, printing progress for long fills.

    Each sequence is ``seq_blocks`` full blocks of random tokens. A fraction
    ``shared_frac`` of them start with one of ``shared_prefixes`` (picked uniformly): "system
    prompts" many requests share, so the node where such a prefix ends gets many children.
    """

    def __init__(self, mgr: Any, tpb: int, seq_blocks: int = 64, seed: int = 1,
                 shared_prefixes: Sequence[list[int]] = (), shared_frac: float = 0.0,
                 chunk: int = 256) -> None:
        self.mgr, self.tpb, self.seq_blocks = mgr, tpb, seq_blocks
        self.rng = np.random.default_rng(seed)
        self.shared_prefixes = [list(p) for p in shared_prefixes]
        self.shared_frac = shared_frac if self.shared_prefixes else 0.0
        if any(len(p) >= seq_blocks * tpb for p in self.shared_prefixes):
            raise ValueError("shared prefixes must be shorter than a filler sequence")
        self.chunk = chunk
        self.sequences = 0
        self.seconds = 0.0

    def blocks(self) -> int:
        return self.mgr.stats().cached_pages

    def fill_to(self, target_blocks: int, label: str = "") -> dict[str, float]:
        """Fill until ``stats().cached_pages >= target_blocks``; returns timing info."""
        n_tok = self.seq_blocks * self.tpb
        t0 = time.perf_counter()
        last_print = t0
        start_blocks = have = self.blocks()
        added_seqs = 0
        while have < target_blocks:
            batch = self.rng.integers(0, VOCAB, size=(self.chunk, n_tok), dtype=np.int64)
            shared = self.rng.random(self.chunk) < self.shared_frac
            which = self.rng.integers(0, max(1, len(self.shared_prefixes)), size=self.chunk)
            for row, use_shared, k in zip(batch, shared, which):
                toks = row.tolist()
                if use_shared:
                    prefix = self.shared_prefixes[k]
                    toks[:len(prefix)] = prefix
                    have += self.seq_blocks - len(prefix) // self.tpb
                else:
                    have += self.seq_blocks
                cache_sequence(self.mgr, toks)
                added_seqs += 1
                if have >= target_blocks:
                    break
            have = self.blocks()
            now = time.perf_counter()
            if now - last_print > 5.0:
                rate = (have - start_blocks) / (now - t0)
                eta = (target_blocks - have) / rate if rate > 0 else float("nan")
                print(f"  fill{label}: {have:,}/{target_blocks:,} blocks "
                      f"({rate:,.0f} blocks/s, ~{eta:.0f}s left)", flush=True)
                last_print = now
        dt = time.perf_counter() - t0
        self.sequences += added_seqs
        self.seconds += dt
        gc.collect()
        return {"fill_seconds": dt, "blocks_added": have - start_blocks,
                "sequences_added": added_seqs,
                "blocks_per_s": (have - start_blocks) / dt if dt > 0 else float("nan")}


# --------------------------------------------------------------------------- output

def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v != v:
                return "-"
            if abs(v) >= 1e6:
                return f"{v:,.3g}"
            if abs(v) >= 100:
                return f"{v:,.0f}"
            if abs(v) >= 1:
                return f"{v:.3f}"
            return f"{v:.4f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def environment() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_at_end": load,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(name: str, payload: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    print(f"\nwrote {path}")
    return path


def add_common_args(parser: Any, gc_paused_by_default: bool = True) -> None:
    parser.add_argument("--quick", action="store_true", help="small, fast smoke run")
    parser.add_argument("--seed", type=int, default=0)
    if gc_paused_by_default:
        parser.add_argument("--keep-gc", action="store_true",
                            help="leave the cyclic GC running inside timed loops")
    else:
        parser.add_argument("--pause-gc", dest="keep_gc", action="store_false",
                            help="pause the cyclic GC inside timed loops")
    parser.add_argument("--no-write", action="store_true", help="do not write the JSON result")
    parser.add_argument("--out", default=None, help="JSON result path (default bench/results/NAME.json)")


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a Prometheus text exposition (parsed by
    prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for n, got, v in metric_samples(text)
               if n == name and all(got.get(k) == want for k, want in labels.items()))


# --------------------------------------------------------------------------- tracing

class OTLPSink:
    """An OTLP/HTTP collector on a loopback port (a context manager): every export is
    answered 200 and counted; with ``keep`` its (path, content type, body) kept too. The
    router's tracing benchmark sends to one, and so do the tracing tests."""

    def __init__(self, keep: bool = False) -> None:
        sink = self
        self.exports = self.bytes = 0
        self.received: list[tuple[str, str, bytes]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                sink.exports, sink.bytes = sink.exports + 1, sink.bytes + len(body)
                if keep:
                    sink.received.append((self.path, self.headers["content-type"], body))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> OTLPSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
