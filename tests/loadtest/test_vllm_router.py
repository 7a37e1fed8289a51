"""vLLM's router as a peer (loadtest.peers.VLLMRouter), installed in .peers/vllm-router,
in front of our sim replicas: it routes completions, streamed and whole, to both."""

import asyncio
import json

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
