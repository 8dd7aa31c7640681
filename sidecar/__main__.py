from sidecar.cli import entry

entry()
