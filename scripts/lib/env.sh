# Sourced by scripts/test, scripts/demo and .ci/run: where the environments the project makes are
# cached. They live outside the clone, keyed by what they are made from, so a fresh clone reuses
# them and a changed constraints file makes a new one. tests/agenthost.py applies the same rule.
#
#   SIDECAR_CACHE   the cache's directory (default: $XDG_CACHE_HOME or ~/.cache, /checkpoint-sidecar)

CACHE_ROOT=${SIDECAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/checkpoint-sidecar}
AZURITE_VERSION=3.35.0

# agent_venv issue|latest|today: the pinned agent host's venv, keyed by its constraints file.
agent_venv() {
  local constraints=tests/agent_stacks/constraints-$1.txt
  echo "$CACHE_ROOT/agent-$1-$(sha256sum "$constraints" | cut -c1-12)"
}

# azurite_dir: where Azurite's npm package is installed (node_modules/azurite below it).
azurite_dir() {
  echo "$CACHE_ROOT/azurite-$AZURITE_VERSION"
}

# azurite_install: install the pinned Azurite once; says so and returns 1 without npm.
azurite_install() {
  local dir
  dir=$(azurite_dir)
  [ -f "$dir/node_modules/azurite/package.json" ] && return 0
  command -v npm >/dev/null || { echo "npm not found: the Azure tests are skipped (apt-get install nodejs npm)" >&2; return 1; }
  mkdir -p "$CACHE_ROOT"
  npm install -s --prefix "$dir.tmp.$$" --no-audit --no-fund --loglevel=error "azurite@$AZURITE_VERSION" >/dev/null
  mv -T "$dir.tmp.$$" "$dir" 2>/dev/null || { rm -rf "$dir.tmp.$$"; [ -f "$dir/node_modules/azurite/package.json" ]; }
}
