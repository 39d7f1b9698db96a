"""deploy/ against the code: every container's command line parses with the real CLI and builds the real
worker / router configs (the startup guards run on it), GPU requests match the parallel layouts, the router's
worker addresses name existing StatefulSet pods and their ports, probes and Services use declared ports, and
kustomization.yaml lists every manifest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tandem import cli

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ENV_REF = re.compile(r"\$\((\w+)\)")
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "tandem-pod-0"}  # what the kubelet fills in


def _docs() -> list[dict]:
    docs = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        if f.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


DOCS = _docs()
WORKLOADS = [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]
TANDEM = [
    (w, c) for w in WORKLOADS for c in w["spec"]["template"]["spec"]["containers"] if c.get("command") == ["tandem"]
]


def _name(w: dict, c: dict) -> str:
    return f"{w['metadata']['name']}/{c['name']}"


def _args(c: dict) -> list[str]:
    """The container's args with $(VAR) expanded as the kubelet does, from its env (fieldRef or value)."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = FIELD_VALUES[e["valueFrom"]["fieldRef"]["fieldPath"]]
    out = []
    for a in c["args"]:
        for ref in ENV_REF.findall(a):
            assert ref in env, f"{a!r} refers to ${ref}, which the container's env does not define"
        out.append(ENV_REF.sub(lambda m: env[m.group(1)], a))
    return out


def _parsed(c: dict):
    return cli.build_parser().parse_args(_args(c))


def _ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    on_disk = {f.name for f in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == on_disk
    assert {"tandem-router", "tandem-prefill", "tandem-decode", "tandem-redis"} <= {
        w["metadata"]["name"] for w in WORKLOADS
    }


@pytest.mark.parametrize(("w", "c"), TANDEM, ids=[_name(w, c) for w, c in TANDEM])
def test_command_line_builds_the_real_config(w, c):
    """The CLI parses it and the service's own config accepts it (layout and speculation guards included)."""
    a = _parsed(c)
    assert {"name": "LMCACHE_TRACK_USAGE", "value": "false"} in c["env"]
    if a.command == "prefill":
        cfg = cli.prefill_config_from_args(a)
        assert not cfg.speculative.enabled  # the producer never speculates
    elif a.command == "decode":
        cfg = cli.decode_config_from_args(a)
    else:
        assert a.command == "router"
        cfg = cli.router_config_from_args(a)
        return
    layout = cfg.engine.parallel
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == layout.world_size == c["resources"]["requests"]["nvidia.com/gpu"], _name(w, c)
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert any(str(a.model).startswith(m + "/") for m in mounts), f"--model {a.model} is on no mounted volume"
    if layout.enabled:
        assert "/dev/shm" in mounts  # NCCL between the pod's ranks


@pytest.mark.parametrize(("w", "c"), TANDEM, ids=[_name(w, c) for w, c in TANDEM])
def test_ports_and_probes_are_the_processes_own(w, c):
    a, ports = _parsed(c), _ports(c)
    if a.command == "router":
        assert {a.http_port, a.grpc_port} <= set(ports.values())
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health" and ports[get["port"]] == a.http_port
        return
    listening = {a.port, a.metrics_port} | ({a.handoff_data_port} if a.command == "prefill" else set())
    assert listening == set(ports.values()), _name(w, c)
    assert a.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == a.port
    if a.command == "prefill":
        assert a.advertise_host == FIELD_VALUES["status.podIP"]  # decode pods dial the pod itself


def test_services_target_declared_ports():
    for svc in (d for d in DOCS if d["kind"] == "Service"):
        pods = [
            w
            for w in WORKLOADS
            if w["spec"]["template"]["metadata"]["labels"].items() >= svc["spec"]["selector"].items()
        ]
        assert pods, f"Service {svc['metadata']['name']} selects no workload"
        declared = {p["name"] for w in pods for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in declared, f"{svc['metadata']['name']}: {p['targetPort']}"


def test_router_lists_existing_workers_and_the_index():
    (router,) = [c for w, c in TANDEM if _parsed(c).command == "router"]
    a = _parsed(router)
    sts = {w["metadata"]["name"]: w for w in WORKLOADS if w["kind"] == "StatefulSet"}
    services = {d["metadata"]["name"]: d for d in DOCS if d["kind"] == "Service"}
    for role, addrs in (("prefill", a.prefill), ("decode", a.decode)):
        assert addrs, f"the router lists no {role} worker"
        for addr in addrs:
            host, port = addr.rsplit(":", 1)
            pod, svc = host.split(".")[:2]
            set_name, ordinal = pod.rsplit("-", 1)
            s = sts[set_name]
            assert s["spec"]["serviceName"] == svc and services[svc]["spec"]["clusterIP"] == "None"
            assert int(ordinal) < s["spec"]["replicas"], f"{addr}: no such replica"
            worker = _parsed(s["spec"]["template"]["spec"]["containers"][0])
            assert worker.command == role and worker.port == int(port)
    redis = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", a.redis_url)
    assert redis and redis.group(1) in services
    assert int(redis.group(2)) in {p["port"] for p in services[redis.group(1)]["spec"]["ports"]}
    for _, c in TANDEM:
        if _parsed(c).command in ("prefill", "decode"):
            assert _parsed(c).redis_url == a.redis_url  # one shared prefix index


def test_workers_agree_on_the_page_size_and_the_image_carries_flashmla():
    """Prefill and decode workers hand over pages only when their fingerprints (page size included) agree; the
    manifests run FlashMLA's pages of 64, and the image's TANDEM_FLASHMLA_SO names the file its build stage
    copies in."""
    from engine.config import GPU_PAGE_SIZE

    sizes = {}
    for w, c in TANDEM:
        a = _parsed(c)
        if a.command == "prefill":
            sizes[_name(w, c)] = cli.prefill_config_from_args(a).engine.page_size
        elif a.command == "decode":
            sizes[_name(w, c)] = cli.decode_config_from_args(a).engine.page_size
    assert len(sizes) >= 2 and set(sizes.values()) == {GPU_PAGE_SIZE}, sizes
    docker = (DEPLOY / "Dockerfile").read_text()
    so = re.search(r"TANDEM_FLASHMLA_SO=(\S+)", docker).group(1)
    assert re.search(rf"^COPY --from=flashmla \S+ {re.escape(so)}$", docker, re.M), so
    assert "python -m kernels.flashmla.build" in docker and "fetch_sources.sh" in docker


def test_page_size_defaults_to_flashmlas_on_cuda_only():
    from engine.config import CPU_PAGE_SIZE, GPU_PAGE_SIZE, EngineConfig

    assert EngineConfig(model="m", device="cuda").page_size == GPU_PAGE_SIZE == 64
    assert EngineConfig(model="m", device="cuda:1").page_size == GPU_PAGE_SIZE
    assert EngineConfig(model="m", device="cpu").page_size == CPU_PAGE_SIZE == 16
    assert EngineConfig(model="m", device="cuda", page_size=16).page_size == 16
    assert cli.build_parser().parse_args(["prefill"]).page_size is None  # the engine decides, by device
