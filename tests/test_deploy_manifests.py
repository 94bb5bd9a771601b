"""deploy/kubernetes/ and the Dockerfile, checked as far as a machine without a cluster can.

* The kustomization is rendered as kustomize would (its features this one uses: resources, a
  namespace, a ConfigMap generated from fabric.toml), and compared with `kubectl kustomize`
  where kubectl is installed. Every manifest is validated against the Kubernetes schemas
  (kubernetes-validate, strict: an unknown field is an error) and the ScaledObject against
  KEDA's own CRD schema (tests/schemas/keda/); a broken copy of each is rejected the same way.
* The broker's ConfigMap loads with the project's config loader and binds exactly the ports
  the Services and the pod expose; the probes, the volumes and the grace periods agree with
  what the config and the worker's flags say.
* Every command line the image and the manifests run is accepted by run.py's own parser.
* The Secrets make-secrets.sh makes (with `run.py keys new`), mounted as the kubelet would,
  let a broker started from the ConfigMap and a worker started from the Deployment's
  arguments run a job, and the API key open the HTTP API (real processes).
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
import zygote
from broker import Broker, free_ports, probe
from client_commands import run_cli
from conftest import wait_for

from assembly.stages import stage_specs
from config import load_settings
from pipeline.transport.binds import bound, host_port
from pipeline.transport.security import check_exposure
from pipeline.transport.topology import RING_BYTES, ring_specs

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
KEDA_CRD = Path(__file__).parent / "schemas" / "keda" / "keda.sh_scaledobjects.yaml"
# The oldest Kubernetes these manifests claim (docs/scaling.md) and the newest schemas known.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
# The kustomization keys the renderer below implements; any other is a feature it would
# silently leave out, so the test refuses it instead.
KUSTOMIZE_KEYS = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "configMapGenerator",
    "generatorOptions",
}
# The prometheus trigger's metadata keys (KEDA pkg/scalers/prometheus_scaler.go, the commit
# of tests/schemas/keda/SOURCE.md; the CRD types metadata as any strings). Required first.
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
PROMETHEUS_KEYS = PROMETHEUS_REQUIRED | {
    "queryParameters",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "awsRegion",
    "timeout",
    "identityOwner",
}
DRAIN_MARGIN_S = 15  # a drained worker still sends its results and says goodbye


# ---- rendering -------------------------------------------------------------------------
def render(directory: Path) -> list[dict]:
    """The resources `kubectl kustomize DIRECTORY` prints, for the features used here."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZE_KEYS
    assert not unknown, f"the test's renderer does not implement {unknown}: extend render()"
    resources: list[dict] = []
    for name in kustomization["resources"]:
        resources += [d for d in yaml.safe_load_all((directory / name).read_text()) if d]
    generator_options = kustomization.get("generatorOptions", {})
    for generator in kustomization.get("configMapGenerator", []):
        assert generator_options.get("disableNameSuffixHash"), "the renderer adds no hash"
        data = {Path(f).name: (directory / f).read_text() for f in generator["files"]}
        resources.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": generator["name"]},
                "data": data,
            }
        )
    namespace = kustomization.get("namespace")
    for resource in resources:
        if namespace and resource["kind"] not in CLUSTER_SCOPED:
            resource["metadata"]["namespace"] = namespace
    return resources


