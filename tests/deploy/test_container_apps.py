"""deploy/azure-container-apps/containerapp.yaml, checked offline against what
``az containerapp create --yaml`` accepts.

The CLI loads the file with ``yaml.safe_load``, moves ``template``/``configuration``/
``environmentId``/... under ``properties`` when they sit at the top, and deserializes the result
into the SDK's ``ContainerApp`` model. That deserializer silently drops every field the model does
not know, so a misspelt key would deploy as "not set". Here the same normalisation runs, and a JSON
schema transcribed from the Microsoft.App/containerApps resource (API 2024-03-01) for the objects
this file uses rejects unknown keys (``additionalProperties: false``) and wrong types. Then the
platform's own rules: init containers take no probes, resource totals are one of the allowed
CPU/memory pairs, volume mounts name declared volumes, the grace period covers the final flush.
``containerapp-run.yaml``, the variant for every environment type (one container under the
``run`` wrapper), gets the same schema check and its own rules.
"""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from .conftest import ACA_FILE, REPO, agent_workdir, dockerfile_value, port_of

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

# -- the subset of the ARM schema this file uses ------------------------------------------------

_STR = {"type": "string"}
_INT = {"type": "integer"}
_ENV_VAR = {"type": "object", "additionalProperties": False, "required": ["name"],
            "properties": {"name": _STR, "value": _STR, "secretRef": _STR}}
_RESOURCES = {"type": "object", "additionalProperties": False,
              "properties": {"cpu": {"type": "number"}, "memory": {"type": "string", "pattern": r"^\d+(\.\d{1,2})?Gi$"},
                             "ephemeralStorage": _STR}}
_VOLUME_MOUNT = {"type": "object", "additionalProperties": False, "required": ["volumeName", "mountPath"],
                 "properties": {"volumeName": _STR, "mountPath": _STR, "subPath": _STR}}
_HTTP_GET = {"type": "object", "additionalProperties": False, "required": ["port"],
             "properties": {"path": _STR, "port": _INT, "host": _STR, "scheme": {"enum": ["HTTP", "HTTPS"]},
                            "httpHeaders": {"type": "array"}}}
_PROBE = {"type": "object", "additionalProperties": False, "required": ["type"],
          "properties": {"type": {"enum": ["Liveness", "Readiness", "Startup"]}, "httpGet": _HTTP_GET,
                         "tcpSocket": {"type": "object"}, "initialDelaySeconds": _INT, "periodSeconds": _INT,
                         "timeoutSeconds": _INT, "failureThreshold": _INT, "successThreshold": _INT,
                         "terminationGracePeriodSeconds": _INT}}
_BASE_CONTAINER = {"image": _STR, "name": _STR, "command": {"type": "array", "items": _STR},
                   "args": {"type": "array", "items": _STR}, "env": {"type": "array", "items": _ENV_VAR},
                   "resources": _RESOURCES, "volumeMounts": {"type": "array", "items": _VOLUME_MOUNT}}
_INIT_CONTAINER = {"type": "object", "additionalProperties": False, "required": ["name", "image"],
                   "properties": _BASE_CONTAINER}
_CONTAINER = {"type": "object", "additionalProperties": False, "required": ["name", "image"],
              "properties": {**_BASE_CONTAINER, "probes": {"type": "array", "items": _PROBE}}}
_VOLUME = {"type": "object", "additionalProperties": False, "required": ["name", "storageType"],
           "properties": {"name": _STR, "storageType": {"enum": ["AzureFile", "EmptyDir", "Secret", "NfsAzureFile"]},
                          "storageName": _STR, "secrets": {"type": "array"}, "mountOptions": _STR}}
_TEMPLATE = {"type": "object", "additionalProperties": False, "required": ["containers"],
             "properties": {"revisionSuffix": _STR, "terminationGracePeriodSeconds": _INT,
                            "initContainers": {"type": "array", "items": _INIT_CONTAINER},
                            "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
                            "scale": {"type": "object", "additionalProperties": False,
                                      "properties": {"minReplicas": _INT, "maxReplicas": _INT, "rules": {"type": "array"}}},
                            "volumes": {"type": "array", "items": _VOLUME},
                            "serviceBinds": {"type": "array"}}}
