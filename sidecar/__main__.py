from sidecar.log import ensure_stdio

ensure_stdio()  # before anything opens a descriptor: a closed fd 0/1/2 would be reused

from sidecar.cli import entry  # noqa: E402

entry()