def listed_files_are_complete(directory: Path) -> list[str]:
    """Manifests in `directory` that its kustomization does not list (none, normally)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    return sorted(
        p.name for p in directory.glob("*.yaml") if p.name != "kustomization.yaml"
        and p.name not in listed
    )  # fmt: skip


def by_kind(resources: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["kind"], r["metadata"]["name"]): r for r in resources}


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict]:
    return by_kind(render(KUBE))


# ---- schemas ---------------------------------------------------------------------------
def validate_kubernetes(resource: dict) -> None:
    """kubernetes-validate, strict, against every version in K8S_VERSIONS."""
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(resource, version, strict=True)


def strict(schema: dict) -> dict:
    """A CRD's openAPIV3Schema as the API server checks it with fieldValidation=Strict (what
    `kubectl apply` asks for): a field the schema does not name is an error."""
    schema = copy.deepcopy(schema)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def keda_validator() -> tuple[str, jsonschema.Validator]:
    """(apiVersion, validator) of the ScaledObject version KEDA's CRD stores."""
    crd = yaml.safe_load(KEDA_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["storage"]]
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # the API server's own ObjectMeta
    return f"{crd['spec']['group']}/{version['name']}", jsonschema.Draft7Validator(schema)


def validate_keda(resource: dict) -> None:
    api_version, validator = keda_validator()
    assert resource["apiVersion"] == api_version, resource["apiVersion"]
    validator.validate(resource)
    spec = resource["spec"]  # the CRD's one CEL rule, which jsonschema does not run
    assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
    for trigger in spec["triggers"]:  # what KEDA's scaler reads from the trigger's strings
        if trigger["type"] == "prometheus":
            keys = set(trigger["metadata"])
            assert PROMETHEUS_REQUIRED <= keys <= PROMETHEUS_KEYS, keys
            for key in ("threshold", "activationThreshold"):
                float(trigger["metadata"].get(key, "0"))  # ValueError if not a number


def validate(resource: dict) -> None:
    if resource["kind"] == "ScaledObject":
        validate_keda(resource)
    else:
        validate_kubernetes(resource)


def test_every_file_is_listed_and_renders_as_kubectl_kustomize_does(rendered):
    assert listed_files_are_complete(KUBE) == []
    assert set(rendered) == {
        ("Namespace", "inference-fabric"),
        ("ConfigMap", "fabric-config"),
        ("Service", "fabric-broker"),
        ("Service", "fabric-broker-headless"),
        ("StatefulSet", "fabric-broker"),
        ("Deployment", "fabric-worker-minilm"),
        ("ScaledObject", "fabric-worker-minilm"),
    }
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the rendering is not compared with kustomize's")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert by_kind([d for d in yaml.safe_load_all(out.stdout) if d]) == rendered


def test_a_manifest_file_left_out_of_the_kustomization_is_found(tmp_path):
    copied = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copied)
    (copied / "extra.yaml").write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
    assert listed_files_are_complete(copied) == ["extra.yaml"]


def test_every_manifest_validates_against_the_kubernetes_and_keda_schemas(rendered):
    for resource in rendered.values():
        validate(resource)


BROKEN = [
    ("a misspelt container field", ("StatefulSet", "fabric-broker"),
     "spec.template.spec.containers.0.imagee", "inference-fabric:0.1.0"),
    ("a string grace period", ("Deployment", "fabric-worker-minilm"),
     "spec.template.spec.terminationGracePeriodSeconds", "60"),
    ("a port that is not a number", ("Service", "fabric-broker"),
     "spec.ports.0.port", "ingest"),
    ("a probe without its port", ("StatefulSet", "fabric-broker"),
     "spec.template.spec.containers.0.readinessProbe.httpGet.port", None),
    ("a misspelt ScaledObject field", ("ScaledObject", "fabric-worker-minilm"),
     "spec.minReplicas", 0),
    ("a ScaledObject count that is not a number", ("ScaledObject", "fabric-worker-minilm"),
     "spec.maxReplicaCount", "eight"),
    ("a trigger without its type", ("ScaledObject", "fabric-worker-minilm"),
     "spec.triggers.0.type", None),
    ("a misspelt trigger key", ("ScaledObject", "fabric-worker-minilm"),
     "spec.triggers.0.metadata.activationTreshold", "0"),
    ("a threshold that is not a number", ("ScaledObject", "fabric-worker-minilm"),
     "spec.triggers.0.metadata.threshold", "one"),
    ("fewer replicas at most than at least", ("ScaledObject", "fabric-worker-minilm"),
     "spec.minReplicaCount", 9),
]  # fmt: skip


