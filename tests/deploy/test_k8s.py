"""The Kubernetes manifests: every overlay renders with kustomize, every object is valid
against the Kubernetes schemas (offline), and what the pods need is there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
HELM_VALUES = K8S / "overlays" / "in-cluster-nats" / "nats-values.yaml"
# The oldest Kubernetes the manifests promise to fit (runtimeClassName, restricted PSA).
KUBERNETES = "1.29.0"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed (it carries kustomize)"
)
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    """Each overlay's objects, as `kubectl kustomize` renders them."""
    out = {}
    for overlay in OVERLAYS:
        done = subprocess.run(
            [KUBECTL or "", "kustomize", str(K8S / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        out[overlay] = [d for d in yaml.safe_load_all(done.stdout) if d]
    return out


def named(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_specs(objs: list[Obj]) -> dict[str, Obj]:
    """Pod spec of every workload, by workload name."""
    kinds = ("Deployment", "DaemonSet", "StatefulSet")
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs if o["kind"] in kinds
    }


def containers(spec: Obj) -> list[Obj]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_overlays_exist() -> None:
    assert {"in-cluster-nats", "existing-nats"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid(overlay: str, rendered: dict[str, list[Obj]]) -> None:
    import kubernetes_validate

    kinds = set()
    for obj in rendered[overlay]:
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
        kinds.add(obj["kind"])
    expected = {"Deployment", "DaemonSet", "ServiceAccount", "ConfigMap", "Secret", "Service"}
    assert expected <= kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(overlay: str, rendered: dict[str, list[Obj]]) -> None:
    """Every ConfigMap, Secret and ServiceAccount a pod names is rendered (or optional)."""
    objs = rendered[overlay]
    have = {kind: set(named(objs, kind)) for kind in ("ConfigMap", "Secret", "ServiceAccount")}
    for name, spec in pod_specs(objs).items():
        assert spec["serviceAccountName"] in have["ServiceAccount"], name
        wanted = []
        for vol in spec["volumes"]:
            if "configMap" in vol:
                wanted.append(("ConfigMap", vol["configMap"]))
            if "secret" in vol:
                wanted.append(("Secret", {"name": vol["secret"]["secretName"], **vol["secret"]}))
        for c in containers(spec):
            for src in c.get("envFrom", []):
                ref = src.get("configMapRef") or src["secretRef"]
                wanted.append(("ConfigMap" if "configMapRef" in src else "Secret", ref))
        for kind, ref in wanted:
            assert ref.get("optional") or ref["name"] in have[kind], f"{name}: {kind} {ref}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_non_root_with_read_only_roots(
    overlay: str, rendered: dict[str, list[Obj]]
) -> None:
    for name, spec in pod_specs(rendered[overlay]).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["automountServiceAccountToken"] is False, name
        for c in containers(spec):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert {"requests", "limits"} <= set(c["resources"]), (name, c["name"])


def test_agent_runs_on_every_gpu_node(rendered: dict[str, list[Obj]]) -> None:
    spec = pod_specs(rendered["in-cluster-nats"])["gpuops-agent"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["runtimeClassName"] == "nvidia"
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"])
    (agent,) = spec["containers"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert agent["args"][:3] == ["agent", "--node", "$(NODE_NAME)"]
    # Seeing the GPUs must not take them from the workloads.
    assert not any("nvidia.com/gpu" in str(v) for v in agent["resources"].values())
    # On a site's NATS the agent is the `source` role's user (no shared `agent` user is
    # left) and proves which node it is with its own publisher key from the host.
    refs = [src["secretRef"]["name"] for src in agent["envFrom"] if "secretRef" in src]
    assert refs == ["gpuops-nats-source"]
    secret = named(rendered["in-cluster-nats"], "Secret")["gpuops-nats-source"]
    assert secret["stringData"]["GPUOPS_NATS__USER"] == "source"
    assert "gpuops-nats-agent" not in named(rendered["in-cluster-nats"], "Secret")
    key = env["GPUOPS_IDENTITY__PUBLISHER_KEY"]["value"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts[key]["readOnly"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts[key]["name"]]["hostPath"] == {"path": key, "type": "File"}


def settings_of(objs: list[Obj]) -> Obj:
    (cm,) = [c for n, c in named(objs, "ConfigMap").items() if n.startswith("gpuops-settings")]
    settings: Obj = yaml.safe_load(cm["data"]["gpuops.yml"])
    return settings


def env_of(objs: list[Obj]) -> dict[str, str]:
    (cm,) = [c for n, c in named(objs, "ConfigMap").items() if n.startswith("gpuops-env")]
    return dict(cm["data"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_and_executor_probe_the_health_endpoint(
    overlay: str, rendered: dict[str, list[Obj]]
) -> None:
    objs = rendered[overlay]
    port = int(settings_of(objs)["http"].rpartition(":")[2])
    for name in ("gpuops-engine", "gpuops-executor"):
        (c,) = pod_specs(objs)[name]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == port
        assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert c["livenessProbe"]["httpGet"]["port"] == "http"


def test_settings_are_valid_gpuops_settings(rendered: dict[str, list[Obj]]) -> None:
    from gpuops.settings import load_settings

    for overlay, objs in rendered.items():
        settings = settings_of(objs)
        environ = {**env_of(objs), "GPUOPS_NATS__USER": "engine"}
        loaded = load_settings(None, settings, environ)
        assert loaded.nats.url == env_of(objs)["GPUOPS_NATS__URL"], overlay
        assert loaded.dry_run is True, "a first deployment decides and records, nothing runs"


Labels = dict[str, str]
PROMETHEUS = (
    {"kubernetes.io/metadata.name": "monitoring"},
    {"app.kubernetes.io/name": "prometheus"},
)
INGRESS = (
    {"kubernetes.io/metadata.name": "ingress-nginx"},
    {"app.kubernetes.io/name": "ingress-nginx"},
)


def _selects(selector: Obj, labels: Labels) -> bool:
    assert set(selector) <= {"matchLabels"}, "the reader below knows matchLabels only"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admitted(objs: list[Obj], pod: Labels, peer: tuple[Labels, Labels], port: int) -> bool:
    """Whether the NetworkPolicies let a pod labelled peer[1], in a namespace labelled
    peer[0], connect to `port` of a gpuops pod labelled `pod` (the API's semantics,
    for matchLabels selectors)."""
    namespace = {"kubernetes.io/metadata.name": "gpuops"}
    policies = [o["spec"] for o in objs if o["kind"] == "NetworkPolicy"]
    applying = [p for p in policies if _selects(p["podSelector"], pod)]
    assert applying, f"no NetworkPolicy isolates {pod}"
    for rule in (r for p in applying for r in p.get("ingress", [])):
        ports = {x["port"] for x in rule.get("ports", [])}
        if ports and port not in ports:
            continue
        peers = rule.get("from")
        if not peers:
            return True  # a rule with no `from` admits everyone
        for source in peers:
            ns_ok = (
                _selects(source["namespaceSelector"], peer[0])
                if "namespaceSelector" in source
                else peer[0] == namespace
            )
            if ns_ok and _selects(source.get("podSelector", {}), peer[1]):
                return True
    return False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_http_is_open_to_prometheus_and_the_ingress_controller_only(
    overlay: str, rendered: dict[str, list[Obj]]
) -> None:
    objs = rendered[overlay]
    engine = {"app.kubernetes.io/name": "gpuops-engine", "app.kubernetes.io/part-of": "gpuops"}
    executor = {"app.kubernetes.io/name": "gpuops-executor", "app.kubernetes.io/part-of": "gpuops"}
    assert admitted(objs, engine, PROMETHEUS, 8080) and admitted(objs, engine, INGRESS, 8080)
    assert admitted(objs, executor, PROMETHEUS, 8080)
    assert not admitted(objs, executor, INGRESS, 8080), "executors serve no ChatOps"
    strangers = [
        ({"kubernetes.io/metadata.name": "gpuops"}, {"app.kubernetes.io/name": "gpuops-agent"}),
        ({"kubernetes.io/metadata.name": "default"}, {"app": "anything"}),
        (INGRESS[0], {"app.kubernetes.io/name": "some-other-pod"}),
        (PROMETHEUS[0], {"app.kubernetes.io/name": "grafana"}),
    ]
    for peer in strangers:
        assert not admitted(objs, engine, peer, 8080), peer
        assert not admitted(objs, executor, peer, 8080), peer


def test_existing_nats_overlay_trusts_its_ca(rendered: dict[str, list[Obj]]) -> None:
    objs = rendered["existing-nats"]
    env = env_of(objs)
    assert env["GPUOPS_NATS__URL"].startswith("tls://")
    assert env["GPUOPS_NATS__URL"] != env_of(rendered["in-cluster-nats"])["GPUOPS_NATS__URL"]
    ca_dir = str(Path(env["GPUOPS_NATS__TLS_CA"]).parent)
    for name, spec in pod_specs(objs).items():
        mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert ca_dir in mounts, name


def test_executor_has_keys_and_playbooks(rendered: dict[str, list[Obj]]) -> None:
    spec = pod_specs(rendered["in-cluster-nats"])["gpuops-executor"]
    (c,) = spec["containers"]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/etc/gpuops/ssh", "/etc/gpuops/keys", "/etc/gpuops/inventory"} <= mounts
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ANSIBLE_PRIVATE_KEY_FILE"].startswith("/etc/gpuops/ssh/")
    sources = {v["name"]: v for v in spec["volumes"]}
    assert sources["site-playbooks"]["configMap"]["name"].startswith("gpuops-playbooks-")
    assert sources["signing-key"]["secret"]["secretName"] == "gpuops-signing-key"


def test_placeholder_signing_key_is_refused(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    """A forgotten placeholder must stop gpuops, not sign with a key everyone knows."""
    from gpuops.errors import ConfigError
    from gpuops.signing import load_key

    secret = named(rendered["in-cluster-nats"], "Secret")["gpuops-signing-key"]
    key = tmp_path / "intent.key"
    key.write_text(secret["stringData"]["intent.key"])
    with pytest.raises(ConfigError, match="too short"):
        load_key(key)


def test_helm_values_read_the_rendered_secrets(rendered: dict[str, list[Obj]]) -> None:
    values = yaml.safe_load(HELM_VALUES.read_text())
    secrets = named(rendered["in-cluster-nats"], "Secret")
    env = values["container"]["env"]
    users = values["config"]["merge"]["authorization"]["users"]
    for user in users:
        var = user["password"].strip("<> $")
        ref = env[var]["valueFrom"]["secretKeyRef"]
        data = secrets[ref["name"]]["stringData"]
        assert ref["key"] in data
        assert data["GPUOPS_NATS__USER"] == user["user"]


SITE_KUSTOMIZATION = """\
resources: [gpuops/k8s/overlays/in-cluster-nats]
configMapGenerator:
  - {name: gpuops-rules, behavior: merge, files: [rules/xid.yml]}
  - {name: gpuops-playbooks, behavior: merge, files: [playbooks/catalog.yml, playbooks/drain.yml]}
  - {name: gpuops-playbook-tasks, behavior: merge, files: [playbooks/tasks/drain.yml]}
"""


def site_repository(tmp_path: Path) -> Path:
    """A site repository as docs/deploy.md lays it out, with its overlay at the top."""
    site = tmp_path / "site"
    for name in ("rules/xid.yml", "playbooks/catalog.yml", "playbooks/drain.yml"):
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, site / name)
    (site / "playbooks" / "tasks").mkdir()
    shutil.copy(ROOT / "playbooks/tasks/drain.yml", site / "playbooks/tasks/drain.yml")
    shutil.copytree(K8S, site / "gpuops" / "k8s")
    (site / "kustomization.yaml").write_text(SITE_KUSTOMIZATION)
    return site


def mount_like_kubelet(cm: Obj, folder: Path) -> None:
    """A ConfigMap volume as the kubelet writes it: files behind `..data` symlinks."""
    stamp = folder / "..2026_01_01_00_00_00.1"
    stamp.mkdir(parents=True)
    (folder / "..data").symlink_to(stamp.name)
    for key, text in (cm.get("data") or {}).items():
        (stamp / key).write_text(text)
        (folder / key).symlink_to(f"..data/{key}")


def run_site_init(objs: list[Obj], tmp_path: Path) -> Path:
    """The executor's `site` init container's script, on its ConfigMaps; its workdir."""
    spec = pod_specs(objs)["gpuops-executor"]
    (init,) = spec["initContainers"]
    maps = named(objs, "ConfigMap")
    mounts = {v["name"]: v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
    for mount in init["volumeMounts"]:
        if mount["name"] in mounts:
            folder = tmp_path / mount["mountPath"].lstrip("/")
            mount_like_kubelet(maps[mounts[mount["name"]]], folder)
    work = tmp_path / init["workingDir"].lstrip("/")
    work.mkdir(parents=True)
    script = init["args"][0].replace("/site/", f"{tmp_path}/site/")
    done = subprocess.run([*init["command"], script], cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return work


def test_site_overlay_brings_its_rules_and_playbooks(tmp_path: Path) -> None:
    done = subprocess.run(
        [KUBECTL or "", "kustomize", str(site_repository(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    objs = [d for d in yaml.safe_load_all(done.stdout) if d]
    work = run_site_init(objs, tmp_path / "pod")
    copied = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
    assert copied == [
        "playbooks/catalog.yml",
        "playbooks/drain.yml",
        "playbooks/tasks/drain.yml",
        "rules/xid.yml",
    ]
    assert (work / "rules/xid.yml").read_text() == (ROOT / "rules/xid.yml").read_text()


def test_without_site_content_the_shipped_copies_are_used(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """Empty ConfigMaps leave no empty rules/ or playbooks/ to hide the shipped ones."""
    work = run_site_init(rendered["in-cluster-nats"], tmp_path)
    assert list(work.iterdir()) == []
