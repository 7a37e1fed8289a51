"""The workload half of ``bench.kvcache_hybrid``: one code revision's KV-cache rules under a
real replica scheduler, in-process.

``bench/kvcache_hybrid.py`` runs this file as a script, once per revision, with that
revision's tree first on ``PYTHONPATH``; a script's own folder (``bench/``) is what Python
puts before it, and it holds no ``kvcache`` or ``replicas``, and the editable install's
finder comes after ``PYTHONPATH``. So every project import below comes from that tree; the
result names the files loaded, the tree's git revision and a digest of its sources, and the
worker refuses to run when they are not under the tree it was asked for. Only the standard
library, ``kvcache`` and ``replicas`` are imported here, and only APIs that revision
488841c (before issue 13) and main share.

    PYTHONPATH=TREE python bench/_kvcache_hybrid_worker.py < spec.json > result.json

A row is one workload on one cache configuration: a fresh ``KVCacheManager``, a
``SimEngine`` (it sleeps for the modelled step time, so TTFT is real scheduler time) and a
``Scheduler``, fed sessions of requests as a replica's HTTP layer would (``Sequence`` ->
``submit`` -> wait for its ``FinishEvent``). A session sends its turns one after another,
each after the previous one finished and a think time; in a conversation (``chained``) a
turn's prompt is the previous prompt + the tokens the scheduler generated + the new message.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import kvcache
from kvcache import CacheConfig, FullAttention, KVCacheManager, Recurrent, ReuseScope, SlidingWindow
from replicas.engines.base import SamplingParams
from replicas.engines.sim import SimEngine, SimTiming
from replicas.scheduler import Scheduler, SchedulerConfig
from replicas.sequence import FinishEvent, Sequence

VOCAB = 32_000


# --------------------------------------------------------------------------- workloads

@dataclass(frozen=True)
class Turn:
    message: tuple[int, ...]  # what this turn appends (the whole prompt when not chained)
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """A client: turns sent one after another, ``think_s[i]`` seconds after turn ``i``
    finished (``start_s`` after the row's start for the first)."""

    name: str
    start_s: float
    turns: tuple[Turn, ...]
    think_s: tuple[float, ...]
    chained: bool  # a conversation: each prompt extends the previous prompt and answer


def _tokens(rng: random.Random, n: int, first: int | None = None) -> tuple[int, ...]:
    """``n`` random token ids; ``first``, when given, replaces the first (a marker)."""
    toks = [rng.randrange(VOCAB) for _ in range(n)]
    if first is not None and n:
        toks[0] = first
    return tuple(toks)


def _session(rng: random.Random, name: str, turns: tuple[Turn, ...], think_mean_s: float,
             chained: bool) -> Session:
    """Think times exponential with mean ``think_mean_s`` (0: none); the first turn starts
    uniformly within one mean think time, so clients do not move in step."""
    think = tuple(rng.expovariate(1 / think_mean_s) if think_mean_s > 0 else 0.0
                  for _ in range(len(turns) - 1))
    return Session(name, rng.uniform(0, think_mean_s), turns, think, chained)


def shared_prompt_sessions(requests: int, clients: int, system_tokens: int,
                           question_tokens: int, max_tokens: int, think_mean_s: float,
                           seed: int) -> list[Session]:
    """One system prompt + a distinct question per request, ``clients`` closed-loop clients.

    Each question starts with a token no other question starts with, so no request reuses
    part of another's question (the reusable prefix is exactly the system prompt).
    """
    rng = random.Random(seed)
    system = _tokens(rng, system_tokens)
    sessions = []
    for c in range(clients):
        mine = range(c, requests, clients)
        turns = tuple(Turn(system + _tokens(rng, question_tokens, first=i), max_tokens)
                      for i in mine)
        sessions.append(_session(rng, f"client{c}", turns, think_mean_s, chained=False))
    return sessions


def multi_turn_sessions(conversations: int, turns: int, first_tokens: int,
                        message_tokens: tuple[int, int], answer_tokens: tuple[int, int],
                        think_mean_s: float, seed: int) -> list[Session]:
    """``conversations`` chats of ``turns`` turns: a ``first_tokens`` opening message, then
    messages and answer lengths drawn uniformly from the given (low, high) ranges."""
    rng = random.Random(seed + 1)
    sessions = []
    for c in range(conversations):
        msgs = [_tokens(rng, first_tokens, first=c)]
        msgs += [_tokens(rng, rng.randint(*message_tokens)) for _ in range(turns - 1)]
        ts = tuple(Turn(m, rng.randint(*answer_tokens)) for m in msgs)
        sessions.append(_session(rng, f"chat{c}", ts, think_mean_s, chained=True))
    return sessions


def pages_without_pressure(sessions: list[Session], tpb: int) -> int:
    """Pages per pool that no run of ``sessions`` can exhaust: every request's blocks (its
    longest prompt plus answer) plus a partial-block copy and a live state, as if nothing
    were ever reused or freed. With this many no page is ever evicted."""
    total = 0
    for s in sessions:
        history = 0
        for t in s.turns:
            prompt = (history if s.chained else 0) + len(t.message)
            total += math.ceil((prompt + t.max_tokens) / tpb) + 2
            history = prompt + t.max_tokens
    return total


# --------------------------------------------------------------------------- one row

def cache_config(kind: str, tpb: int, window: int, num_pages: int) -> CacheConfig:
    """``hybrid``: the life cycles of the torch ``hybrid`` preset; ``full``: attention only."""
    kinds = {"hybrid": (FullAttention(), SlidingWindow(window=window), Recurrent()),
             "full": (FullAttention(),)}
    if kind not in kinds:
        raise ValueError(f"unknown cache config {kind!r}; choose one of {sorted(kinds)}")
    return CacheConfig(tokens_per_block=tpb, num_pages=num_pages, life_cycles=kinds[kind],
                       enable_partial_reuse=True)


async def _serve(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.submit(seq)
    while True:
        event = await seq.events.get()
        if isinstance(event, FinishEvent):
            if event.error is not None or event.reason != "length":
                raise RuntimeError(f"{seq.id} finished with {event.reason}: {event.error}")
            return


async def _run_session(scheduler: Scheduler, s: Session, t0: float) -> list[dict]:
    await asyncio.sleep(max(0.0, t0 + s.start_s - time.monotonic()))
    out: list[dict] = []
    history: tuple[int, ...] = ()
    for i, turn in enumerate(s.turns):
        prompt = list((history if s.chained else ()) + turn.message)
        seq = Sequence(id=f"{s.name}-{i}", prompt=prompt, max_tokens=turn.max_tokens,
                       sampling=SamplingParams(),  # the sim seeds its letters by id
                       scope=ReuseScope(), stop_token_ids=frozenset())
        await _serve(scheduler, seq)
        out.append({"id": seq.id, "turn": i, "prompt_tokens": len(prompt),
                    "cached_tokens": seq.cached_tokens,
                    "cached_before_pruning": seq.cached_tokens_before_hybrid_pruning,
                    "ttft_s": seq.first_token_at - seq.arrival,
                    "output_tokens": len(seq.output),
                    "finished_at_s": time.monotonic() - t0})
        history = tuple(prompt) + tuple(seq.output)
        if i < len(s.think_s):
            await asyncio.sleep(s.think_s[i])
    return out


async def run_row(sessions: list[Session], config: CacheConfig, timing: SimTiming,
                  sched: SchedulerConfig) -> dict:
    """Serve every session on a fresh manager + sim engine + scheduler; per-request records
    (in finishing order) and the manager's and scheduler's end state."""
    manager = KVCacheManager(config)
    scheduler = Scheduler(manager, SimEngine(timing), sched)
    loop = asyncio.create_task(scheduler.run())
    t0 = time.monotonic()
    try:
        per_session = await asyncio.gather(*(_run_session(scheduler, s, t0) for s in sessions))
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    seconds = time.monotonic() - t0
    stats = manager.stats()
    records = sorted((r for rs in per_session for r in rs), key=lambda r: r["finished_at_s"])
    return {"records": records, "seconds": seconds, "steps": scheduler.steps,
            "preemptions": scheduler.preemptions, "evicted_blocks": stats.evicted_blocks,
            "num_pages": stats.num_pages, "cached_pages": stats.cached_pages,
            "free_pages": stats.free_pages, "used_pages": stats.used_pages}


# --------------------------------------------------------------------------- provenance

def code_provenance() -> dict:
    """Which tree the project's modules came from: every loaded ``kvcache`` and
    ``replicas`` module's file, the tree's git revision, and a digest of its sources (so an
    uncommitted working tree is identified too). ``replicas`` is a namespace package, so
    its modules are listed one by one rather than trusted to share the first one's tree."""
    root = Path(kvcache.__file__).resolve().parents[1]
    files = {name: getattr(mod, "__file__", None) for name, mod in sorted(sys.modules.items())
             if name.split(".")[0] in ("kvcache", "replicas")}
    digest = hashlib.sha256()
    for pkg in ("kvcache", "replicas"):
        for f in sorted((root / pkg).rglob("*.py")):
            digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {"root": str(root), "kvcache_file": kvcache.__file__, "module_files": files,
            "git_head": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "kvcache", "replicas")),
            "sources_sha256": digest.hexdigest()}


