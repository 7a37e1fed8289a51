"""vLLM's router as a peer (loadtest.peers.VLLMRouter), installed in .peers/vllm-router,
in front of our sim replicas: it routes completions, streamed and whole, to both."""

import asyncio
import json
import subprocess
import sys

import httpx

from loadtest.checked import checked_request
from loadtest.peers import VLLM_ROUTER_VERSION, VLLMRouter, ensure_vllm_router
from loadtest.processes import ServerProcess


def test_vllm_router_routes_our_replicas():
    exe = ensure_vllm_router()
    assert exe.name == "vllm-router"
    assert (exe.parent.parent / ".installed").read_text().strip() == \
        f"vllm-router=={VLLM_ROUTER_VERSION}"
    with ServerProcess("replicas", "--engine", "sim") as a, \
            ServerProcess("replicas", "--engine", "sim") as b, \
            VLLMRouter([a.url, b.url], policy="round_robin") as gw:
        assert gw.model == "sim-byte-lm" and gw.cmd[1] == "--worker-urls"

        async def main():
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
                return [await checked_request(c, "/v1/completions",
                                              {"model": gw.model, "prompt": f"p{i}",
                                               "max_tokens": 4, "stream": i % 2 == 0})
                        for i in range(6)]
        outcomes = asyncio.run(main())
        assert all(o.ok for o in outcomes), [o.error for o in outcomes]
        served = [json.loads(httpx.get(r.url + "/stats").text)["reuse"]["queries"]
                  for r in (a, b)]
        assert all(n > 0 for n in served)  # round robin reached both
    assert gw.proc.returncode == 0  # SIGTERM: a clean stop


def test_vllm_routers_cache_aware_policy_tokenizes_through_our_render_endpoints():
    """vLLM's router asks every worker to render each request (``/v1/completions/render``,
    ``/v1/chat/completions/render``) and matches prefixes on the ids; without those it
    routes by load alone (outcome ``missing_tokens``). Sent one at a time: each group's and
    the chat's first request (and the readiness ping) miss, every repeat hits."""
    with ServerProcess("replicas", "--engine", "sim") as a, \
            ServerProcess("replicas", "--engine", "sim") as b, \
            VLLMRouter([a.url, b.url]) as gw:
        assert gw.policy == "cache_aware"
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(5):
                for g in range(2):
                    r = c.post("/v1/completions", json={
                        "model": gw.model, "max_tokens": 2,
                        "prompt": f"[group {g}] " + "a shared system prompt " * 30 + f"q{i}"})
                    assert r.status_code == 200, r.text
            for i in range(3):
                r = c.post("/v1/chat/completions", json={
                    "model": gw.model, "max_tokens": 2,
                    "messages": [{"role": "system", "content": "a chat preamble " * 40},
                                 {"role": "user", "content": f"q{i}"}]})
                assert r.status_code == 200, r.text
        assert gw.prefix_decisions() == {"prefix_miss": 4.0, "prefix_hit": 10.0}


def test_compare_reports_the_vllm_routers_decisions_on_the_workload_alone(tmp_path):
    """``loadtest compare --external vllm-router``: the peer's prefix-routing outcomes over
    the run (its readiness ping left out, and no GET /stats sent through it, which it would
    forward to a worker and count): 3 groups x 4 prompts, each group's first a miss."""
    out = subprocess.run(
        [sys.executable, "-m", "loadtest", "compare", "--groups", "3", "--prompts-per-group",
         "4", "--system-len", "256", "--question-len", "32", "--output-len", "4",
         "--replicas", "2", "--kv-pages", "64", "--policies", "", "--external", "vllm-router",
         "--rate", "20", "--replica-args", "--sim-speedup 10", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "missing_tokens" not in out.stderr
    run = json.loads((tmp_path / "compare.json").read_text())["runs"]["vllm-router"]
    assert run["peer_prefix_decisions"] == {"prefix_hit": 9.0, "prefix_miss": 3.0}
    assert run["summary"]["failed"] == 0
