"""deploy/kubernetes renders with kustomize, validates against the Kubernetes OpenAPI schemas, and
gates the agent on the sidecar's rehydration.

* native (``deploy/kubernetes``, Kubernetes >= 1.29): the sidecar is an init container with
  ``restartPolicy: Always`` whose startupProbe is ``GET /readyz`` on the port of its
  ``SIDECAR_HTTP_ADDR``; the agent is a regular container (started only after that probe passed).
* legacy (``deploy/kubernetes/legacy``, older clusters): a ``restore`` init container (runs to
  completion) and the sidecar as a classic second container.

Schemas come from the ``kubernetes-validate`` package (bundled, offline), strict mode: unknown
fields are errors.
"""

from __future__ import annotations

import pytest

from .conftest import K8S_DIR, agent_workdir, env_of, image_uid, port_of

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
from kubernetes_validate import utils as kv  # noqa: E402

NATIVE_VERSIONS = ["1.29.0", "1.31.0", kv.latest_version()]
LEGACY_VERSIONS = ["1.27.0", "1.28.0", "1.29.0"]
STATE_DIRS = (".checkpoints", ".function_approvals")


@pytest.fixture(scope="module")
def native(kustomize) -> list[dict]:
    return kustomize(K8S_DIR)


@pytest.fixture(scope="module")
def legacy(kustomize) -> list[dict]:
    return kustomize(K8S_DIR / "legacy")


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def by_name(containers: list[dict], name: str) -> dict:
    found = [c for c in containers if c["name"] == name]
    assert len(found) == 1, f"no single container {name!r} in {[c['name'] for c in containers]}"
    return found[0]


def validate_all(docs: list[dict], version: str) -> None:
    for doc in docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {path}: {e.message}") from e


@pytest.mark.parametrize("version", NATIVE_VERSIONS)
def test_native_validates(native, version):
    validate_all(native, version)


@pytest.mark.parametrize("version", LEGACY_VERSIONS)
def test_legacy_validates(legacy, version):
    validate_all(legacy, version)


def test_native_is_rejected_before_129(native):
    """Why the legacy variant exists: older API servers do not know initContainers[].restartPolicy."""
    with pytest.raises(kv.ValidationError, match="restartPolicy"):
        kv.validate(one(native, "Deployment"), "1.27.0", strict=True)


def check_sidecar_env_and_mounts(sidecar: dict, agent: dict, pod: dict, config: dict) -> None:
    workdir = agent_workdir()
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts_agent = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    mounts_sidecar = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    for d in STATE_DIRS:
        path = f"{workdir}/{d}"
        assert path in mounts_agent, f"agent does not mount {path}"
        assert mounts_sidecar.get(path) == mounts_agent[path], f"{path}: sidecar and agent mount different volumes"
        assert "emptyDir" in volumes[mounts_agent[path]], f"{path} is not an emptyDir"
        assert not any("subPath" in m for m in agent["volumeMounts"] + sidecar["volumeMounts"])
    # The store comes from the generated ConfigMap; credentials never appear in the manifests.
    assert [r["configMapRef"]["name"] for r in sidecar.get("envFrom", [])] == [config["metadata"]["name"]]
    assert config["data"]["SIDECAR_STORE"].startswith("https://")
    assert config["data"]["SIDECAR_PREFIX"]