@pytest.mark.parametrize("what, key, path, value", BROKEN, ids=[case[0] for case in BROKEN])
def test_a_broken_copy_is_rejected_by_the_same_validation(rendered, what, key, path, value):
    broken = copy.deepcopy(rendered[key])
    *parents, last = path.split(".")
    node = broken
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    if value is None:
        del node[last]
    elif last.isdigit():
        node[int(last)] = value
    else:
        node[last] = value
    with pytest.raises((jsonschema.ValidationError, AssertionError, ValueError)):
        validate(broken)


# ---- what the manifests say, against the config and the command line -------------------
def pod_spec(resource: dict) -> dict:
    return resource["spec"]["template"]["spec"]


def container(resource: dict) -> dict:
    (only,) = pod_spec(resource)["containers"]
    return only


def config_file(rendered, tmp_path: Path) -> Path:
    path = tmp_path / "fabric.toml"
    path.write_text(rendered[("ConfigMap", "fabric-config")]["data"]["fabric.toml"])
    return path


def mount_of(resource: dict, path: str) -> tuple[dict, dict]:
    """(volumeMount, volume) of the container mount that holds file `path`."""
    mounts = [
        m for m in container(resource)["volumeMounts"]
        if path.startswith(m["mountPath"].rstrip("/") + "/")
    ]  # fmt: skip
    assert len(mounts) == 1, f"{path} is under {len(mounts)} mounts"
    return mounts[0], volume_of(resource, mounts[0])


def volume_of(resource: dict, mount: dict) -> dict:
    """The pod's volume a mount names, or {"claim": NAME} for a StatefulSet's claim."""
    claims = [t["metadata"]["name"] for t in resource["spec"].get("volumeClaimTemplates", [])]
    if mount["name"] in claims:
        return {"claim": mount["name"]}
    (volume,) = [v for v in pod_spec(resource)["volumes"] if v["name"] == mount["name"]]
    return volume


def image_command() -> tuple[list[str], list[str], str]:
    """(ENTRYPOINT, CMD, USER) of the Dockerfile's final stage."""
    entrypoint = cmd = user = None
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            entrypoint = cmd = user = None
        elif line.startswith("ENTRYPOINT "):
            entrypoint = json.loads(line.removeprefix("ENTRYPOINT "))
        elif line.startswith("CMD "):
            cmd = json.loads(line.removeprefix("CMD "))
        elif line.startswith("USER "):
            user = line.removeprefix("USER ").strip()
    assert entrypoint and cmd and user
    return entrypoint, cmd, user


def parse(argv: list[str]):
    """run.py's own parser on the arguments after the program's name (exit 2 if refused)."""
    import run

    return run.parse_args(argv)


