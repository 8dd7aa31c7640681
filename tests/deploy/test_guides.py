"""The deploy guides' edit steps, run word for word as a new user would.

* Kubernetes (deploy/kubernetes/README.md): the guide's ``sed`` lines, run on a copy of
  ``deploy/kubernetes``, reach every variant: ``kubectl kustomize`` of the native, legacy and
  StatefulSet variants shows the edited store, both images from the user's registry and the
  identity's client id; the guide's own placeholder check then prints "no placeholders left".
* Container Apps (deploy/azure-container-apps/README.md): the guide's ``sed`` line fills both
  files, and its placeholder check finds nothing afterwards, but finds a placeholder left unfilled.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sidecar.config import SETTING_NAMES

from .conftest import K8S_DIR, REPO

K8S_README = K8S_DIR / "README.md"
ACA_DIR = REPO / "deploy" / "azure-container-apps"
ACA_README = ACA_DIR / "README.md"

ACR, ACCOUNT, CLIENT_ID = "myregistry", "agentstate4711", "11111111-2222-3333-4444-555555555555"
VARIANTS = ("", "legacy", "statefulset")


def bash_blocks(readme: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", readme.read_text(), re.DOTALL)


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined (comments after them kept: bash drops them)."""
    out: list[str] = []
    pending = ""
    for line in block.splitlines():
        if pending:
            pending += "\n" + line
        elif line.strip() and not line.lstrip().startswith("#"):
            pending = line
        else:
            continue
        if not pending.endswith("\\"):
            out.append(pending)
            pending = ""
    return out


def guide_commands(readme: Path, pattern: str) -> list[str]:
    found = [c for b in bash_blocks(readme) for c in commands(b) if re.search(pattern, c)]
    assert found, f"no command matching {pattern!r} in {readme}"
    return found


def guide_command(readme: Path, pattern: str, containing: str) -> str:
    """The one command matching ``pattern`` that mentions ``containing`` (a guide's file name)."""
    found = [c for c in guide_commands(readme, pattern) if containing in c]
    assert len(found) == 1, f"{readme}: {len(found)} commands match {pattern!r} and name {containing!r}: {found}"
    return found[0]


