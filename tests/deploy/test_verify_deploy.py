"""The recipe that runs ``checkpoint-sidecar verify --read-data`` on a schedule, checked offline
like prune's (tests/deploy/test_prune_deploy.py): ``deploy/kubernetes/verify`` rendered with
``kubectl kustomize`` (as shipped and after the guide's ``sed`` edits), validated strictly against
the bundled OpenAPI schemas, and compared with the sidecars' own objects and with prune's CronJob:
the same image, ConfigMap, service account, workload identity label and security context; a
weekly schedule, ``concurrencyPolicy: Forbid``, a backoff limit, no retry of a usage error (2) nor
of damage found (4), resource limits. The arguments are a real ``verify`` command line."""

from __future__ import annotations

import shutil

import pytest

from sidecar.cli import build_parser
from sidecar.ops.verify import EXIT_DAMAGED

from .conftest import K8S_DIR
from .test_guides import K8S_README, bash, guide_commands
from .test_prune_deploy import PRUNE_DIR, cronjob_container, one

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
from kubernetes_validate import utils as kv  # noqa: E402

VERIFY_DIR = K8S_DIR / "verify"
VERIFY_ARGS = ["verify", "--read-data"]
#: "next to any variant": the legacy variant's clusters (1.27, 1.28) too
VERSIONS = ["1.27.0", "1.28.0", "1.29.0", "1.31.0", kv.latest_version()]


def weekly_cron(expr: str) -> bool:
    """A five-field cron expression that fires once a week at a fixed minute, hour and weekday."""
    fields = expr.split()
    if len(fields) != 5:
        return False
    minute, hour, dom, month, dow = fields
    return (minute.isdigit() and 0 <= int(minute) <= 59 and hour.isdigit() and 0 <= int(hour) <= 23
            and (dom, month) == ("*", "*") and dow.isdigit() and 0 <= int(dow) <= 6)


def test_weekly_cron():
    assert weekly_cron("17 4 * * 0")
    assert not weekly_cron("17 4 * * *") and not weekly_cron("17 4 1 * 0") and not weekly_cron("17 4 * * 7")


@pytest.fixture(scope="module")
def verify_docs(kustomize) -> list[dict]:
    return kustomize(VERIFY_DIR)


@pytest.mark.parametrize("version", VERSIONS)
def test_verify_variant_validates(verify_docs, version):
    for doc in verify_docs:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            raise AssertionError(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {path}: {e.message}") from e


def test_verify_variant_adds_only_the_cronjob(verify_docs, kustomize):
    """The ServiceAccount and ConfigMap are the very objects every variant applies."""
    assert sorted(d["kind"] for d in verify_docs) == ["ConfigMap", "CronJob", "ServiceAccount"]
    native = kustomize(K8S_DIR)
    for kind in ("ServiceAccount", "ConfigMap"):
        assert one(verify_docs, kind) == one(native, kind), kind


def test_cronjob_runs_verify_weekly_like_prune(verify_docs, kustomize):
    cron = one(verify_docs, "CronJob")
    spec = cron["spec"]
    assert weekly_cron(spec["schedule"]), spec["schedule"]
    assert spec["concurrencyPolicy"] == "Forbid" and spec["timeZone"] == "Etc/UTC"
    job = spec["jobTemplate"]["spec"]
    assert 1 <= job["backoffLimit"] <= 6 and job["activeDeadlineSeconds"] > 0
    # a usage error and damage found are not retried: the same run would end the same way
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule == {"action": "FailJob", "onExitCodes": {"containerName": "verify", "operator": "In", "values": [2, 4]},
                    "onPodConditions": []}
    assert EXIT_DAMAGED in rule["onExitCodes"]["values"]
    container = cronjob_container(verify_docs)
    assert container["name"] == "verify" and container["args"] == VERIFY_ARGS and "command" not in container
    args = build_parser("verify").parse_args(container["args"])
    assert (args.command, args.read_data, args.json) == ("verify", True, False)
    res = container["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["cpu"] and res["limits"]["memory"]

    # everything else as prune's CronJob: image, store settings, identity, user, security context
    prune = kustomize(PRUNE_DIR)
    theirs, ours = one(prune, "CronJob")["spec"]["jobTemplate"]["spec"]["template"], job["template"]
    assert ours["spec"]["serviceAccountName"] == theirs["spec"]["serviceAccountName"]
    assert ours["spec"]["securityContext"] == theirs["spec"]["securityContext"]
    assert ours["spec"]["restartPolicy"] == "Never" and ours["spec"]["enableServiceLinks"] is False
    assert ours["metadata"]["labels"]["azure.workload.identity/use"] == "true"
    prune_container = cronjob_container(prune)
    for field in ("image", "envFrom", "securityContext"):
        assert container[field] == prune_container[field], field
    assert "env" not in container, "nothing but the store settings"
    assert spec["schedule"].split()[:2] != one(prune, "CronJob")["spec"]["schedule"].split()[:2], \
        "not at the minute prune runs"


def test_the_guide_covers_verify(verify_docs):
    (check,) = guide_commands(K8S_README, r"no placeholders left")
    assert "deploy/kubernetes/verify" in check.split("; do")[0]
    (apply,) = guide_commands(K8S_README, r"apply -n \$NS -k deploy/kubernetes/verify")
    assert apply.strip() == "kubectl apply -n $NS -k deploy/kubernetes/verify"
    (run_now,) = guide_commands(K8S_README, r"create job verify-now")
    assert f"--from=cronjob/{one(verify_docs, 'CronJob')['metadata']['name']}" in run_now


def test_the_guides_edits_reach_the_cronjob(tmp_path, kustomize):
    shutil.copytree(K8S_DIR, tmp_path / "deploy" / "kubernetes")
    proc = bash("\n".join(guide_commands(K8S_README, r"^sed -i ")), tmp_path,
                {"ACR": "myregistry", "ACCOUNT": "agentstate4711", "CLIENT_ID": "11111111-2222-3333-4444-555555555555"})
    assert proc.returncode == 0, proc.stderr
    docs = kustomize(tmp_path / "deploy" / "kubernetes" / "verify")
    assert cronjob_container(docs)["image"] == "myregistry.azurecr.io/checkpoint-sidecar:0.1.0"
    assert one(docs, "ConfigMap")["data"]["SIDECAR_STORE"] == "https://agentstate4711.blob.core.windows.net/agent-state"
    assert one(docs, "ServiceAccount")["metadata"]["annotations"]["azure.workload.identity/client-id"] == \
        "11111111-2222-3333-4444-555555555555"