def test_the_config_map_loads_and_binds_exactly_what_the_services_expose(rendered, tmp_path):
    settings = load_settings(config_file(rendered, tmp_path))
    binds = {b.setting: host_port(address) for b, address in bound(settings)}
    assert all(host == "0.0.0.0" for host, _ in binds.values()), binds
    ports = {port for _, port in binds.values()}
    broker = rendered[("StatefulSet", "fabric-broker")]
    exposed = {p["name"]: p["containerPort"] for p in container(broker)["ports"]}
    assert set(exposed.values()) == ports
    for name in ("fabric-broker", "fabric-broker-headless"):
        service = rendered[("Service", name)]
        assert (
            service["spec"]["selector"].items()
            <= broker["spec"]["template"]["metadata"]["labels"].items()
        )
        for port in service["spec"]["ports"]:
            assert exposed[port["targetPort"]] == port["port"], (name, port)
        assert {p["port"] for p in service["spec"]["ports"]} == ports
    assert broker["spec"]["serviceName"] == "fabric-broker-headless"
    assert broker["spec"]["replicas"] == 1  # one data dir, one broker

    # Nothing is exposed without authentication but the metrics port (probes, Prometheus).
    warnings = check_exposure(settings)
    assert len(warnings) == 1 and "metrics.bind" in warnings[0], warnings
    metrics_port = binds["metrics.bind"][1]
    annotations = broker["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)
    probes = {k: container(broker)[k]["httpGet"] for k in ("livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/live"
    assert probes["readinessProbe"]["path"] == "/ready"
    assert container(broker)["startupProbe"]["httpGet"]["path"] == "/live"
    assert all(exposed[p["port"]] == metrics_port for p in probes.values())

    # Every file the config names is where a volume puts it.
    assert mount_of(broker, str(settings.data_path / "x"))[1] == {"claim": "data"}
    secrets = {
        settings.security.server_key: "fabric-broker-key",
        settings.security.authorized_keys + "/worker.key": "fabric-authorized-keys",
        settings.api.keys_file: "fabric-api-keys",
    }
    for path, secret in secrets.items():
        assert mount_of(broker, path)[1]["secret"]["secretName"] == secret, path
    _, volume = mount_of(broker, "/etc/fabric/config/fabric.toml")
    assert volume["configMap"]["name"] == "fabric-config"
    _, cmd, _ = image_command()
    assert parse(container(broker)["args"]).config == "/etc/fabric/config/fabric.toml"
    assert parse(cmd).config == "/etc/fabric/config/fabric.toml"
    for model in settings.models:  # a tokenizer is in the image, at the checkout's path
        if model.tokenizer:
            assert model.tokenizer.startswith("/opt/inference-fabric/"), model.tokenizer
            assert (REPO / model.tokenizer.removeprefix("/opt/inference-fabric/")).is_file()

    # /dev/shm holds the rings; the grace period covers every stage's stop timeout in turn.
    _, shm = mount_of(broker, "/dev/shm/x")
    size = shm["emptyDir"]["sizeLimit"]
    assert shm["emptyDir"]["medium"] == "Memory" and size.endswith("Mi")
    assert int(size.removesuffix("Mi")) * 2**20 >= len(ring_specs(settings)) * RING_BYTES
    grace = pod_spec(broker)["terminationGracePeriodSeconds"]
    assert grace >= len(stage_specs(settings)) * settings.supervisor.stop_timeout_s


def test_each_model_has_workers_scaled_by_kedas_prometheus_trigger_on_its_demand(
    rendered, tmp_path
):
    settings = load_settings(config_file(rendered, tmp_path))
    dispatch, heartbeat = (
        host_port(settings.dispatch.bind),
        host_port(settings.dispatch.heartbeat_bind),
    )
    deployments = {k[1]: r for k, r in rendered.items() if k[0] == "Deployment"}
    scaled = {k[1]: r for k, r in rendered.items() if k[0] == "ScaledObject"}
    assert deployments and set(scaled) == set(deployments)
    served = set()
    for name, deployment in deployments.items():
        assert "replicas" not in deployment["spec"]  # KEDA's HPA owns it
        args = parse(container(deployment)["args"])
        assert args.command == "worker"
        settings.model(args.model)  # a model the broker serves (ConfigError if not)
        served.add(args.model)
        assert host_port(args.broker) == ("fabric-broker", dispatch[1])
        assert host_port(args.heartbeat) == ("fabric-broker", heartbeat[1])
        grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert grace >= args.drain_s + DRAIN_MARGIN_S, (grace, args.drain_s)
        for path in (args.key, args.server_key):
            assert mount_of(deployment, path)[1]["secret"]["secretName"] == "fabric-worker-key"

        so = scaled[name]["spec"]
        assert so["scaleTargetRef"]["name"] == name
        assert so["minReplicaCount"] == 0 and so["maxReplicaCount"] >= 1
        (trigger,) = so["triggers"]
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert re.fullmatch(
            rf'max\(fabric_workers_needed\{{model="{re.escape(args.model)}"\}}\)', meta["query"]
        ), meta["query"]
        assert float(meta["threshold"]) == 1.0  # replicas = ceil(workers needed / 1)
        assert float(meta["activationThreshold"]) == 0.0  # active above 0: from zero at once
        assert meta["serverAddress"].startswith("http")
    assert served == {m.name for m in settings.models}


def test_the_queries_name_the_demand_metric_as_the_catalogue_has_it(rendered):
    """The ScaledObjects' metric, checked against the broker's catalogue once it serves it
    (issue 32, item 1: built beside these manifests)."""
    from pipeline.telemetry.metric_catalogue import GAUGE, METRICS

    metric = METRICS.get("fabric_workers_needed")
    if metric is None:
        pytest.skip("fabric_workers_needed is not in pipeline/telemetry/metric_catalogue.py yet")
    assert (metric.kind, metric.labels) == (GAUGE, ("model",))
    for key, resource in rendered.items():
        if key[0] == "ScaledObject":
            (trigger,) = resource["spec"]["triggers"]
            assert "fabric_workers_needed{" in trigger["metadata"]["query"]


def test_the_image_runs_the_projects_own_install_as_the_pods_user(rendered):
    entrypoint, _, user = image_command()
    assert entrypoint == ["/usr/bin/tini", "--", "fabric"]  # Debian's tini; the console script
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["fabric"] == "run:main"
    uid, gid = (int(x) for x in user.split(":"))
    for key, resource in rendered.items():
        if key[0] in ("StatefulSet", "Deployment"):
            security = pod_spec(resource)["securityContext"]
            assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid), key
            assert "command" not in container(resource), "args only: the entrypoint stays"
            assert container(resource)["image"] == "inference-fabric:0.1.0"
    # The build context keeps what `pip install .` and the configs need.
    ignored = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    needed = ["pyproject.toml", "README.md", "run.py", "gpu/minilm/tokenizer.json"]
    needed += [p.replace(".", "/") + "/__init__.py" for p in pyproject["tool"]["setuptools"][
        "packages"
    ]]  # fmt: skip
    for path in needed:
        assert (REPO / path).is_file(), path
        hit = [p for p in ignored if fnmatch.fnmatch(path, p) or path.startswith(p + "/")]
        assert not hit, f".dockerignore {hit} leaves out {path}"


# ---- the Secrets, a broker from the ConfigMap and a worker from the Deployment ----------
def make_secrets(directory: Path) -> list[dict]:
    fabric = f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'run.py'))}"
    done = subprocess.run(
        [str(KUBE / "make-secrets.sh"), str(directory)],
        env={**os.environ, "FABRIC": fabric},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all((directory / "secrets.yaml").read_text()) if d]