def check_identity_and_security(docs: list[dict]) -> None:
    sa, deployment = one(docs, "ServiceAccount"), one(docs, "Deployment")
    pod_meta, pod = deployment["spec"]["template"]["metadata"], deployment["spec"]["template"]["spec"]
    assert sa["metadata"]["annotations"].get("azure.workload.identity/client-id")
    assert pod_meta["labels"].get("azure.workload.identity/use") == "true"
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    text = repr(docs)
    for secret_marker in ("AccountKey=", "SharedAccessSignature", "sig=", "AZURE_STORAGE_CONNECTION_STRING",
                          "AZURE_STORAGE_KEY", "secretKeyRef"):
        assert secret_marker not in text, f"{secret_marker} in the manifests"
    uid = image_uid()
    ctx = pod["securityContext"]
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"], ctx["runAsNonRoot"]) == (uid, uid, uid, True)
    # One writer per prefix; the old pod flushes before the new one restores.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def check_resources(sidecar: dict) -> None:
    res = sidecar["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]


def test_native_sidecar_gates_the_agent(native):
    deployment = one(native, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    sidecar = by_name(pod["initContainers"], "checkpoint-sidecar")
    assert pod["initContainers"][0] is sidecar, "the sidecar must be the first init container"
    assert sidecar.get("restartPolicy") == "Always", "a native sidecar is an init container with restartPolicy Always"
    assert sidecar["args"] == ["sync"]
    env = env_of(sidecar)
    port = port_of(env["SIDECAR_HTTP_ADDR"])
    assert env["SIDECAR_HTTP_ADDR"].startswith("0.0.0.0:"), "kubelet probes the pod IP, not loopback"
    probe = sidecar["startupProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/readyz", port)
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port}
    assert sidecar["readinessProbe"]["httpGet"]["port"] == port
    # A startup window long enough for a big restore.
    sp = sidecar["startupProbe"]
    assert sp["periodSeconds"] * sp["failureThreshold"] >= 120

    agent = by_name(pod["containers"], "agent")
    assert [c["name"] for c in pod["containers"]] == ["agent"], "the sidecar must not be a regular container here"
    assert agent["command"] == ["python", "app.py"], "the agent runs directly, not under the in-process wrapper"
    check_sidecar_env_and_mounts(sidecar, agent, pod, one(native, "ConfigMap"))
    check_identity_and_security(native)
    check_resources(sidecar)
    # The final flush fits in the grace period (native sidecars stop after the agent).
    assert pod["terminationGracePeriodSeconds"] > float(env["SIDECAR_DRAIN_TIMEOUT"]) + 10


def test_legacy_restore_init_then_classic_sidecar(legacy):
    pod = one(legacy, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["restore"]
    restore = pod["initContainers"][0]
    assert restore["args"] == ["restore"] and "restartPolicy" not in restore
    assert not any(k in restore for k in ("startupProbe", "readinessProbe", "livenessProbe"))

    assert [c["name"] for c in pod["containers"]] == ["agent", "checkpoint-sidecar"]
    agent, sidecar = pod["containers"]
    assert agent["command"] == ["python", "app.py"]
    assert sidecar["args"] == ["sync"]
    env = env_of(sidecar)
    port = port_of(env["SIDECAR_HTTP_ADDR"])
    assert env.get("SIDECAR_RESTORE") == "skip", "restore already ran as the init container"
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port}
    config = one(legacy, "ConfigMap")
    check_sidecar_env_and_mounts(sidecar, agent, pod, config)
    check_sidecar_env_and_mounts(restore, agent, pod, config)
    check_identity_and_security(legacy)
    check_resources(sidecar)
    check_resources(restore)
    # Classic sidecars get SIGTERM with the agent: preStop delays it, the grace period covers both.
    pre_stop = sidecar["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + float(env["SIDECAR_DRAIN_TIMEOUT"])


def test_variants_share_everything_else(native, legacy):
    """The legacy overlay changes only where the sidecar runs: same agent, volumes, identity, config."""
    n, l_ = one(native, "Deployment"), one(legacy, "Deployment")
    pn, pl = n["spec"]["template"]["spec"], l_["spec"]["template"]["spec"]
    assert pn["volumes"] == pl["volumes"]
    assert by_name(pn["containers"], "agent") == by_name(pl["containers"], "agent")
    native_sidecar = dict(by_name(pn["initContainers"], "checkpoint-sidecar"))
    legacy_sidecar = by_name(pl["containers"], "checkpoint-sidecar")
    for key in ("image", "envFrom", "volumeMounts", "resources", "securityContext", "ports"):
        assert native_sidecar[key] == legacy_sidecar[key], key
    assert {k: v for k, v in env_of(native_sidecar).items()} == {
        k: v for k, v in env_of(legacy_sidecar).items() if k != "SIDECAR_RESTORE"
    }
    for kind in ("ServiceAccount", "ConfigMap"):
        assert one(native, kind) == one(legacy, kind)


@pytest.fixture(scope="module")
def statefulset(kustomize) -> list[dict]:
    return kustomize(K8S_DIR / "statefulset")


@pytest.mark.parametrize("version", NATIVE_VERSIONS)
def test_statefulset_validates(statefulset, version):
    validate_all(statefulset, version)


def test_statefulset_gives_each_replica_its_own_namespace(statefulset, native):
    """N replicas of one pod template: each pod's namespace comes from its name (downward API),
    expanded by the sidecar, and is stable when the pod is recreated."""
    from sidecar.namespace import resolve

    assert not [d for d in statefulset if d["kind"] == "Deployment"]
    sts, service = one(statefulset, "StatefulSet"), one(statefulset, "Service")
    assert sts["spec"]["replicas"] > 1 and sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    pod = sts["spec"]["template"]["spec"]
    sidecar = by_name(pod["initContainers"], "checkpoint-sidecar")
    pod_name = [e for e in sidecar["env"] if e["name"] == "POD_NAME"]
    assert pod_name == [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    prefix = one(statefulset, "ConfigMap")["data"]["SIDECAR_PREFIX"]
    assert "{POD_NAME}" in prefix
    names = {resolve(prefix, {"POD_NAME": f"{sts['metadata']['name']}-{n}"}).path for n in range(3)}
    assert len(names) == 3
    # the same pod as the single-replica Deployment, but for POD_NAME
    deployment_pod = one(native, "Deployment")["spec"]["template"]
    template = sts["spec"]["template"]
    # the generated ConfigMaps differ in SIDECAR_PREFIX, and so in their names' hash
    deployment_sidecar = by_name(deployment_pod["spec"]["initContainers"], "checkpoint-sidecar")
    stripped = dict(sidecar, env=[e for e in sidecar["env"] if e["name"] != "POD_NAME"],
                    envFrom=deployment_sidecar["envFrom"])
    assert dict(template, spec=dict(pod, initContainers=[stripped, *pod["initContainers"][1:]])) == deployment_pod
    check_sidecar_env_and_mounts(sidecar, by_name(pod["containers"], "agent"), pod, one(statefulset, "ConfigMap"))


def _host_shutdown_limit(agent: dict) -> float:
    """The newest host's longest stop after SIGTERM (docs/DEPLOY.md#the-shutdown-budget): open
    requests, then its shutdown handlers, each up to AGENTSERVER_GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS,
    then resilient tasks up to AGENTSERVER_SHUTDOWN_GRACE_SECONDS."""
    env = env_of(agent)
    return (2 * float(env["AGENTSERVER_GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS"])
            + float(env["AGENTSERVER_SHUTDOWN_GRACE_SECONDS"]))


def test_shutdown_budget(native, legacy, statefulset):
    """The agent stops within its limits, then the sidecar flushes within SIDECAR_DRAIN_TIMEOUT:
    both fit in the grace period. A classic sidecar's preStop waits out the agent's limit."""
    for docs, kind in ((native, "Deployment"), (statefulset, "StatefulSet")):
        pod = one(docs, kind)["spec"]["template"]["spec"]
        sidecar = by_name(pod["initContainers"], "checkpoint-sidecar")
        host = _host_shutdown_limit(by_name(pod["containers"], "agent"))
        drain = float(env_of(sidecar)["SIDECAR_DRAIN_TIMEOUT"])
        assert host + drain + 10 <= pod["terminationGracePeriodSeconds"], kind
    pod = one(legacy, "Deployment")["spec"]["template"]["spec"]
    sidecar = by_name(pod["containers"], "checkpoint-sidecar")
    pre_stop = float(sidecar["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pre_stop >= _host_shutdown_limit(by_name(pod["containers"], "agent"))
    assert pre_stop + float(env_of(sidecar)["SIDECAR_DRAIN_TIMEOUT"]) + 10 <= pod["terminationGracePeriodSeconds"]


def test_pods_get_no_service_links(native, legacy, statefulset):
    """kubelet puts <SERVICE>_SERVICE_HOST, <SERVICE>_PORT_... of every Service in the namespace
    into each container unless the pod opts out; a Service named ``sidecar`` gives SIDECAR_*
    variables (not settings: the sidecar ignores their shapes, and the pods opt out)."""
    for docs, kind in ((native, "Deployment"), (legacy, "Deployment"), (statefulset, "StatefulSet")):
        assert one(docs, kind)["spec"]["template"]["spec"]["enableServiceLinks"] is False, kind