def bash(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/local/bin:/usr/bin:/bin", **env})


@pytest.fixture(scope="module")
def edited_k8s(tmp_path_factory) -> Path:
    """A copy of the repository's deploy/kubernetes after the guide's edits."""
    root = tmp_path_factory.mktemp("guide")
    shutil.copytree(K8S_DIR, root / "deploy" / "kubernetes")
    edits = guide_commands(K8S_README, r"^sed -i ")
    assert len(edits) >= 3, edits
    proc = bash("\n".join(edits), root, {"ACR": ACR, "ACCOUNT": ACCOUNT, "CLIENT_ID": CLIENT_ID})
    assert proc.returncode == 0, proc.stderr
    return root


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_guides_edits_reach_every_variant(kustomize, edited_k8s, variant):
    docs = kustomize(edited_k8s / "deploy" / "kubernetes" / variant)
    (workload,) = workloads(docs)
    pod = workload["spec"]["template"]["spec"]
    images = {c["name"]: c["image"] for c in pod.get("initContainers", []) + pod["containers"]}
    assert set(images.values()) == {f"{ACR}.azurecr.io/checkpoint-sidecar:0.1.0", f"{ACR}.azurecr.io/approval-agent:0.1.0"}, \
        f"{variant or 'native'}: {images}"
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config["data"]["SIDECAR_STORE"] == f"https://{ACCOUNT}.blob.core.windows.net/agent-state"
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert sa["metadata"]["annotations"]["azure.workload.identity/client-id"] == CLIENT_ID


def test_the_guides_placeholder_check_passes_after_the_edits(kustomize, edited_k8s):
    kustomize(edited_k8s / "deploy" / "kubernetes")  # skips where kubectl/kustomize is missing
    if not shutil.which("kubectl"):
        pytest.skip("the guide's check runs kubectl")
    (check,) = guide_commands(K8S_README, r"no placeholders left")
    proc = bash(check, edited_k8s, {})
    assert proc.returncode == 0 and proc.stdout.strip() == "no placeholders left", proc.stdout + proc.stderr


def test_the_guides_placeholder_check_finds_what_is_left(kustomize):
    kustomize(K8S_DIR)
    if not shutil.which("kubectl"):
        pytest.skip("the guide's check runs kubectl")
    (check,) = guide_commands(K8S_README, r"no placeholders left")
    proc = bash(check, REPO, {})
    assert "no placeholders left" not in proc.stdout
    for placeholder in ("agentstateexample", "example.azurecr.io/checkpoint-sidecar", "example.azurecr.io/approval-agent",
                        "00000000-0000-0000-0000-000000000000"):
        assert placeholder in proc.stdout, placeholder


def test_every_variant_takes_its_images_from_one_place(kustomize):
    """No variant declares images of its own: one edit of images/ is all the guide asks for."""
    for path in K8S_DIR.rglob("kustomization.yaml"):
        if path.parent.name != "images":
            assert not re.search(r"^images:", path.read_text(), re.MULTILINE), f"{path} declares its own images"
    rendered = {v: kustomize(K8S_DIR / v) for v in VARIANTS}
    for variant, docs in rendered.items():
        pod = workloads(docs)[0]["spec"]["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["image"].startswith("example.azurecr.io/"), f"{variant or 'native'}: {c['name']} {c['image']}"


# -- Container Apps ------------------------------------------------------------------------------

ACA_VALUES = {
    "ID_RESOURCE": "/subscriptions/s/resourceGroups/my-rg/providers/Microsoft.ManagedIdentity/"
                   "userAssignedIdentities/approval-agent",
    "ENV_ID": "/subscriptions/s/resourceGroups/my-rg/providers/Microsoft.App/managedEnvironments/agents",
    "ID_CLIENT": CLIENT_ID, "ACR": ACR, "ACCOUNT": ACCOUNT,
}


def aca_fill_and_check(tmp_path: Path, file: Path, drop: str | None = None) -> subprocess.CompletedProcess:
    fill = guide_command(ACA_README, r"^sed ", "/tmp/approval-agent.yaml")
    check = guide_command(ACA_README, r"no placeholders left", "/tmp/approval-agent.yaml")
    if drop:  # the user forgot one substitution
        fill, n = re.subn(r'-e "s#' + re.escape(drop) + r'#[^"]*#g" ', "", fill)
        assert n == 1, fill
    out = tmp_path / "approval-agent.yaml"
    script = "\n".join(c.replace("/tmp/approval-agent.yaml", str(out)) for c in (fill, check))
    return bash(script, REPO, {**ACA_VALUES, "FILE": str(file)})


@pytest.mark.parametrize("name", ["containerapp-run.yaml", "containerapp.yaml"])
def test_aca_placeholder_check_passes_once_filled(tmp_path, name):
    proc = aca_fill_and_check(tmp_path, ACA_DIR / name)
    assert proc.returncode == 0 and proc.stdout.strip() == "no placeholders left", proc.stdout + proc.stderr
    filled = (tmp_path / "approval-agent.yaml").read_text()
    assert f"{ACR}.azurecr.io/approval-agent" in filled and f"https://{ACCOUNT}.blob.core.windows.net" in filled


@pytest.mark.parametrize("name", ["containerapp-run.yaml", "containerapp.yaml"])
def test_aca_placeholder_check_finds_a_placeholder_left(tmp_path, name):
    proc = aca_fill_and_check(tmp_path, ACA_DIR / name, drop="<storage-account>")
    assert "no placeholders left" not in proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stdout + proc.stderr
    for line in lines:  # only the unfilled value, never a comment
        assert "<storage-account>" in line and not line.split(":", 1)[1].lstrip().startswith("#"), line


# -- Foundry hosted agents -------------------------------------------------------------------------

FOUNDRY_README = REPO / "deploy" / "foundry" / "README.md"


def foundry_fill_and_check(tmp_path: Path, drop: str | None = None) -> subprocess.CompletedProcess:
    fill = guide_command(FOUNDRY_README, r"^sed ", "/tmp/agent-version.json")
    check = guide_command(FOUNDRY_README, r"no placeholders left", "/tmp/agent-version.json")
    if drop:
        fill, n = re.subn(r'-e "s#' + re.escape(drop) + r'#[^"]*#g" ', "", fill)
        assert n == 1, fill
    out = tmp_path / "agent-version.json"
    script = "\n".join(c.replace("/tmp/agent-version.json", str(out)) for c in (fill, check))
    return bash(script, REPO, {"ACR": ACR, "ACCOUNT": ACCOUNT, "AGENT": "my-agent"})


def test_foundry_agent_version_once_filled(tmp_path):
    proc = foundry_fill_and_check(tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "no placeholders left", proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "agent-version.json").read_text())
    assert doc["name"] == "my-agent"
    definition = doc["definition"]
    assert definition["kind"] == "hosted"
    assert definition["container_configuration"]["image"] == f"{ACR}.azurecr.io/approval-agent-foundry:0.1.0"
    assert definition["protocol_versions"] == [{"protocol": "responses", "version": "2.0.0"}]
    env = definition["environment_variables"]
    assert env["SIDECAR_STORE"] == f"https://{ACCOUNT}.blob.core.windows.net/agent-state"
    assert all(k.startswith("SIDECAR_") for k in env), "the platform reserves FOUNDRY_* and AGENT_*; no secrets here"
    # The sidecar accepts the variables as they are (a bad one would stop every session at start).
    assert set(env) <= {f"SIDECAR_{name.upper()}" for name in SETTING_NAMES}


def test_foundry_placeholder_check_finds_a_placeholder_left(tmp_path):
    proc = foundry_fill_and_check(tmp_path, drop="<storage-account>")
    assert "no placeholders left" not in proc.stdout and "<storage-account>" in proc.stdout, proc.stdout




def test_the_deploy_block_pasted_whole_applies_one_variant():
    """Issue #34, item 6: the block listed an apply of each variant, so pasting it whole applied
    all three (into one namespace). It applies ``$VARIANT``, set once to the native variant."""
    (block,) = [b for b in bash_blocks(K8S_README) if "kubectl apply -n $NS -k $VARIANT" in b]
    cmds = commands(block)
    applies = [c for c in cmds if c.startswith("kubectl apply")]
    assert applies == ["kubectl apply -n $NS -k $VARIANT"], applies
    (chosen,) = [c for c in cmds if c.startswith("VARIANT=")]
    variant = re.match(r"VARIANT=(\S+) WORKLOAD=(\S+)", chosen)
    assert variant and (REPO / variant[1] / "kustomization.yaml").is_file(), chosen
    assert variant[2] == "deploy/approval-agent"
    for v in VARIANTS:  # each other variant is named, in a comment, for the reader to choose
        assert f"deploy/kubernetes/{v}".rstrip("/") in block
