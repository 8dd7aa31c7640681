"""The recipes that run ``checkpoint-sidecar prune`` on a schedule, checked offline.

* Kubernetes (``deploy/kubernetes/prune``): rendered with ``kubectl kustomize`` (as shipped and
  after the guide's ``sed`` edits), validated strictly against the bundled OpenAPI schemas, and
  compared with the sidecars' own objects: the same image, ConfigMap (store and the prefix every
  variant's namespaces sit under), service account and workload identity label; a daily schedule,
  ``concurrencyPolicy: Forbid``, a backoff limit, no retry of a usage error, resource limits, the
  image's non-root user. The guide's dry-run step (its ``python3`` edit of the job) is run on the
  rendered job.
* Container Apps (``deploy/azure-container-apps/prune-job.yaml``): normalised as
  ``az containerapp job create --yaml`` does and validated against the Microsoft.App/jobs fields it
  uses (unknown keys are errors), then compared with the app's files; the guide's ``sed`` lines
  are run word for word (placeholders filled and found, the dry-run copy), as is the Foundry
  guide's.
* Every ``az`` command of the pruning parts uses only flags the Azure CLI defines, and every data
  role is assigned on the container, never the account.
* The deploy guides' relative links lead to files and headings (the rule of tests/test_docs.py).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sidecar.config import SETTING_NAMES

from .conftest import ACA_FILE, K8S_DIR, REPO, dockerfile_value, image_uid
from .test_guides import ACA_README, ACA_VALUES, FOUNDRY_README, K8S_README, bash, guide_command, guide_commands

PRUNE_DIR = K8S_DIR / "prune"
JOB_FILE = REPO / "deploy" / "azure-container-apps" / "prune-job.yaml"
ACA_RUN_FILE = ACA_FILE.with_name("containerapp-run.yaml")
PRUNE_ARGS = ["prune", "--older-than", "7d"]
SECRET_MARKERS = ("AccountKey=", "SharedAccessSignature", "sig=", "AZURE_STORAGE_CONNECTION_STRING",
                  "AZURE_STORAGE_KEY", "secretKeyRef", "secretRef", "passwordSecretRef")


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def daily_cron(expr: str) -> bool:
    """A five-field cron expression that fires once a day at a fixed minute and hour."""
    fields = expr.split()
    if len(fields) != 5:
        return False
    minute, hour, dom, month, dow = fields
    return (minute.isdigit() and 0 <= int(minute) <= 59 and hour.isdigit() and 0 <= int(hour) <= 23
            and (dom, month, dow) == ("*", "*", "*"))


def test_daily_cron():
    assert daily_cron("17 3 * * *")
    assert not daily_cron("17 3 * *") and not daily_cron("*/5 * * * *") and not daily_cron("0 25 * * *")
    assert not daily_cron("0 3 * * 1")


# -- Kubernetes ----------------------------------------------------------------------------------

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
from kubernetes_validate import utils as kv  # noqa: E402

#: "next to any variant": the legacy variant's clusters (1.27, 1.28) too
VERSIONS = ["1.27.0", "1.28.0", "1.29.0", "1.31.0", kv.latest_version()]


@pytest.fixture(scope="module")
def prune_docs(kustomize) -> list[dict]:
    return kustomize(PRUNE_DIR)


@pytest.fixture(scope="module")
def native_docs(kustomize) -> list[dict]:
    return kustomize(K8S_DIR)


def cronjob_container(docs: list[dict]) -> dict:
    (container,) = one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("version", VERSIONS)
def test_prune_variant_validates(prune_docs, version):
    for doc in prune_docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {path}: {e.message}") from e


def test_prune_variant_adds_only_the_cronjob(prune_docs, native_docs):
    """The base's Deployment is dropped; the ServiceAccount and ConfigMap are the very objects the
    native variant applies (same generated name), so applying both changes nothing."""
    assert sorted(d["kind"] for d in prune_docs) == ["ConfigMap", "CronJob", "ServiceAccount"]
    for kind in ("ServiceAccount", "ConfigMap"):
        assert one(prune_docs, kind) == one(native_docs, kind), kind


def test_cronjob_runs_prune_like_the_sidecars(prune_docs, native_docs):
    cron = one(prune_docs, "CronJob")
    spec = cron["spec"]
    assert daily_cron(spec["schedule"]), spec["schedule"]
    assert spec["concurrencyPolicy"] == "Forbid"
    job = spec["jobTemplate"]["spec"]
    assert 1 <= job["backoffLimit"] <= 6
    assert job["activeDeadlineSeconds"] > 0
    # a usage error (exit 2) is not retried: the same flags would fail again
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule == {"action": "FailJob", "onExitCodes": {"containerName": "prune", "operator": "In", "values": [2]},
                    "onPodConditions": []}
    template = job["template"]
    pod = template["spec"]
    assert pod["restartPolicy"] == "Never" and pod["enableServiceLinks"] is False
    container = cronjob_container(prune_docs)
    assert container["name"] == "prune"
    assert container["args"] == PRUNE_ARGS, "the daily job prunes; --dry-run is the guide's first, manual step"
    assert "command" not in container, "the image's entrypoint is checkpoint-sidecar"
    assert dockerfile_value(REPO / "Dockerfile", "ENTRYPOINT") == '["checkpoint-sidecar"]'

    deployment = one(native_docs, "Deployment")["spec"]["template"]
    sidecar = deployment["spec"]["initContainers"][0]
    assert container["image"] == sidecar["image"], "the sidecars' image"
    assert container["envFrom"] == sidecar["envFrom"], "the sidecars' store settings"
    assert "env" not in container, "nothing but the store settings"
    # the same workload identity
    sa = one(prune_docs, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == deployment["spec"]["serviceAccountName"]
    assert template["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    # non-root like the sidecar, limits on CPU and memory
    uid = image_uid()
    ctx = pod["securityContext"]
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["runAsNonRoot"]) == (uid, uid, True)
    assert container["securityContext"] == sidecar["securityContext"]
    res = container["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["cpu"] and res["limits"]["memory"]
    text = repr(prune_docs)
    for marker in SECRET_MARKERS:
        assert marker not in text, marker


def test_the_prefix_is_the_one_the_sessions_share(prune_docs, kustomize):
    """prune reads SIDECAR_PREFIX from the base's ConfigMap: a plain path, equal to the single
    Deployment's namespace and the parent of every StatefulSet pod's namespace."""
    from sidecar.namespace import resolve

    prefix = one(prune_docs, "ConfigMap")["data"]["SIDECAR_PREFIX"]
    assert prefix and "{" not in prefix
    template = one(kustomize(K8S_DIR / "statefulset"), "ConfigMap")["data"]["SIDECAR_PREFIX"]
    for n in range(3):
        assert resolve(template, {"POD_NAME": f"approval-agent-{n}"}).path.startswith(prefix + "/")
    assert one(kustomize(K8S_DIR / "legacy"), "ConfigMap")["data"]["SIDECAR_PREFIX"] == prefix


@pytest.fixture(scope="module")
def edited_prune(tmp_path_factory, kustomize) -> list[dict]:
    root = tmp_path_factory.mktemp("prune-guide")
    shutil.copytree(K8S_DIR, root / "deploy" / "kubernetes")
    edits = guide_commands(K8S_README, r"^sed -i ")
    proc = bash("\n".join(edits), root, {"ACR": "myregistry", "ACCOUNT": "agentstate4711",
                                         "CLIENT_ID": "11111111-2222-3333-4444-555555555555"})
    assert proc.returncode == 0, proc.stderr
    return kustomize(root / "deploy" / "kubernetes" / "prune")


def test_the_guides_edits_reach_the_cronjob(edited_prune):
    assert cronjob_container(edited_prune)["image"] == "myregistry.azurecr.io/checkpoint-sidecar:0.1.0"
    assert one(edited_prune, "ConfigMap")["data"]["SIDECAR_STORE"] == "https://agentstate4711.blob.core.windows.net/agent-state"
    sa = one(edited_prune, "ServiceAccount")
    assert sa["metadata"]["annotations"]["azure.workload.identity/client-id"] == "11111111-2222-3333-4444-555555555555"


def test_the_guides_placeholder_check_covers_prune():
    (check,) = guide_commands(K8S_README, r"no placeholders left")
    assert "deploy/kubernetes/prune" in check.split("; do")[0]


def test_the_guides_dry_run_step(prune_docs):
    """`kubectl create job --from=cronjob/...` copies the CronJob's job template; the guide's python3
    edit appends --dry-run, and the result is still a valid Job of the same pod."""
    (step,) = guide_commands(K8S_README, r"create job prune-dry-run")
    cron = one(prune_docs, "CronJob")
    assert f"--from=cronjob/{cron['metadata']['name']}" in step
    (python,) = [seg for seg in step.split("|") if seg.strip().startswith("python3 ")]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "prune-dry-run"},
           "spec": copy.deepcopy(cron["spec"]["jobTemplate"]["spec"])}
    argv = shlex.split(python.replace("\\\n", " "))
    out = subprocess.run(argv, input=json.dumps(job), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    edited = json.loads(out.stdout)
    (container,) = edited["spec"]["template"]["spec"]["containers"]
    assert container["args"] == [*PRUNE_ARGS, "--dry-run"]
    edited["spec"]["template"]["spec"]["containers"][0]["args"] = PRUNE_ARGS
    assert edited == job, "the dry run differs only in --dry-run"
    kv.validate(json.loads(out.stdout), kv.latest_version(), strict=True)
    assert any("job/prune-dry-run" in c for c in guide_commands(K8S_README, r"logs job/"))


# -- Container Apps ------------------------------------------------------------------------------

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")

from .test_container_apps import (  # noqa: E402
    _CONTAINER,
    _INIT_CONTAINER,
    _INT,
    _RESOURCE_ID,
    _STR,
    _VOLUME,
    ALLOWED_TOTALS,
    as_az_sees_it,
)

_REGISTRIES = {"type": "array", "items": {
    "type": "object", "additionalProperties": False, "required": ["server"],
    "properties": {"server": _STR, "identity": _STR, "username": _STR, "passwordSecretRef": _STR}}}
_TRIGGER_CONFIG = {"type": "object", "additionalProperties": False,
                   "properties": {"cronExpression": _STR, "parallelism": _INT, "replicaCompletionCount": _INT}}
#: The subset of Microsoft.App/jobs (API 2024-03-01) this file uses; az's deserializer drops unknown keys.
JOB_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["properties"],
    "properties": {
        "type": {"enum": ["Microsoft.App/jobs"]}, "name": _STR, "location": _STR, "tags": {"type": "object"},
        "identity": {"type": "object", "additionalProperties": False, "required": ["type"],
                     "properties": {"type": {"enum": ["None", "SystemAssigned", "UserAssigned",
                                                      "SystemAssigned,UserAssigned"]},
                                    "userAssignedIdentities": {"type": "object", "additionalProperties": {
                                        "type": "object", "maxProperties": 0}}}},
        "properties": {"type": "object", "additionalProperties": False,
                       "required": ["environmentId", "configuration", "template"],
                       "properties": {
                           "environmentId": {"type": "string", "pattern": _RESOURCE_ID + "Microsoft.App/managedEnvironments/"},
                           "workloadProfileName": _STR,
                           "configuration": {"type": "object", "additionalProperties": False,
                                             "required": ["triggerType", "replicaTimeout"],
                                             "properties": {
                                                 "triggerType": {"enum": ["Schedule", "Event", "Manual"]},
                                                 "replicaTimeout": _INT, "replicaRetryLimit": _INT,
                                                 "scheduleTriggerConfig": {**_TRIGGER_CONFIG, "required": ["cronExpression"]},
                                                 "manualTriggerConfig": _TRIGGER_CONFIG,
                                                 "eventTriggerConfig": {"type": "object"},
                                                 "secrets": {"type": "array"}, "registries": _REGISTRIES,
                                                 "identitySettings": {"type": "array"}}},
                           "template": {"type": "object", "additionalProperties": False, "required": ["containers"],
                                        "properties": {
                                            "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
                                            "initContainers": {"type": "array", "items": _INIT_CONTAINER},
                                            "volumes": {"type": "array", "items": _VOLUME}}}}},
    },
}


def load(path: Path) -> dict:
    return as_az_sees_it(yaml.safe_load(path.read_text()))


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.fixture(scope="module")
def job() -> dict:
    return load(JOB_FILE)


def test_job_schema(job):
    errors = sorted(jsonschema.Draft202012Validator(JOB_SCHEMA).iter_errors(job), key=str)
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_job_schema_catches_unknown_fields(job):
    bad = copy.deepcopy(job)
    bad["properties"]["configuration"]["scheduleTriggerConfig"]["cron"] = "17 3 * * *"
    assert list(jsonschema.Draft202012Validator(JOB_SCHEMA).iter_errors(bad))


def test_job_runs_prune_daily(job):
    config = job["properties"]["configuration"]
    assert config["triggerType"] == "Schedule"
    schedule = config["scheduleTriggerConfig"]
    assert daily_cron(schedule["cronExpression"]), schedule
    assert (schedule["parallelism"], schedule["replicaCompletionCount"]) == (1, 1), "one prune at a time"
    assert 0 < config["replicaTimeout"] <= 24 * 3600 and 1 <= config["replicaRetryLimit"] <= 6
    (container,) = job["properties"]["template"]["containers"]
    assert container["args"] == PRUNE_ARGS and "command" not in container
    cpu, mem = container["resources"]["cpu"], container["resources"]["memory"]
    assert (round(cpu, 2), f"{float(mem.removesuffix('Gi')):g}Gi") in ALLOWED_TOTALS


def test_job_shares_the_apps_image_store_and_identity(job):
    (container,) = job["properties"]["template"]["containers"]
    app, run_app = load(ACA_FILE), load(ACA_RUN_FILE)
    (sidecar,) = [c for c in app["properties"]["template"]["containers"] if c["name"] == "checkpoint-sidecar"]
    assert container["image"] == sidecar["image"], "the sidecar's image"
    env = env_of(container)
    keys = ("SIDECAR_STORE", "SIDECAR_PREFIX", "AZURE_CLIENT_ID")
    for other in (env_of(sidecar), env_of(run_app["properties"]["template"]["containers"][0])):
        assert {k: env[k] for k in keys} == {k: other[k] for k in keys}
    assert set(env) == set(keys), "nothing but the store settings and the identity"
    assert {k for k in env if k.startswith("SIDECAR_")} <= {f"SIDECAR_{n.upper()}" for n in SETTING_NAMES}
    assert job["identity"] == app["identity"]
    (identity_id,) = job["identity"]["userAssignedIdentities"]
    assert [r["identity"] for r in job["properties"]["configuration"]["registries"]] == [identity_id]
    assert job["properties"]["environmentId"] == app["properties"]["environmentId"]
    text = JOB_FILE.read_text()
    for marker in SECRET_MARKERS:
        assert marker not in text, marker


def run_guide_fill(readme: Path, tmp_path: Path, env: dict[str, str],
                   drop: str | None = None) -> subprocess.CompletedProcess:
    fill = guide_command(readme, r"^sed ", "deploy/azure-container-apps/prune-job.yaml")
    check = guide_command(readme, r"no placeholders left", "/tmp/prune-job.yaml")
    dry = guide_command(readme, r"^sed ", "/tmp/prune-dry-run.yaml")
    if drop:
        fill, n = re.subn(r'-e "s#' + re.escape(drop) + r'#[^"]*#g" ', "", fill)
        assert n == 1, fill
    script = "\n".join(c.replace("/tmp/", f"{tmp_path}/") for c in (fill, check, dry))
    return bash(script, REPO, env)



@pytest.mark.parametrize("readme", [ACA_README, FOUNDRY_README], ids=["container-apps", "foundry"])
def test_the_guides_fill_the_job(tmp_path, readme):
    values = dict(ACA_VALUES, PRUNE_RESOURCE=ACA_VALUES["ID_RESOURCE"].replace("approval-agent", "agent-state-prune"),
                  PRUNE_CLIENT="99999999-2222-3333-4444-555555555555")
    proc = run_guide_fill(readme, tmp_path, values)
    assert proc.returncode == 0 and proc.stdout.strip() == "no placeholders left", proc.stdout + proc.stderr
    filled = load(tmp_path / "prune-job.yaml")
    errors = list(jsonschema.Draft202012Validator(JOB_SCHEMA).iter_errors(filled))
    assert not errors, errors
    env = env_of(filled["properties"]["template"]["containers"][0])
    assert env["SIDECAR_STORE"] == f"https://{ACA_VALUES['ACCOUNT']}.blob.core.windows.net/agent-state"
    assert filled["properties"]["environmentId"] == ACA_VALUES["ENV_ID"]
    if readme == FOUNDRY_README:  # its own identity, and the sessions' prefix of agent-version.json
        foundry = json.loads((REPO / "deploy" / "foundry" / "agent-version.json").read_text())
        assert env["SIDECAR_PREFIX"] == foundry["definition"]["environment_variables"]["SIDECAR_PREFIX"] == "sessions"
        assert env["AZURE_CLIENT_ID"] == values["PRUNE_CLIENT"]
        assert list(filled["identity"]["userAssignedIdentities"]) == [values["PRUNE_RESOURCE"]]
    else:
        assert env["SIDECAR_PREFIX"] == "approval-agent" and env["AZURE_CLIENT_ID"] == ACA_VALUES["ID_CLIENT"]
        assert list(filled["identity"]["userAssignedIdentities"]) == [ACA_VALUES["ID_RESOURCE"]]
    # the dry-run copy: another name, --dry-run, nothing else
    dry = load(tmp_path / "prune-dry-run.yaml")
    assert dry["name"] == filled["name"] + "-dry-run"
    assert dry["properties"]["template"]["containers"][0]["args"] == [*PRUNE_ARGS, "--dry-run"]
    dry["name"] = filled["name"]
    dry["properties"]["template"]["containers"][0]["args"] = PRUNE_ARGS
    assert dry == filled


def test_the_guides_check_finds_a_placeholder_left(tmp_path):
    proc = run_guide_fill(ACA_README, tmp_path, ACA_VALUES, drop="<storage-account>")
    lines = [ln for ln in proc.stdout.splitlines() if ln != "no placeholders left"]
    assert "no placeholders left" not in proc.stdout and lines, proc.stdout + proc.stderr
    for line in lines:  # only the unfilled value, never a comment
        assert "<storage-account>" in line and not line.split(":", 1)[1].lstrip().startswith("#"), line


# -- the az commands of the pruning parts, and the roles ----------------------------------------

#: Flags of the commands used, as the Azure CLI defines them (azure-cli, command_modules/containerapp
#: _params.py and commands.py: `containerapp job create|start|delete|execution list`; role and
#: identity from `az role assignment create --help`, `az identity create|show --help`); global
#: flags (-o, --query) for every command.
AZ_FLAGS = {
    "containerapp job create": {"-g", "--resource-group", "-n", "--name", "--yaml", "--environment",
                                "--trigger-type", "--cron-expression", "--replica-timeout", "--replica-retry-limit",
                                "--replica-completion-count", "--parallelism", "--image", "--env-vars",
                                "--mi-user-assigned", "--registry-server", "--registry-identity", "--cpu", "--memory"},
    "containerapp job start": {"-g", "--resource-group", "-n", "--name"},
    "containerapp job delete": {"-g", "--resource-group", "-n", "--name", "--yes", "-y"},
    "containerapp job execution list": {"-g", "--resource-group", "-n", "--name"},
    "role assignment create": {"--assignee-object-id", "--assignee-principal-type", "--role", "--scope"},
    "identity create": {"-g", "--resource-group", "-n", "--name"},
    "identity show": {"-g", "--resource-group", "-n", "--name"},
    "acr build": {"-r", "--registry", "-t", "--image", "-f", "--file", "--platform"},
    "acr show": {"-n", "--name"},
}
GLOBAL_FLAGS = {"-o", "--output", "--query"}
DATA_ROLES = {"Storage Blob Data Contributor", "Storage Blob Data Reader"}


def pruning_part(readme: Path) -> str:
    text = readme.read_text()
    m = re.search(r"^## Pruning ended (?:namespaces|sessions)\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert m, f"{readme}: no pruning part"
    return m.group(1)


def az_invocations(command: str) -> list[list[str]]:
    """Every `az ...` invocation in a command line, nested `$(az ...)` ones included, as tokens."""
    command = command.replace("\\\n", " ")
    command = re.sub(r"'[^']*'", "''", command)          # sed and python programs
    inner = re.findall(r"\$\(([^()]*)\)", command)
    segments = [*inner, *re.sub(r"\$\(([^()]*)\)", "SUBST", command).split("|")]
    out = []
    for segment in segments:
        tokens = shlex.split(segment, comments=True)
        if tokens[:1] == ["az"]:
            out.append(tokens[1:])
    return out


@pytest.mark.parametrize("readme", [K8S_README, ACA_README, FOUNDRY_README], ids=["kubernetes", "container-apps", "foundry"])
def test_the_pruning_parts_use_documented_az_flags_and_container_scoped_roles(readme):
    part = pruning_part(readme)
    blocks = re.findall(r"```bash\n(.*?)```", part, re.DOTALL)
    assert blocks, readme
    from .test_guides import commands

    seen = set()
    for block in blocks:
        for command in commands(block):
            for tokens in az_invocations(command):
                words = [t for t in tokens if not t.startswith("-")]
                name = next((n for n in sorted(AZ_FLAGS, key=len, reverse=True) if words[:len(n.split())] == n.split()), None)
                assert name, f"{readme.name}: a command the test does not know: az {' '.join(tokens)}"
                seen.add(name)
                flags = {t.split("=", 1)[0] for t in tokens if re.match(r"^--?[a-z]", t)}
                unknown = flags - AZ_FLAGS[name] - GLOBAL_FLAGS
                assert not unknown, f"{readme.name}: az {name}: {unknown}"
                if name == "role assignment create":
                    args = dict(zip(tokens, tokens[1:], strict=False))
                    role, scope = args["--role"], args["--scope"]
                    if role in DATA_ROLES:
                        assert scope.endswith("/blobServices/default/containers/agent-state"), \
                            f"{readme.name}: {role} on {scope}, not the container"
                    else:
                        assert role == "AcrPull", role
    if readme != K8S_README:
        assert {"containerapp job create", "containerapp job start", "containerapp job delete"} <= seen
    assert "Storage Blob Data Contributor" in part and "Storage Blob Data Reader" in part
    assert "--dry-run" in part and "--live-within" in part and "SIDECAR_HEARTBEAT_INTERVAL" in part


def test_the_foundry_part_names_the_namespaces_and_what_a_pruned_session_sees():
    part = pruning_part(FOUNDRY_README)
    assert "`<prefix>/<agent>/<session>`" in part
    assert "starts empty" in part and "900 s" in part and "1h" in part


# -- links in the deploy guides ---------------------------------------------------------------------

GUIDES = sorted((REPO / "deploy").rglob("README.md"))


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_deploy_guides_links_resolve(page: Path):
    from test_docs import _LINK, _anchors, _prose

    broken = []
    for target in _LINK.findall(_prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)
