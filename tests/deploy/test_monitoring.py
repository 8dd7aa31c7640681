"""deploy/monitoring: the Grafana dashboard and the Prometheus alert rules use only metrics the
sidecar exports.

A real ``checkpoint-sidecar sync`` (directory store, ``SIDECAR_HTTP_ADDR`` on 127.0.0.1) is started
and its live ``/metrics`` scraped; every metric name in every dashboard query, template variable
and alert expression must be among the exported series (histograms as ``_bucket``/``_sum``/
``_count``). The one exception: names under ``checkpoint_sidecar_prune_`` are the gauges
``checkpoint-sidecar prune --pushgateway`` pushes (the sidecar never exports them), checked
against ``PRUNE_GAUGES``. The rules file is checked for the structure Prometheus loads (and with ``promtool
check rules`` where promtool is installed), the dashboard for the fields Grafana imports.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import httpx
import pytest
import yaml

from support import Sidecar, sidecar_env, wait_for, write_atomic

from .conftest import REPO

MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "alerts.yaml"
DASHBOARD = MONITORING / "dashboard.json"

#: The gauges `checkpoint-sidecar prune --pushgateway URL` pushes at the end of a run: the only names
#: under PRUNE_PREFIX a rule may use. Kept here, in one place; the prune command's own tests check
#: these names against a real push to a Pushgateway.
PRUNE_PREFIX = "checkpoint_sidecar_prune_"
PRUNE_GAUGES = frozenset({
    "checkpoint_sidecar_prune_eligible_namespaces",
    "checkpoint_sidecar_prune_pruned_namespaces",
    "checkpoint_sidecar_prune_last_success_timestamp_seconds",
})

PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords, labels and literals removed)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)                       # strings
    e = re.sub(r"\{[^}]*\}", "", e)                                  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                                 # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", "", e)      # numbers
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        if re.match(r"\s*\(", e[m.end():]) or m.group(0) in PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(0))
    return names


def test_metric_names_parser():
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x=~"$i"}[5m])))') == {"a_bucket"}
    assert metric_names("b > 0 and (time() - c) > 300") == {"b", "c"}
    assert metric_names('increase(d_total{kind=~"store|internal"}[1h]) > 1e3') == {"d_total"}


def exported_names(text: str) -> set[str]:
    """Every series name a scrape offers, from its samples and its ``# TYPE`` lines (labelled series
    appear only once they first happen, their family is declared from the start)."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        name, kind = m.groups()
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "summary":
            names |= {name, f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory) -> str:
    """The /metrics of a real `sync` that has restored, mirrored one file and is ready."""
    tmp = tmp_path_factory.mktemp("monitoring")
    work, store = tmp / "work", tmp / "store"
    (work / ".checkpoints").mkdir(parents=True)
    sc = Sidecar(work, "sync", env=sidecar_env(SIDECAR_STORE=str(store), SIDECAR_HTTP_ADDR="127.0.0.1:0"))
    try:
        addr = sc.wait_event("http_listening")["addr"]
        sc.wait_event("ready")
        write_atomic(work / ".checkpoints" / "c1" / "a.json", b'{"x": 1}')
        base = f"http://{addr}"

        def uploaded():
            text = httpx.get(base + "/metrics", timeout=5).text
            return text if re.search(r"^checkpoint_sidecar_uploaded_files_total 1\.0$", text, re.MULTILINE) else None

        return wait_for(uploaded, 30, "the upload in /metrics", lambda: "\n" + sc.log())
    finally:
        sc.stop()


def rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q)
            assert m, q
            exprs.append(m.group(1))
    return exprs


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_used_is_exported(live_metrics, source):
    exported = exported_names(live_metrics)
    exprs = [r["expr"] for r in rules()] if source == "alerts" else dashboard_queries()
    assert exprs
    used = set().union(*(metric_names(e) for e in exprs))
    assert used and all(n.startswith("checkpoint_sidecar_") for n in used), used
    missing = {n: [e for e in exprs if n in metric_names(e)] for n in used - exported - PRUNE_GAUGES}
    assert not missing, f"not exported by the sidecar (nor pushed by prune): {missing}"


def test_prune_names_are_the_pushed_gauges(live_metrics):
    """The prune alerts read only the three gauges prune pushes, and the sidecar exports none of
    them (so they are not checked against its /metrics)."""
    exported = exported_names(live_metrics)
    assert not {n for n in exported if n.startswith(PRUNE_PREFIX)}, "the sidecar exports a prune_ name"
    used = set().union(*(metric_names(r["expr"]) for r in rules()), *(metric_names(e) for e in dashboard_queries()))
    prune_used = {n for n in used if n.startswith(PRUNE_PREFIX)}
    assert prune_used == PRUNE_GAUGES, f"unknown: {prune_used - PRUNE_GAUGES}, unused: {PRUNE_GAUGES - prune_used}"
    # a misspelt prune name is caught: it is neither exported nor pushed
    assert metric_names("checkpoint_sidecar_prune_eligible > 0") - exported - PRUNE_GAUGES


