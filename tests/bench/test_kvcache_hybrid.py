"""bench.kvcache_hybrid: its workloads, one row served by the real scheduler on a tiny
configuration (exact figures computed by hand: full attention, the hybrid cache under issue
13's rules, and what holds for the hybrid cache under any rules), the worker's provenance
check, and the driver's figures."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import kvcache_hybrid as driver
from bench._kvcache_hybrid_worker import (Session, cache_config, code_provenance,
                                          foreign_modules, multi_turn_sessions,
                                          pages_without_pressure, run_row, shared_prompt_sessions)
from replicas.engines.sim import SimTiming
from replicas.scheduler import SchedulerConfig

REPO = Path(__file__).resolve().parents[2]
TPB, WINDOW, CHUNK = 8, 16, 16  # the 32-token system prompt is two windows long
FAST = SimTiming(speedup=1e6)


def shared() -> list[Session]:
    """One client, three requests in turn: 32-token system prompt + 8-token question, 4 out."""
    return shared_prompt_sessions(requests=3, clients=1, system_tokens=32, question_tokens=8,
                                  max_tokens=4, think_mean_s=0.0, seed=0)


def chat() -> list[Session]:
    """One conversation of 3 turns: a 12-token opening, then 5-token messages, 6-token answers."""
    return multi_turn_sessions(conversations=1, turns=3, first_tokens=12, message_tokens=(5, 5),
                               answer_tokens=(6, 6), think_mean_s=0.0, seed=0)


def serve(sessions: list[Session], kind: str) -> dict:
    pages = pages_without_pressure(sessions, TPB)
    return asyncio.run(run_row(sessions, cache_config(kind, TPB, WINDOW, pages), FAST,
                               SchedulerConfig(max_num_seqs=8, max_batched_tokens=CHUNK)))


def column(result: dict, name: str) -> list:
    return [r[name] for r in sorted(result["records"], key=lambda r: r["id"])]


# --------------------------------------------------------------------------- workloads

def test_shared_prompt_workload_is_one_system_prompt_and_distinct_questions():
    (s,) = shared()
    assert s == shared()[0]  # seeded
    assert (s.chained, s.start_s, s.think_s) == (False, 0.0, (0.0, 0.0))
    assert [len(t.message) for t in s.turns] == [40, 40, 40]
    assert len({t.message[:32] for t in s.turns}) == 1
    assert [t.message[32] for t in s.turns] == [0, 1, 2]  # no question shares a first token


def test_clients_take_requests_in_turn():
    sessions = shared_prompt_sessions(requests=5, clients=2, system_tokens=32,
                                      question_tokens=8, max_tokens=4, think_mean_s=0.05, seed=0)
    assert [[t.message[32] for t in s.turns] for s in sessions] == [[0, 2, 4], [1, 3]]
    assert [len(s.think_s) for s in sessions] == [2, 1]
    assert all(0 <= s.start_s <= 0.05 for s in sessions)


def test_pages_without_pressure_counts_every_request_as_if_nothing_were_reused():
    # shared: 3 x (ceil((40 + 4) / 8) + 2); chat: prompts 12, 12+6+5, 23+6+5 with 6 out each
    assert pages_without_pressure(shared(), TPB) == 3 * (6 + 2)
    assert pages_without_pressure(chat(), TPB) == (3 + 2) + (4 + 2) + (5 + 2)


def test_unknown_cache_config_says_what_exists():
    with pytest.raises(ValueError, match=r"\['full', 'hybrid'\]"):
        cache_config("mamba", TPB, WINDOW, 8)


# --------------------------------------------------------------------------- one row

def test_full_attention_shared_prompt_reuses_the_system_prompt_from_the_second_request():
    r = serve(shared(), "full")
    assert column(r, "prompt_tokens") == [40, 40, 40]
    assert column(r, "cached_tokens") == [0, 32, 32]
    assert column(r, "cached_before_pruning") == [0, 32, 32]
    assert column(r, "output_tokens") == [4, 4, 4]
    assert (r["evicted_blocks"], r["preemptions"], r["num_pages"]) == (0, 0, 24)
    assert all(t > 0 for t in column(r, "ttft_s"))


def test_full_attention_conversation_resumes_where_the_last_turn_ended():
    # a turn's history ends at prompt + answer - 1 (the last token's KV is never computed)
    r = serve(chat(), "full")
    assert column(r, "prompt_tokens") == [12, 23, 34]
    assert column(r, "cached_tokens") == [0, 12 + 6 - 1, 23 + 6 - 1]
    assert (r["evicted_blocks"], r["preemptions"], r["num_pages"]) == (0, 0, 18)


@pytest.mark.parametrize("sessions", [shared, chat], ids=["shared_prompt", "multi_turn"])
def test_hybrid_sees_the_same_prompts_and_reuses_at_most_what_full_attention_does(sessions):
    full, hybrid = serve(sessions(), "full"), serve(sessions(), "hybrid")
    assert column(hybrid, "prompt_tokens") == column(full, "prompt_tokens")
    assert column(hybrid, "output_tokens") == column(full, "output_tokens")
    cached, before = column(hybrid, "cached_tokens"), column(hybrid, "cached_before_pruning")
    assert cached[0] == 0
    assert all(c <= b <= f for c, b, f in zip(cached, before, column(full, "cached_tokens")))
    pages = pages_without_pressure(sessions(), TPB)
    assert (hybrid["evicted_blocks"], hybrid["preemptions"], hybrid["num_pages"]) == \
        (0, 0, 3 * pages)  # three pools


def test_hybrid_reuses_what_full_attention_does_under_issue_13s_rules():
    """Window pages that left a sequence's window stay cached, so the second request reuses
    the 32-token system prompt (it needs the window pages of blocks (33 - 16) // 8 = 2..3,
    and the 16-token chunks left a snapshot at 32); each closed turn keeps a snapshot where
    its history ends (17, 28), inside a block. (Today's rules, 488841c: [0, 0, 0] and
    [0, 16, 24], the last block boundaries a decode step crossed.)"""
    assert column(serve(shared(), "hybrid"), "cached_tokens") == [0, 32, 32]
    assert column(serve(chat(), "hybrid"), "cached_tokens") == [0, 17, 28]


# --------------------------------------------------------------------------- provenance

def test_provenance_names_this_tree_and_nothing_else():
    prov = code_provenance()
    assert Path(prov["root"]) == REPO
    assert foreign_modules(prov, REPO) == []
    loaded = prov["module_files"].keys()
    assert {"kvcache.cache", "replicas.scheduler", "replicas.engines.sim"} <= loaded
    assert len(prov["sources_sha256"]) == 64


def test_foreign_modules_lists_files_from_another_tree():
    prov = {"module_files": {"replicas": None, "kvcache": "/a/kvcache/__init__.py",
                             "replicas.scheduler": "/b/replicas/scheduler.py"}}
    assert foreign_modules(prov, Path("/a")) == ["replicas.scheduler (/b/replicas/scheduler.py)"]


def tiny_spec(root: Path) -> dict:
    return {"expect_code_root": str(root), "tokens_per_block": TPB, "window": WINDOW,
            "seed": 0, "sim_speedup": 1e6, "max_num_seqs": 8,
            "workloads": {"shared_prompt": {"requests": 2, "clients": 1, "system_tokens": 32,
                                            "question_tokens": 8, "max_tokens": 4,
                                            "think_mean_s": 0.0}},
            "rows": [{"workload": "shared_prompt", "config": "full", "max_batched_tokens": CHUNK}]}


def run_script(spec: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(driver.WORKER)], input=json.dumps(spec),
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
                          check=False)


def test_worker_script_runs_the_code_on_pythonpath_and_says_so():
    proc = run_script(tiny_spec(REPO))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert Path(out["code"]["root"]) == REPO
    assert foreign_modules(out["code"], REPO) == []
    assert [r["cached_tokens"] for r in out["rows"][0]["records"]] == [0, 32]


def test_worker_script_refuses_code_from_another_tree(tmp_path):
    proc = run_script(tiny_spec(tmp_path))
    assert proc.returncode != 0
    assert f"project code not from {tmp_path}" in proc.stderr


# --------------------------------------------------------------------------- figures

def record(i: int, prompt: int, cached: int, ttft_ms: float) -> dict:
    return {"id": f"c-{i}", "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_before_pruning": cached, "ttft_s": ttft_ms / 1e3}


def row(records: list[dict], evicted: int = 0) -> dict:
    return {"workload": "shared_prompt", "config": "hybrid", "max_batched_tokens": 256,
            "records": records, "seconds": 1.0, "evicted_blocks": evicted, "preemptions": 0,
            "num_pages": 10}


def test_summarise_is_token_hit_rate_and_ttft_in_ms():
    s = driver.summarise(row([record(1, 100, 60, 4.0), record(0, 100, 0, 10.0)]))
    assert (s["requests"], s["prompt_tokens"], s["cached_tokens"]) == (2, 200, 60)
    assert s["hit_rate"] == pytest.approx(0.3)
    assert s["ttft_mean_ms"] == pytest.approx(7.0)
    assert s["cached_per_request"] == [0, 60]  # by request id


def test_check_runs_names_pressure_changed_code_and_changed_prompts():
    def run(recs: list[dict], digest: str, evicted: int = 0) -> dict:
        return {"code": {"sources_sha256": digest}, "rows": [row(recs, evicted)]}

    ok = [record(0, 100, 0, 1.0)]
    assert driver.check_runs({"before": [run(ok, "a"), run(ok, "a")],
                              "after": [run(ok, "b")]}) == []
    problems = driver.check_runs({"before": [run(ok, "a"), run(ok, "c")],
                                  "after": [run([record(0, 99, 0, 1.0)], "b", evicted=2)]})
    assert problems == [
        "the before code changed between rounds",
        "after shared_prompt/hybrid/chunk256: 2 blocks evicted, 0 preemptions (cache pressure)",
        "after shared_prompt/hybrid/chunk256: prompts differ from the first run's",
    ]
