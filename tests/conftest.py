import pytest

from tests.azurite import azurite  # noqa: F401  (session fixture: CI's Azurite, or our own)


@pytest.fixture
def work(tmp_path):
    """A working directory for the host and a directory store beside it (outside every root)."""
    w = tmp_path / "work"
    w.mkdir()
    return w, tmp_path / "store"


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``--dist loadgroup``) the Podman tests share one worker: they share
    images built once per session and the tags they build.

    The Azure variants of the process tests (``tests/integration``, and those marked ``process``
    elsewhere) are ``slow``: CI runs them in its second tier. Each rule they check is the same on
    both stores (the store contract holds each backend to it, and the directory variant stays in
    the fast suite); what the Azure variant adds is the wiring of real processes through the SDK.
    Likewise the directory and Azure variants of the store tests whose module sets
    ``FAST_BACKENDS``."""
    for item in items:
        if item.get_closest_marker("containers"):
            item.add_marker(pytest.mark.xdist_group("podman"))
        spec = getattr(item, "callspec", None)
        if (spec is not None and (item.nodeid.startswith("tests/integration/") or item.get_closest_marker("process"))
                and "azure" in spec.id.split("-")):
            item.add_marker(pytest.mark.slow)
        # a module of whole in-process sessions names the backends its rules run on in the fast
        # suite (``FAST_BACKENDS``, the memory store's): the others are the wiring, in CI's second tier
        fast = getattr(getattr(item, "module", None), "FAST_BACKENDS", None)
        if fast is not None and spec is not None and spec.params.get("store_place") not in (*fast, None):
            item.add_marker(pytest.mark.slow)
