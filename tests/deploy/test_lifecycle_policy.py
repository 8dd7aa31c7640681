"""deploy/azure-storage/lifecycle-policy.json has the shape Azure's lifecycle-management schema
documents (``az storage account management-policy create --policy``): rules of
``{name, enabled, type: "Lifecycle", definition: {filters, actions}}``, and its one rule deletes
previous blob versions only, after a number of days, for block blobs under a container prefix."""

from __future__ import annotations

import json
import re

from .conftest import REPO

POLICY = REPO / "deploy" / "azure-storage" / "lifecycle-policy.json"

#: The documented keys at each level this policy uses (anything else is a typo Azure refuses).
RULE_KEYS = {"name", "enabled", "type", "definition"}
DEFINITION_KEYS = {"filters", "actions"}
FILTER_KEYS = {"blobTypes", "prefixMatch", "blobIndexMatch"}
ACTION_KEYS = {"baseBlob", "snapshot", "version"}
VERSION_ACTIONS = {"delete", "tierToCool", "tierToCold", "tierToArchive", "tierToHot"}


def test_the_lifecycle_policy_deletes_previous_versions_only():
    policy = json.loads(POLICY.read_text())
    assert set(policy) == {"rules"} and len(policy["rules"]) >= 1
    names = [rule["name"] for rule in policy["rules"]]
    assert len(set(names)) == len(names) <= 100
    for rule in policy["rules"]:
        assert set(rule) == RULE_KEYS, rule
        # a name: letters and digits, '-' allowed, up to 256 characters (the schema's rule)
        assert re.fullmatch(r"[A-Za-z0-9-]{1,256}", rule["name"]), rule["name"]
        assert rule["enabled"] is True and rule["type"] == "Lifecycle"
        definition = rule["definition"]
        assert set(definition) == DEFINITION_KEYS
        filters, actions = definition["filters"], definition["actions"]
        assert set(filters) <= FILTER_KEYS and set(actions) <= ACTION_KEYS
        assert filters["blobTypes"] == ["blockBlob"]  # the sidecar writes block blobs only
        prefixes = filters["prefixMatch"]
        assert 1 <= len(prefixes) <= 10
        for prefix in prefixes:  # "<container>/...": a container name first, never the whole account
            container = prefix.split("/", 1)[0]
            assert "/" in prefix and re.fullmatch(r"[a-z0-9](?:[a-z0-9]|-(?!-)){1,61}[a-z0-9]", container), prefix
        # previous versions only: nothing acts on the current version (baseBlob) of any object
        assert set(actions) == {"version"}, actions
        assert set(actions["version"]) <= VERSION_ACTIONS
        days = actions["version"]["delete"]["daysAfterCreationGreaterThan"]
        assert isinstance(days, int) and not isinstance(days, bool) and 0 <= days <= 99999
        assert set(actions["version"]["delete"]) == {"daysAfterCreationGreaterThan"}