_CONFIGURATION = {"type": "object", "additionalProperties": False,
                  "properties": {"secrets": {"type": "array"},
                                 "activeRevisionsMode": {"enum": ["Single", "Multiple"]},
                                 "ingress": {"type": "object", "additionalProperties": False,
                                             "properties": {"external": {"type": "boolean"}, "targetPort": _INT,
                                                            "exposedPort": _INT,
                                                            "transport": {"enum": ["auto", "http", "http2", "tcp"]},
                                                            "allowInsecure": {"type": "boolean"},
                                                            "traffic": {"type": "array"}}},
                                 "registries": {"type": "array", "items": {
                                     "type": "object", "additionalProperties": False, "required": ["server"],
                                     "properties": {"server": _STR, "identity": _STR, "username": _STR,
                                                    "passwordSecretRef": _STR}}},
                                 "dapr": {"type": "object"}, "maxInactiveRevisions": _INT}}
_RESOURCE_ID = r"^/subscriptions/[^/]+/resourceGroups/[^/]+/providers/"
CONTAINER_APP_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["properties"],
    "properties": {
        "type": {"enum": ["Microsoft.App/containerApps"]}, "name": _STR, "location": _STR, "tags": {"type": "object"},
        "kind": _STR,
        "identity": {"type": "object", "additionalProperties": False, "required": ["type"],
                     "properties": {"type": {"enum": ["None", "SystemAssigned", "UserAssigned",
                                                      "SystemAssigned,UserAssigned"]},
                                    "userAssignedIdentities": {"type": "object", "additionalProperties": {
                                        "type": "object", "maxProperties": 0}}}},
        "properties": {"type": "object", "additionalProperties": False, "required": ["environmentId", "template"],
                       "properties": {"environmentId": {"type": "string",
                                                        "pattern": _RESOURCE_ID + "Microsoft.App/managedEnvironments/"},
                                      "workloadProfileName": _STR, "configuration": _CONFIGURATION,
                                      "template": _TEMPLATE}},
    },
}

# Consumption plan: the CPU/memory totals a replica may request.
ALLOWED_TOTALS = {(round(0.25 * i, 2), f"{0.5 * i:g}Gi") for i in range(1, 17)}
MAX_GRACE_SECONDS = 600

# The nested properties `az containerapp create --yaml` moves under "properties" (process_loaded_yaml).
_NESTED = ("provisioningState", "managedEnvironmentId", "environmentId", "latestRevisionName", "latestRevisionFqdn",
           "customDomainVerificationId", "configuration", "template", "outboundIPAddresses", "workloadProfileName",
           "latestReadyRevisionName", "eventStreamEndpoint", "runningStatus")