def materialize(resource: dict, secrets: dict[str, dict], config: dict, root: Path) -> None:
    """Write the container's Secret and ConfigMap volumes under `root` as the kubelet would."""
    for mount in container(resource)["volumeMounts"]:
        volume = volume_of(resource, mount)
        target = root / mount["mountPath"].lstrip("/")
        if "secret" in volume:
            files = {
                k: base64.b64decode(v) for k, v in secrets[volume["secret"]["secretName"]].items()
            }
            mode = volume["secret"].get("defaultMode", 0o644)
        elif "configMap" in volume:
            files = {k: v.encode() for k, v in config.items()}
            mode = 0o644
        else:
            continue
        target.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (target / name).write_bytes(data)
            (target / name).chmod(mode)


def test_secrets_from_make_secrets_let_the_manifests_broker_and_worker_run_a_job(
    rendered, tmp_path
):
    made = make_secrets(tmp_path / "made")
    for secret in made:
        validate_kubernetes(secret)
    secrets = {s["metadata"]["name"]: s["data"] for s in made}
    assert set(secrets["fabric-authorized-keys"]) == {"client.key", "worker.key"}
    again = make_secrets(tmp_path / "made")  # a second run keeps the keys
    assert {s["metadata"]["name"]: s["data"] for s in again} == secrets

    root = tmp_path / "pod"
    broker_set = rendered[("StatefulSet", "fabric-broker")]
    worker_set = rendered[("Deployment", "fabric-worker-minilm")]
    config = rendered[("ConfigMap", "fabric-config")]["data"]
    materialize(broker_set, secrets, config, root / "broker")
    materialize(worker_set, secrets, config, root / "worker")

    # The ConfigMap's config, with the pod's paths under `root` and loopback ports.
    text = (root / "broker/etc/fabric/config/fabric.toml").read_text()
    settings = load_settings(root / "broker/etc/fabric/config/fabric.toml")
    replace = {
        '"/etc/fabric/': f'"{root}/broker/etc/fabric/',
        '"/var/lib/fabric/': f'"{tmp_path}/',
        '"/opt/inference-fabric/': f'"{REPO}/',
    }
    binds = [address for _, address in bound(settings)]
    ports = dict(zip(binds, free_ports(len(binds)), strict=True))
    for address, port in ports.items():
        host = "tcp://0.0.0.0:" if address.startswith("tcp://") else "0.0.0.0:"
        replace[f'"{address}"'] = f'"{host.replace("0.0.0.0", "127.0.0.1")}{port}"'
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "fabric.toml"
    path.write_text(text)
    broker = Broker(path)
    s = broker.settings
    worker_args = []
    for arg in container(worker_set)["args"]:  # the Deployment's, at the pod's paths
        flag, _, value = arg.partition("=")
        if flag in ("--key", "--server-key"):
            arg = f"{flag}={root}/worker{value}"
        elif flag == "--broker":
            arg = f"{flag}={s.dispatch.bind}"
        elif flag == "--heartbeat":
            arg = f"{flag}={s.dispatch.heartbeat_bind}"
        worker_args.append(arg)
    client = [
        *("--key", str(tmp_path / "made/keys/client.key_secret")),
        *("--server-key", str(tmp_path / "made/keys/broker.key")),
    ]
    lines = [
        {"custom_id": f"k{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "minilm", "input": f"sentence number {i} about kubernetes"}}
        for i in range(12)
    ]  # fmt: skip
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    broker.start()
    worker = None
    try:
        wait_for(lambda: probe(s.metrics.bind, "/ready") == (200, "ready\n"), "/ready")
        worker = zygote.Popen(
            [sys.executable, str(REPO / "run.py"), *worker_args],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        done = run_cli("submit", str(data), "--job-id", "k8s", "--broker", s.ingest.bind, *client)
        assert done.returncode == 0, done.stderr
        out = tmp_path / "out.jsonl"
        fetched = run_cli(
            "results", "k8s", "-o", str(out), "--follow", "--broker", s.completion.bind, *client
        )
        assert fetched.returncode == 0, fetched.stderr
        results = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted(r["custom_id"] for r in results) == sorted(x["custom_id"] for x in lines)
        vector = results[0]["response"]["body"]["data"][0]["embedding"]
        assert len(vector) == 384 and math.isfinite(sum(vector))

        # The API key from make-secrets.sh opens the HTTP API; no key does not.
        api_key = (tmp_path / "made/api-key").read_text()
        models = urllib.request.Request(
            f"http://{s.api.bind}/v1/models", headers={"Authorization": f"Bearer {api_key}"}
        )
        with urllib.request.urlopen(models, timeout=10) as answer:
            assert "minilm" in {m["id"] for m in json.load(answer)["data"]}
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://{s.api.bind}/v1/models", timeout=10)
        refused.value.close()
        assert refused.value.code == 401
    finally:
        if worker is not None:
            worker.terminate()  # SIGTERM, as the kubelet sends: it drains and exits 0
            _, err = worker.communicate(timeout=60)
            assert worker.returncode == 0, err
        broker.close()
