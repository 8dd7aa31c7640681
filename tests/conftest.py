import pytest


@pytest.fixture
def work(tmp_path):
    """A working directory for the host and a directory store beside it (outside every root)."""
    w = tmp_path / "work"
    w.mkdir()
    return w, tmp_path / "store"