def as_az_sees_it(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    assert isinstance(doc, dict), "the YAML must be a mapping"
    props = doc.setdefault("properties", {}) or {}
    doc["properties"] = props
    for key in _NESTED:
        if key in doc:
            props[key] = doc.pop(key)
    if "managedEnvironmentId" in props:
        value = props.pop("managedEnvironmentId")
        if value:
            props["environmentId"] = value
    return doc


@pytest.fixture(scope="module")
def app() -> dict:
    with open(ACA_FILE) as f:
        return as_az_sees_it(yaml.safe_load(f.read().replace("\x00", "")))


@pytest.fixture(scope="module")
def template(app) -> dict:
    return app["properties"]["template"]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def by_name(containers: list[dict], name: str) -> dict:
    (found,) = [c for c in containers if c["name"] == name]
    return found


def test_schema(app):
    errors = sorted(jsonschema.Draft202012Validator(CONTAINER_APP_SCHEMA).iter_errors(app), key=str)
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_schema_catches_unknown_fields(app):
    """The check is not vacuous: a misspelt key (which az would drop silently) fails it."""
    bad = copy.deepcopy(app)
    bad["properties"]["template"]["containers"][0]["volumeMount"] = []
    assert list(jsonschema.Draft202012Validator(CONTAINER_APP_SCHEMA).iter_errors(bad))


def test_restore_init_container_gates_the_app_containers(template):
    (restore,) = template["initContainers"]
    assert restore["name"] == "restore" and restore["args"] == ["restore"]
    assert "probes" not in restore, "init containers take no probes in Container Apps"
    names = [c["name"] for c in template["containers"]]
    assert names == ["agent", "checkpoint-sidecar"]
    agent = by_name(template["containers"], "agent")
    assert agent["command"] == ["python", "app.py"], "the agent runs directly, not under the in-process wrapper"


def test_sidecar_sync_and_probes(template):
    sidecar = by_name(template["containers"], "checkpoint-sidecar")
    assert sidecar["args"] == ["sync"]
    env = env_of(sidecar)
    port = port_of(env["SIDECAR_HTTP_ADDR"])
    assert env["SIDECAR_HTTP_ADDR"].startswith("0.0.0.0:")
    assert env.get("SIDECAR_RESTORE") == "skip", "restore already ran as the init container"
    probes = {p["type"]: p["httpGet"] for p in sidecar["probes"]}
    assert probes["Readiness"] == {"path": "/readyz", "port": port}
    assert probes["Liveness"] == {"path": "/livez", "port": port}


def test_shared_empty_dir_volumes(template):
    volumes = {v["name"]: v for v in template["volumes"]}
    assert all(v["storageType"] == "EmptyDir" for v in volumes.values())
    workdir = agent_workdir()
    everyone = template["initContainers"] + template["containers"]
    for c in everyone:
        for m in c.get("volumeMounts", []):
            assert m["volumeName"] in volumes, f"{c['name']} mounts undeclared volume {m['volumeName']}"
    for d in (".checkpoints", ".function_approvals"):
        path = f"{workdir}/{d}"
        mounted = {c["name"]: {m["mountPath"]: m["volumeName"] for m in c["volumeMounts"]}.get(path) for c in everyone}
        assert len(set(mounted.values())) == 1 and None not in mounted.values(), f"{path}: {mounted}"


def test_identity_and_no_secrets(app, template):
    identity = app["identity"]
    assert identity["type"] == "UserAssigned"
    (identity_id,) = identity["userAssignedIdentities"]
    assert re.match(r"^/subscriptions/.+/providers/Microsoft\.ManagedIdentity/userAssignedIdentities/", identity_id)
    for reg in app["properties"]["configuration"].get("registries", []):
        assert reg["identity"] == identity_id, "pull images with the same identity (no registry password)"
    store_env = None
    for name in ("restore", "checkpoint-sidecar"):
        c = by_name(template["initContainers"] + template["containers"], name)
        env = env_of(c)
        assert env.get("AZURE_CLIENT_ID"), f"{name}: AZURE_CLIENT_ID selects the user-assigned identity"
        keys = {k: env[k] for k in ("SIDECAR_STORE", "SIDECAR_PREFIX", "AZURE_CLIENT_ID")}
        assert store_env in (None, keys), "restore and sync must use the same store, prefix and identity"
        store_env = keys
    assert store_env["SIDECAR_STORE"].startswith("https://")
    assert "secrets" not in app["properties"]["configuration"]
    text = ACA_FILE.read_text()
    for marker in ("AccountKey=", "SharedAccessSignature", "sig=", "AZURE_STORAGE_CONNECTION_STRING",
                   "AZURE_STORAGE_KEY", "secretRef", "passwordSecretRef"):
        assert marker not in text, f"{marker} in {ACA_FILE.name}"


def test_resources_are_an_allowed_combination(template):
    def total(containers):
        cpu = round(sum(c["resources"]["cpu"] for c in containers), 2)
        mem = sum(float(c["resources"]["memory"].removesuffix("Gi")) for c in containers)
        return cpu, f"{mem:g}Gi"

    for c in template["initContainers"] + template["containers"]:
        cpu = c["resources"]["cpu"]
        assert 0 < cpu <= 4 and round(cpu, 2) == cpu, f"{c['name']}: cpu {cpu}"
    assert total(template["containers"]) in ALLOWED_TOTALS, total(template["containers"])
    # Whether or not the platform adds the init container to the total, both sums are allowed.
    assert total(template["containers"] + template["initContainers"]) in ALLOWED_TOTALS


def test_grace_period_and_single_writer(app, template):
    drain = float(env_of(by_name(template["containers"], "checkpoint-sidecar"))["SIDECAR_DRAIN_TIMEOUT"])
    grace = template["terminationGracePeriodSeconds"]
    assert drain + 10 < grace <= MAX_GRACE_SECONDS
    assert template["scale"] == {"minReplicas": 1, "maxReplicas": 1}
    assert app["properties"]["configuration"]["activeRevisionsMode"] == "Single"
    assert app["properties"]["configuration"]["ingress"]["targetPort"] == int(
        env_of(by_name(template["containers"], "agent"))["PORT"])


# -- the shutdown budget, and the `run` variant for every environment type ---------------------

ACA_RUN_FILE = ACA_FILE.with_name("containerapp-run.yaml")


def host_shutdown_limit(env: dict[str, str]) -> float:
    """The newest host's longest stop after SIGTERM: open requests, then its shutdown handlers,
    each up to AGENTSERVER_GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS, then resilient tasks up to
    AGENTSERVER_SHUTDOWN_GRACE_SECONDS (docs/DEPLOY.md#the-shutdown-budget)."""
    return (2 * float(env["AGENTSERVER_GRACEFUL_SHUTDOWN_TIMEOUT_SECONDS"])
            + float(env["AGENTSERVER_SHUTDOWN_GRACE_SECONDS"]))


def test_shutdown_budget(template):
    agent = env_of(by_name(template["containers"], "agent"))
    drain = float(env_of(by_name(template["containers"], "checkpoint-sidecar"))["SIDECAR_DRAIN_TIMEOUT"])
    assert host_shutdown_limit(agent) + drain < template["terminationGracePeriodSeconds"]


@pytest.fixture(scope="module")
def run_app() -> dict:
    with open(ACA_RUN_FILE) as f:
        return as_az_sees_it(yaml.safe_load(f.read()))


def test_run_variant_schema(run_app):
    errors = sorted(jsonschema.Draft202012Validator(CONTAINER_APP_SCHEMA).iter_errors(run_app), key=str)
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_run_variant_is_one_container_under_the_wrapper(run_app):
    """No init container (none gets a managed identity in a Consumption-only environment): the
    agent image's own entrypoint, `checkpoint-sidecar run --`, restores before the agent starts."""
    template = run_app["properties"]["template"]
    assert "initContainers" not in template and "volumes" not in template
    (agent,) = template["containers"]
    assert "command" not in agent and "args" not in agent, "the image's ENTRYPOINT and CMD must run"
    dockerfile = REPO / "examples" / "approval_agent" / "Dockerfile"
    assert dockerfile_value(dockerfile, "ENTRYPOINT") == '["checkpoint-sidecar", "run", "--"]'
    env = env_of(agent)
    assert env["SIDECAR_STORE"].startswith("https://") and env.get("AZURE_CLIENT_ID")
    probes = {p["type"]: p["httpGet"] for p in agent["probes"]}
    assert probes["Readiness"] == {"path": "/readiness", "port": int(env["PORT"])}
    assert probes["Liveness"] == {"path": "/livez", "port": port_of(env["SIDECAR_HTTP_ADDR"])}
    assert run_app["properties"]["configuration"]["ingress"]["targetPort"] == int(env["PORT"])
    assert template["scale"] == {"minReplicas": 1, "maxReplicas": 1}
    assert run_app["properties"]["configuration"]["activeRevisionsMode"] == "Single"
    cpu, mem = agent["resources"]["cpu"], agent["resources"]["memory"]
    assert (round(cpu, 2), f"{float(mem.removesuffix('Gi')):g}Gi") in ALLOWED_TOTALS
    (identity_id,) = run_app["identity"]["userAssignedIdentities"]
    assert all(r["identity"] == identity_id for r in run_app["properties"]["configuration"]["registries"])
    text = ACA_RUN_FILE.read_text()
    for marker in ("AccountKey=", "SharedAccessSignature", "sig=", "AZURE_STORAGE_CONNECTION_STRING",
                   "AZURE_STORAGE_KEY", "secretRef", "passwordSecretRef"):
        assert marker not in text, f"{marker} in {ACA_RUN_FILE.name}"


def test_run_variant_shutdown_budget(run_app):
    """The wrapper stops the host (SIGKILL after SIDECAR_CHILD_STOP_GRACE at the latest), then
    flushes: both fit in the grace period, and a host within its own limits is never killed."""
    template = run_app["properties"]["template"]
    env = env_of(template["containers"][0])
    stop_grace, drain = float(env["SIDECAR_CHILD_STOP_GRACE"]), float(env["SIDECAR_DRAIN_TIMEOUT"])
    assert host_shutdown_limit(env) < stop_grace
    assert stop_grace + drain < template["terminationGracePeriodSeconds"] <= MAX_GRACE_SECONDS
