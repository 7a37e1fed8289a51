"""The discrete-event simulator: same policies, real caches, modelled time."""

import json
import subprocess
import sys
from array import array

from loadtest.driver import arrival_offsets
from loadtest.simulate import (SimConfig, SimRequest, Simulation, bound_hit_rate, simulate,
                               to_sim_requests)
from loadtest.workloads import multi_turn, shared_prefix
from router.policies import make_policy


def workload(groups=8, per=8, rate=20.0, seed=0):
    reqs = shared_prefix(groups, per, 512, 32, 8, seed=seed)
    return to_sim_requests(reqs, arrival_offsets(len(reqs), rate, seed=seed))


def test_runs_are_reproducible():
    cfg = SimConfig(replicas=4, kv_pages=48)
    a, b = simulate(workload(), "prefix", cfg), simulate(workload(), "prefix", cfg)
    assert (a.hit_rate, a.ttft_s, a.prefill_tokens_per_replica) == \
        (b.hit_rate, b.ttft_s, b.prefill_tokens_per_replica)


def test_prefix_reaches_the_pooled_bound_and_beats_round_robin():
    reqs = workload()
    cfg = SimConfig(replicas=4, kv_pages=48)  # 2 system prompts (17 pages each) per replica
    prefix, rr = simulate(reqs, "prefix", cfg), simulate(reqs, "round_robin", cfg)
    pooled = bound_hit_rate(reqs, 4 * 48, 32)
    infinite = bound_hit_rate(reqs, None, 32)
    assert prefix.hit_rate >= 0.95 * pooled
    assert prefix.hit_rate >= 2 * rr.hit_rate
    assert pooled <= infinite
    # The infinite bound, by brute force: each prompt reuses its longest common prefix with
    # any earlier sequence (prompt + 7 committed output tokens), keeping its last token.
    seen, hit = [], 0
    for r in reqs:
        prompt = list(r.tokens)
        best = max((_lcp(prompt, s) for s in seen), default=0)
        hit += min(best, len(prompt) - 1)
        seen.append(prompt + [97] * (r.output_tokens - 1))
    assert infinite == hit / sum(len(r.tokens) for r in reqs)
    assert hit >= 56 * 513  # at least every group's shared prefix after its first prompt
    assert prefix.requests == rr.requests == 64
    assert sum(prefix.requests_per_replica) == 64


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_infinite_bound_counts_every_repeated_prefix_exactly():
    a = array("I", range(100))
    reqs = [SimRequest(a, 2, 0.0), SimRequest(a, 2, 1.0),
            SimRequest(array("I", range(100, 164)), 2, 2.0)]
    # Second request reuses 99 of 100 (the last token is always computed); third: 0.
    assert bound_hit_rate(reqs, None, 16) == 99 / 264


def test_session_turns_never_overlap():
    reqs = multi_turn(4, 3, 128, 32, 16, seed=1)
    sim_reqs = to_sim_requests(reqs, [0.0] * len(reqs))  # all due at once
    sim = Simulation(SimConfig(replicas=2, kv_pages=64), make_policy("prefix", seed=0))
    result = sim.run(sim_reqs)
    assert result.requests == 12 and len(result.e2e_s) == 12
    assert result.hit_rate > 0.5  # later turns reuse their history


def test_bounded_fan_out_probes_k_replicas():
    """With probe_k=2 each request probes 2 of the 8 replicas, one of them the replica its
    group's prefix was sent to: most of the full fan-out's reuse is kept (0.71 against 0.78
    here; 2 replicas drawn at random keep 0.27)."""
    reqs = workload(groups=16, per=6, rate=40.0)
    full = simulate(reqs, "prefix", SimConfig(replicas=8, kv_pages=40))
    policy, probed = make_policy("prefix", seed=0), []
    targets = policy.probe_targets

    def recording(request, replicas, k):
        probed.append(targets(request, replicas, k))
        return probed[-1]
    policy.probe_targets = recording
    k2 = Simulation(SimConfig(replicas=8, kv_pages=40, probe_k=2), policy).run(reqs)
    assert full.requests == k2.requests == 96
    assert len(probed) == 96 and all(len(t) == len(set(t)) == 2 for t in probed)
    assert 0.85 * full.hit_rate <= k2.hit_rate <= full.hit_rate + 0.05


def test_simulate_command_writes_a_report(tmp_path):
    out = tmp_path / "sim.json"
    run = subprocess.run([sys.executable, "-m", "loadtest", "simulate", "--groups", "4",
                          "--prompts-per-group", "4", "--system-len", "256", "--question-len",
                          "16", "--replicas", "2", "--kv-pages", "32", "--policies",
                          "prefix,round_robin", "--probe-k", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"prefix", "round_robin", "prefix k=1"}
    assert 0 < doc["bounds"]["pooled"] <= doc["bounds"]["infinite"] <= 1
    assert "prefix k=1" in run.stdout