def foreign_modules(prov: dict, root: Path) -> list[str]:
    """Loaded project modules whose file is not under ``root`` (namespace packages, which
    have no file, are left out)."""
    return [f"{name} ({f})" for name, f in prov["module_files"].items()
            if f is not None and not Path(f).resolve().is_relative_to(root)]


# --------------------------------------------------------------------------- spec -> rows

def build_sessions(workload: str, spec: dict) -> list[Session]:
    w = spec["workloads"][workload]
    if workload == "shared_prompt":
        return shared_prompt_sessions(w["requests"], w["clients"], w["system_tokens"],
                                      w["question_tokens"], w["max_tokens"],
                                      w["think_mean_s"], spec["seed"])
    if workload == "multi_turn":
        return multi_turn_sessions(w["conversations"], w["turns"], w["first_tokens"],
                                   tuple(w["message_tokens"]), tuple(w["answer_tokens"]),
                                   w["think_mean_s"], spec["seed"])
    raise ValueError(f"unknown workload {workload!r}")


def run_spec(spec: dict) -> dict:
    """Every row of ``spec["rows"]`` (each: workload, config, max_batched_tokens), in order."""
    tpb, timing = spec["tokens_per_block"], SimTiming(speedup=spec["sim_speedup"])
    rows = []
    for row in spec["rows"]:
        sessions = build_sessions(row["workload"], spec)
        pages = pages_without_pressure(sessions, tpb)
        config = cache_config(row["config"], tpb, spec["window"], pages)
        sched = SchedulerConfig(max_num_seqs=spec["max_num_seqs"],
                                max_batched_tokens=row["max_batched_tokens"])
        result = asyncio.run(run_row(sessions, config, timing, sched))
        rows.append({**row, **result})
        print(f"    {row['workload']}/{row['config']}/chunk {row['max_batched_tokens']}: "
              f"{len(result['records'])} requests in {result['seconds']:.1f} s", file=sys.stderr,
              flush=True)
    return {"code": code_provenance(), "rows": rows}


def main() -> None:
    spec = json.load(sys.stdin)
    expected = Path(spec["expect_code_root"]).resolve()
    prov = code_provenance()  # every project module is imported by now (at the top)
    foreign = foreign_modules(prov, expected)
    if foreign or Path(prov["root"]) != expected:
        raise SystemExit(f"project code not from {expected}: {foreign or prov['root']}; put "
                         "the tree first on PYTHONPATH and run this file as a script")
    json.dump(run_spec(spec), sys.stdout)


if __name__ == "__main__":
    main()