def test_alerts_cover_namespaces_to_prune():
    by_name = {r["alert"]: r for r in rules()}
    assert "checkpoint_sidecar_prune_eligible_namespaces" in by_name["CheckpointSidecarNamespacesToPrune"]["expr"]
    assert "checkpoint_sidecar_prune_last_success_timestamp_seconds" in by_name["CheckpointSidecarPruneNotSucceeding"]["expr"]


def test_a_metric_the_sidecar_does_not_export_is_caught(live_metrics):
    """The check above is not vacuous: a name the sidecar does not export is reported."""
    exported = exported_names(live_metrics)
    assert "checkpoint_sidecar_write_to_durable_seconds_bucket" in exported
    assert "checkpoint_sidecar_failures_total" in exported  # a labelled family before its first failure
    assert metric_names("checkpoint_sidecar_namespaces_to_prune > 0") - exported == {"checkpoint_sidecar_namespaces_to_prune"}


def test_alerts_cover_what_operators_must_see():
    exprs = " ".join(r["expr"] for r in rules())
    for metric in ("checkpoint_sidecar_store_degraded", "checkpoint_sidecar_pending_paths", "checkpoint_sidecar_fenced",
                   "checkpoint_sidecar_ready", "checkpoint_sidecar_restore_duration_seconds",
                   "checkpoint_sidecar_watch_polling"):
        assert metric in exprs, metric


def test_rules_file_structure():
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    names = []
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
            assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", rule["alert"]), rule["alert"]
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert re.fullmatch(r"\d+[smh]", rule.get("for", "0m")), rule.get("for")
            assert rule["labels"]["severity"] in ("critical", "warning")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["expr"]
            names.append(rule["alert"])
    assert len(names) == len(set(names)), names


def test_rules_pass_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    proc = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_queries_pass_promtool(tmp_path):
    """Each dashboard query, as a recording rule: promtool parses its PromQL."""
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    recording = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(dashboard_queries())]}]}
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(recording))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_structure():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    for p in dash["panels"]:
        assert p["type"] in ("stat", "timeseries") and p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
        for t in p["targets"]:  # every query follows the sidecar picker
            assert 'instance=~"$instance"' in t["expr"], t["expr"]


@pytest.mark.slow
def test_prune_alerts_fire_as_documented(tmp_path):
    """promtool's rule unit tests on the pushed gauges (a Pushgateway scraped every minute): three
    namespaces eligible and none pruned for 2 days fires NamespacesToPrune (not before 48h), a
    prune that pruned them all does not; no success for 2 days fires PruneNotSucceeding."""
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    by_name = {r["alert"]: r for r in rules()}
    job = "checkpoint-sidecar-prune"

    def fired(alert: str, summary: str) -> dict:
        return {"exp_labels": {"severity": by_name[alert]["labels"]["severity"], "job": job},
                "exp_annotations": {"summary": summary, "description": by_name[alert]["annotations"]["description"]}}

    minutes = 50 * 60 + 10
    tests = {"rule_files": [str(RULES)], "evaluation_interval": "1m", "tests": [
        {"interval": "1m",
         "input_series": [
             {"series": f'checkpoint_sidecar_prune_eligible_namespaces{{job="{job}"}}', "values": f"3x{minutes}"},
             {"series": f'checkpoint_sidecar_prune_pruned_namespaces{{job="{job}"}}', "values": f"0x{minutes}"},
             {"series": f'checkpoint_sidecar_prune_last_success_timestamp_seconds{{job="{job}"}}', "values": f"0x{minutes}"}],
         "alert_rule_test": [
             {"eval_time": "47h", "alertname": "CheckpointSidecarNamespacesToPrune", "exp_alerts": []},
             {"eval_time": "50h", "alertname": "CheckpointSidecarNamespacesToPrune", "exp_alerts": [
                 fired("CheckpointSidecarNamespacesToPrune", f"{job}: 3 ended namespaces have waited 2 days to be pruned")]},
             {"eval_time": "50h", "alertname": "CheckpointSidecarPruneNotSucceeding", "exp_alerts": [
                 fired("CheckpointSidecarPruneNotSucceeding", f"{job}: no prune has succeeded for 2d 2h 0m 0s")]}]},
        {"interval": "1m",
         "input_series": [
             {"series": f'checkpoint_sidecar_prune_eligible_namespaces{{job="{job}"}}', "values": f"3x{minutes}"},
             {"series": f'checkpoint_sidecar_prune_pruned_namespaces{{job="{job}"}}', "values": f"3x{minutes}"}],
         "alert_rule_test": [
             {"eval_time": "50h", "alertname": "CheckpointSidecarNamespacesToPrune", "exp_alerts": []}]},
    ]}
    path = tmp_path / "prune-rules-test.yaml"
    path.write_text(yaml.safe_dump(tests))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
