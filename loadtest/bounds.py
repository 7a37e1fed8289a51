"""Hit-rate bounds under a served model's reuse rules, from a live sim replica of it.

The pooled bound is the hit rate of one cache holding all replicas' pages together, LRU,
fed the same request sequence; the infinite bound that of a cache that never evicts. For a
model with sliding windows or recurrent layers, what a cache can reuse depends on the
model (which window pages a prefix needs, where recurrent snapshots were kept: at branch
points, at each prompt's last block boundary, at the end of each request's history), so the
bounds replay the requests through the same code a replica runs: one ``python -m replicas
--engine sim --model DIR`` process (its scheduler, its manager, the model's pools), sent the
requests one after another in arrival order, at a speed-up that makes its compute free.

The infinite run also measures the workload's working set per pool: the pages attached to
cached blocks once every request was served with nothing evicted (attention blocks, window
pages, snapshots), from which ``--cache-pressure`` sizes each pool.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from .processes import ServerProcess
from .workloads import Request

SPEEDUP = "1000000"


@dataclass(frozen=True)
class ModelBound:
    hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    pools: list[dict]  # the replica's /stats pools after the replay


def replay(requests: Sequence[Request], model: str, pages: Sequence[int],
           tokens_per_block: int, log_dir: Path | None = None,
           extra_args: Sequence[str] = ()) -> ModelBound:
    """The requests (already in arrival order), one after another, through one sim replica
    of ``model`` with ``pages`` in each pool. ``extra_args``: the cluster's other replica
    flags (those that change reuse, e.g. ``--snapshot-interval-blocks``, must be the
    same); the replay's own flags win."""
    args = [*extra_args, "--engine", "sim", "--model", model, "--tokens-per-block",
            str(tokens_per_block), "--kv-pages", ",".join(map(str, pages)),
            "--sim-speedup", SPEEDUP, "--max-waiting", "4", "--log-level", "warning"]
    prompt = cached = 0
    with ServerProcess("replicas", *args, log_dir=log_dir) as replica, \
            httpx.Client(base_url=replica.url, timeout=60) as http:
        model_id = http.get("/v1/models").json()["data"][0]["id"]
        for i, req in enumerate(requests):
            body: dict = {"model": model_id, "max_tokens": req.max_tokens, "temperature": 0}
            if req.messages is not None:
                body["messages"] = [dict(m) for m in req.messages]
            else:
                body["prompt"] = req.prompt
            answer = http.post(req.path, json=body)
            if answer.status_code != 200:
                raise RuntimeError(f"bound replay: request {req.request_id} answered "
                                   f"{answer.status_code}: {answer.text[:300]}")
            usage = answer.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            if (i + 1) % 200 == 0:
                print(f"  bound replay: {i + 1}/{len(requests)}", file=sys.stderr)
        pools = http.get("/stats").json()["kv_cache"]["pools"]
    return ModelBound(cached / prompt if prompt else 0.0, prompt, cached, pools)


def tokens_at_most(req: Request) -> int:
    """An upper estimate of a request's prompt and answer tokens: a character a token (the
    byte-level tokenizer's count; subword tokenizers make fewer), plus the template's."""
    return (len(req.prompt or "") + sum(len(m["content"]) + 16 for m in req.messages or ())
            + req.max_tokens + 32)


def never_evicting_pages(requests: Sequence[Request], tokens_per_block: int,
                         num_pools: int) -> list[int]:
    """Pages enough in every pool that nothing is ever evicted: every block of every
    prompt and answer."""
    tokens = sum(tokens_at_most(r) for r in requests)
    return [tokens // tokens_per_block + 2 * len(requests) + 16] * num_pools


def pool_count(model: str) -> int:
    """How many pools a replica of ``model`` has (full, windows, recurrent)."""
    from replicas.checkpoint import read_spec  # imports torch: only for --model runs
    from replicas.engines.pools import PoolPlan

    return len(PoolPlan.of(read_spec(model)[0]).kinds)


def pressure_pages(working_set: Sequence[int], pressure: float, replicas: int,
                   floors: Sequence[int]) -> list[int]:
    """Per-replica pages of each pool so that the workload's working set in it is
    ``pressure`` times the cluster's pages, but never under ``floors`` (what one request
    needs to run at all)."""
    return [max(floor, int(ws / (pressure * replicas)))
            for ws, floor in zip(working_set, floors)]
