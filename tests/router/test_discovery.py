"""Replicas found through DNS: added with the usual checks, dropped when they vanish."""

import asyncio

import httpx

from router.service import RouterService
from router.settings import RouterSettings
from tests.procs import Proc


def test_discovery_adds_and_drops_replicas_as_dns_changes():
    with Proc("replicas", "--engine", "sim", "--log-level", "warning") as a, \
            Proc("replicas", "--engine", "sim", "--log-level", "warning") as b:
        answers = [{a.url}, {a.url, b.url}, {b.url}, RuntimeError]

        async def run():
            svc = RouterService(RouterSettings(discover_dns="replicas.test:9001"))

            async def fake_resolve(host, port):
                assert (host, port) == ("replicas.test", 9001)
                answer = answers.pop(0)
                if answer is RuntimeError:
                    raise OSError("temporary failure in name resolution")
                return answer
            svc.resolve = fake_resolve
            seen = []
            for _ in range(4):
                await svc.discover_once()
                seen.append({u: r.health.value for u, r in svc.registry.replicas.items()})
            await svc.upstream.close()
            return seen
        seen = asyncio.run(run())
    assert seen == [{a.url: "healthy"}, {a.url: "healthy", b.url: "healthy"},
                    {b.url: "healthy"}, {b.url: "healthy"}]  # a DNS failure changes nothing


def test_router_discovers_a_replica_by_dns_name():
    with Proc("replicas", "--engine", "sim", "--log-level", "warning") as rep:
        with Proc("router", "--discover-dns", f"127.0.0.1:{rep.port}",
                  "--discover-interval-s", "0.5", "--log-level", "warning") as router:
            r = httpx.post(router.url + "/v1/completions", json={"prompt": "dns",
                                                                  "max_tokens": 1})
            assert r.status_code == 200 and r.headers["x-replica"] == rep.url
