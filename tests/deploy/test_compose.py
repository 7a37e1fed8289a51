"""docker-compose.yml without Docker: its shape (services, health checks, start order,
mounts, images) agrees with the Dockerfile, Prometheus and Grafana files, and its router and
replica commands, run here as processes with service names mapped to loopback ports, form a
cluster that answers a chat request."""

from __future__ import annotations

import concurrent.futures
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from tests.procs import free_port

from .common import (COMPOSE, IMAGE_PREFIX, PROMETHEUS, LocalProcess, cli_flags,
                     dockerfile_stages, flags_of, image_repo, load_compose, module_of,
                     service_environment)

REPLICAS = ["replica-1", "replica-2", "replica-3"]
# The router runs here as in its image: torch cannot be imported.
NO_TORCH = ("import runpy, sys; sys.modules['torch'] = None; "
            "runpy.run_module('router', run_name='__main__', alter_sys=True)")


def prometheus_targets() -> dict[str, list[str]]:
    config = yaml.safe_load(PROMETHEUS.read_text())
    return {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in config["scrape_configs"]}


def command(service: dict) -> list[str]:
    cmd = service["command"]
    return [str(c) for c in cmd] if isinstance(cmd, list) else cmd.split()


def healthcheck(service: dict) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD", "exec form, so the check needs no shell in the image"
    return [str(t) for t in test[1:]]


# --------------------------------------------------------------------------- shape

def test_services_match_prometheus_and_grafana_names():
    services = load_compose()["services"]
    assert set(services) == {"router", *REPLICAS, "prometheus", "grafana"}
    targets = prometheus_targets()
    for target in targets["router"] + targets["replicas"]:
        name, port = target.split(":")
        assert flags_of(command(services[name]))["--port"] == port, target
    # the router names replicas as Prometheus labels them (replacement: http://<target>)
    router_replicas = flags_of(command(services["router"]))["--replicas"].split(",")
    assert router_replicas == [f"http://{t}" for t in targets["replicas"]]
    assert [urlsplit(u).hostname for u in router_replicas] == REPLICAS


def test_flags_exist_and_hosts_are_reachable():
    services = load_compose()["services"]
    for name in ["router", *REPLICAS]:
        argv = command(services[name])
        module = module_of(argv)
        assert module == ("router" if name == "router" else "replicas")
        flags = flags_of(argv[3:])
        assert set(flags) <= cli_flags(module), (name, set(flags) - cli_flags(module))
        assert flags["--host"] == "0.0.0.0", f"{name} must listen beyond its container"
        env = services[name].get("environment") or {}
        for key in (env if isinstance(env, dict) else [e.split("=")[0] for e in env]):
            prefix = "ROUTER_" if module == "router" else "REPLICA_"
            flag = "--" + key.removeprefix(prefix).lower().replace("_", "-")
            assert key.startswith(prefix) and flag in cli_flags(module), (name, key)
    for name in REPLICAS:
        assert flags_of(command(services[name]))["--engine"] == "torch"


def test_health_checks_and_start_order():
    services = load_compose()["services"]
    for name in ["router", *REPLICAS]:
        check = " ".join(healthcheck(services[name]))
        port = flags_of(command(services[name]))["--port"]
        assert f"http://127.0.0.1:{port}/ready" in check, (name, check)
    assert services["router"]["depends_on"] == {
        r: {"condition": "service_healthy"} for r in REPLICAS}
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for name in ("prometheus", "grafana"):
        assert healthcheck(services[name])
    assert "127.0.0.1:8000:8000" in services["router"]["ports"]


def test_images_follow_dockerfile_targets():
    services = load_compose()["services"]
    targets = set(dockerfile_stages())
    for name in ["router", *REPLICAS]:
        build = services[name]["build"]
        assert build["context"] == "." and build["target"] in targets
        assert image_repo(services[name]["image"]) == IMAGE_PREFIX + build["target"]
    assert services["router"]["build"]["target"] == "router"
    assert {services[r]["image"] for r in REPLICAS} == {"prefix-router-replica:latest"}


