"""deploy/k8s without a cluster: the manifests parse and hang together (selectors, ports,
probes, DNS discovery of the headless Service), every flag exists, images are the
Dockerfile's targets as named in docker-compose.yml, replicas get a GPU each, the router runs
several pods, and no secret value is shipped."""

from __future__ import annotations

import re

import pytest
import yaml

from .common import (IMAGE_PREFIX, K8S, cli_flags, dockerfile_stages, flags_of, image_repo,
                     load_compose, module_of)

SECRET_WORDS = re.compile(r"SECRET|TOKEN|PASSWORD|API_KEY", re.IGNORECASE)


def manifests() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def of_kind(kind: str) -> list[dict]:
    return [d for d in manifests() if d["kind"] == kind]


def workloads() -> list[dict]:
    return [d for d in manifests() if d["kind"] in ("Deployment", "StatefulSet")]


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def argv(container: dict) -> list[str]:
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def by_module(module: str) -> tuple[dict, dict]:
    """The one workload whose container runs ``python -m <module>``, and that container."""
    found = [(w, c) for w in workloads() for c in containers(w) if module_of(argv(c)) == module]
    assert len(found) == 1, f"one workload runs python -m {module}"
    return found[0]


def port_number(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p.get("name") == port)


def selects(service: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def test_manifests_parse_and_kustomization_lists_them():
    docs = manifests()
    assert {d["kind"] for d in docs} >= {"Service", "StatefulSet", "Deployment"}
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"], d
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    for w in workloads():  # the selector picks the pod template's own labels
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("module", ["router", "replicas"])
def test_every_flag_exists(module):
    _, container = by_module(module)
    args = argv(container)
    flags = flags_of(args[3:])
    missing = set(flags) - cli_flags(module)
    assert not missing, f"python -m {module} --help lacks {sorted(missing)}"
    assert flags["--host"] == "0.0.0.0"
    for env in container.get("env", []):
        prefix = "ROUTER_" if module == "router" else "REPLICA_"
        flag = "--" + env["name"].removeprefix(prefix).lower().replace("_", "-")
        assert env["name"].startswith(prefix) and flag in cli_flags(module), env["name"]


@pytest.mark.parametrize("module", ["router", "replicas"])
def test_ports_and_probes_agree_with_flags(module):
    workload, container = by_module(module)
    port = int(flags_of(argv(container))["--port"])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    paths = {}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if probe in container:
            get = container[probe]["httpGet"]
            assert port_number(container, get["port"]) == port, probe
            paths[probe] = get["path"]
    assert paths["readinessProbe"] == "/ready"
    assert paths["livenessProbe"] == "/health"
    services = [s for s in of_kind("Service") if selects(s, workload)]
    assert len(services) == 1, f"one Service in front of python -m {module}"
    for p in services[0]["spec"]["ports"]:
        assert port_number(container, p.get("targetPort", p["port"])) == port


def test_replicas_get_a_gpu_each_and_a_headless_service():
    workload, container = by_module("replicas")
    flags = flags_of(argv(container))
    assert flags["--engine"] == "torch"
    resources = container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1  # GPUs are set in limits
    assert int(resources["requests"]["nvidia.com/gpu"]) == 1
    headless = [s for s in of_kind("Service") if selects(s, workload)]
    assert headless[0]["spec"]["clusterIP"] == "None"
    assert not headless[0]["spec"].get("publishNotReadyAddresses", False)
    if workload["kind"] == "StatefulSet":
        assert workload["spec"]["serviceName"] == headless[0]["metadata"]["name"]
    assert workload["spec"]["replicas"] >= 2


def test_router_pods_discover_replicas_through_dns():
    router, container = by_module("router")
    assert router["kind"] == "Deployment" and router["spec"]["replicas"] >= 2
    flags = flags_of(argv(container))
    assert "--replicas" not in flags
    assert "--discover-dns" in flags, "the router finds replicas through DNS"
    host, _, port = flags["--discover-dns"].rpartition(":")
    assert float(flags["--discover-interval-s"]) > 0
    replicas, replica_container = by_module("replicas")
    headless = next(s for s in of_kind("Service") if selects(s, replicas))
    name = headless["metadata"]["name"]
    assert host == name or host.startswith(name + "."), host  # short name or FQDN
    assert int(port) == int(flags_of(argv(replica_container))["--port"])
    assert int(port) in [p["port"] for p in headless["spec"]["ports"]]


def test_images_are_the_dockerfile_targets_named_as_in_compose():
    compose = load_compose()["services"]
    targets = set(dockerfile_stages())
    for module, target in (("router", "router"), ("replicas", "replica")):
        _, container = by_module(module)
        repo = image_repo(container["image"])
        assert repo == IMAGE_PREFIX + target and target in targets
        assert repo in {image_repo(s["image"]) for s in compose.values()
                        if s.get("build", {}).get("target") == target}
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for image in kustomization.get("images", []):
        assert image["name"] in {IMAGE_PREFIX + "router", IMAGE_PREFIX + "replica"}


def test_tenant_secret_comes_from_a_secret_and_no_secret_is_shipped():
    _, container = by_module("router")
    env = {e["name"]: e for e in container["env"]}
    ref = env["ROUTER_TENANT_SECRET"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"] and not ref.get("optional", False)
    assert "value" not in env["ROUTER_TENANT_SECRET"]
    assert not of_kind("Secret"), "ship no Secret: kubectl create secret (deploy/README.md)"
    for w in workloads():
        for c in containers(w):
            assert not {"--tenant-secret", "--admin-token", "--internal-token",
                        "--backend-api-key"} & set(flags_of(argv(c))), c["name"]
            for e in c.get("env", []):
                if SECRET_WORDS.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], e["name"]
    text = "\n".join(p.read_text() for p in K8S.glob("*"))
    assert not re.search(r"^\s*(data|stringData):", text, re.MULTILINE)


def test_pods_run_as_the_images_user():
    users = {rest for stage in dockerfile_stages().values() for word, rest in stage
             if word == "USER"}
    assert users == {"10001:10001"}
    for w in workloads():
        ctx = w["spec"]["template"]["spec"]["securityContext"]
        assert ctx["runAsNonRoot"] and f"{ctx['runAsUser']}:{ctx['runAsGroup']}" in users
