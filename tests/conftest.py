import pytest

from tests.azurite import azurite  # noqa: F401  (session fixture: CI's Azurite, or our own)


@pytest.fixture
def work(tmp_path):
    """A working directory for the host and a directory store beside it (outside every root)."""
    w = tmp_path / "work"
    w.mkdir()
    return w, tmp_path / "store"