def test_mounts_point_at_existing_files():
    services = load_compose()["services"]
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            src, dst, *mode = volume.split(":")
            assert src.startswith("./") and mode == ["ro"], volume
            path = (COMPOSE.parent / src).resolve()
            assert path.exists(), volume
            mounts[dst] = path
    # what deploy/grafana/README.md and deploy/prometheus/prometheus.yml expect
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS.resolve()
    provisioning = mounts["/etc/grafana/provisioning"]
    assert (provisioning / "datasources").is_dir() and (provisioning / "dashboards").is_dir()
    dashboards = mounts["/var/lib/grafana/dashboards"]
    assert list(dashboards.glob("*.json"))
    provider = yaml.safe_load((provisioning / "dashboards" / "prefix-router.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    assert any(p.endswith(":9090") for p in services["prometheus"]["ports"])
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    rel = Path(home).relative_to("/var/lib/grafana/dashboards")
    assert (dashboards / rel).is_file(), home


def test_no_secret_in_compose():
    text = COMPOSE.read_text()
    services = load_compose()["services"]
    env = services["router"]["environment"]
    for key in ("ROUTER_TENANT_SECRET", "ROUTER_ADMIN_TOKEN"):
        assert key in env and env[key] is None, f"{key}: passed through, never set here"
    assert not re.search(r"--(tenant-secret|admin-token|internal-token)", text)


# --------------------------------------------------------------------------- run

def local_argv(argv: list[str], ports: dict[tuple[str, str], int], self_port: int) -> list[str]:
    """The container's command for this machine: this Python, loopback, free ports, and
    `http://<service>:<port>` URLs pointed at the local process of that service."""
    out = [sys.executable if a == "python" else a for a in argv]
    flags = flags_of(out)
    for i, a in enumerate(out[:-1]):
        if a == "--host":
            out[i + 1] = "127.0.0.1"
        elif a == "--port":
            out[i + 1] = str(self_port)
        elif a == "--replicas":
            urls = []
            for url in flags["--replicas"].split(","):
                u = urlsplit(url)
                urls.append(f"http://127.0.0.1:{ports[(u.hostname, str(u.port))]}")
            out[i + 1] = ",".join(urls)
    return out


def local_check(check: list[str], container_port: str, port: int) -> list[str]:
    return [sys.executable if a == "python" else
            a.replace(f"127.0.0.1:{container_port}/", f"127.0.0.1:{port}/") for a in check]


def test_compose_cluster_answers_through_the_router():
    services = load_compose()["services"]
    ports = {}  # (service, container port) -> loopback port here
    for name in ["router", *REPLICAS]:
        ports[(name, flags_of(command(services[name]))["--port"])] = free_port()
    procs: list[LocalProcess] = []
    try:
        replicas = {}
        for name in REPLICAS:
            svc = services[name]
            container_port = flags_of(command(svc))["--port"]
            port = ports[(name, container_port)]
            proc = LocalProcess(name, local_argv(command(svc), ports, port),
                                service_environment(svc))
            procs.append(proc)
            replicas[name] = (proc, local_check(healthcheck(svc), container_port, port), port)
        # depends_on: condition: service_healthy -- the replicas' own health checks pass
        with concurrent.futures.ThreadPoolExecutor(len(replicas)) as pool:
            for f in [pool.submit(p.wait_healthy, check, f"http://127.0.0.1:{port}/ready", 120)
                      for p, check, port in replicas.values()]:
                f.result()

        svc = services["router"]
        container_port = flags_of(command(svc))["--port"]
        port = ports[("router", container_port)]
        argv = local_argv(command(svc), ports, port)
        assert argv[1:3] == ["-m", "router"]
        router = LocalProcess("router", [sys.executable, "-c", NO_TORCH, *argv[3:]],
                              service_environment(svc))
        procs.append(router)
        router.wait_healthy(local_check(healthcheck(svc), container_port, port),
                            f"http://127.0.0.1:{port}/ready", 60)

        expected = {f"http://127.0.0.1:{p}": name for name, (_, _, p) in replicas.items()}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hello from docker compose"}],
                # greedy: two of the byte-level vocabulary's 260 ids end the answer, and at
                # temperature 1 the random-weight model samples one now and then (CI got 7)
                "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.headers["x-replica"] in expected, (r.headers["x-replica"], expected)
            body = r.json()
            assert body["choices"][0]["message"]["content"]
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == 8
            stats = client.get("/stats").json()
            assert {rep["url"] for rep in stats["replicas"]} == set(expected)
            models = client.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["torch-byte-lm"]
    finally:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(procs))) as pool:
            list(pool.map(LocalProcess.stop, procs))
