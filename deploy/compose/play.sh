#!/usr/bin/env bash
# Plays the recovery story with compose.yaml: a paused approval workflow survives the loss of the
# agent's compute (containers and state volumes gone) because the sidecar kept it in Azurite.
#
#   1. up: azurite, restore (init step, exits 0), sidecar (sync), agent (after restore)
#   2. first request  POST /responses {"input": "ship it"}  -> function_call request_info + call_id
#   3. wait until `checkpoint-sidecar status` says the store is in sync
#   4. compute recreation: down (graceful, the sidecar flushes), remove the state volumes;
#      Azurite's volume azurite-data is kept
#   5. up again: restore brings the checkpoint back before the agent starts
#   6. continuation with previous_response_id + function_call_output "approved"
#      -> "Completed with decision: approved"
#
# Usage: ./play.sh        Env: COMPOSE   compose command (default podman-compose; "docker compose" works)
#                              ENGINE    container engine for inspect/exec/volume rm (default podman; docker)
#                              COMPOSE_PROJECT_NAME (default checkpoint-sidecar-demo)
#                              AGENT_PORT host port of the agent on 127.0.0.1 (default 8088)
#                              PLAY_TIMEOUT seconds per wait (default 180)
#                              KEEP=1    leave the stack running at the end (default: down -v)
# Needs python3 on the host (HTTP and JSON) and podman-compose >= 1.3 (`pip install podman-compose`;
# Debian 12 ships 1.0.3, which ignores depends_on conditions) or docker compose.
#
# The stack is brought up in stages: azurite, then restore (waited for, exit code checked), then
# sidecar and agent with --no-deps. `docker compose up -d` alone honours the gate declared in
# compose.yaml (depends_on: restore: condition: service_completed_successfully), but podman-compose
# turns depends_on into `podman create --requires`, and Podman (4.x) then starts an exited
# dependency again whenever a dependent starts: restore would run once per dependent. Staging
# works the same everywhere, and check_gate verifies that restore exited 0 before the agent started.
set -euo pipefail
cd "$(dirname "$0")"

COMPOSE=${COMPOSE:-podman-compose}
ENGINE=${ENGINE:-podman}
PROJECT=${COMPOSE_PROJECT_NAME:-checkpoint-sidecar-demo}
export AGENT_PORT=${AGENT_PORT:-8088}
TIMEOUT=${PLAY_TIMEOUT:-180}
AGENT_URL="http://127.0.0.1:${AGENT_PORT}"
EXPECTED="Completed with decision: approved"

say() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'play.sh: FAILED: %s\n' "$*" >&2; exit 1; }
# shellcheck disable=SC2086  # COMPOSE may be two words ("docker compose")
compose() { $COMPOSE -p "$PROJECT" -f compose.yaml "$@"; }

container_of() {  # the (single) container of a compose service, running or exited
  "$ENGINE" ps -a -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" | head -n 1
}

dump_logs() {
  for svc in restore sidecar agent azurite; do
    local id
    id=$(container_of "$svc" 2>/dev/null || true)
    [ -n "$id" ] || continue
    printf '\n--- logs: %s (last 40 lines) ---\n' "$svc" >&2
    "$ENGINE" logs --tail 40 "$id" >&2 2>&1 || true
  done
}

finish() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then dump_logs; fi
  if [ "${KEEP:-0}" != 1 ]; then
    say "cleaning up: down -v (containers and every volume of the demo)"
    compose down -v -t 30 >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap finish EXIT

wait_url() {  # wait_url URL: poll until it answers 200
  python3 - "$1" "$TIMEOUT" <<'PY'
import sys, time, urllib.request
url, timeout = sys.argv[1], float(sys.argv[2])
deadline = time.monotonic() + timeout
while True:
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"timed out after {timeout:.0f}s waiting for {url}")
    time.sleep(0.25)
PY
}

responses() {  # responses first | responses continue RESPONSE_ID CALL_ID
  python3 - "$AGENT_URL" "$@" <<'PY'
import json, sys, urllib.request
url, what, *args = sys.argv[1:]
if what == "first":
    body = {"input": "ship it"}
else:
    body = {"previous_response_id": args[0],
            "input": [{"type": "function_call_output", "call_id": args[1], "output": "approved"}]}
print(f"POST /responses {json.dumps(body)}", file=sys.stderr)
req = urllib.request.Request(url + "/responses", json.dumps(body).encode(), {"content-type": "application/json"})
data = json.load(urllib.request.urlopen(req, timeout=120))
output = data.get("output") or []
if what == "first":
    calls = [o for o in output if o.get("type") == "function_call" and o.get("name") == "request_info"]
    if data.get("status") != "completed" or len(calls) != 1:
        sys.exit(f"expected one request_info function_call, got: {json.dumps(data)[:1500]}")
    print(f"  -> {data['status']}: function_call request_info, call_id {calls[0]['call_id']}", file=sys.stderr)
    print(data["id"], calls[0]["call_id"])
else:
    text = "".join(c.get("text") or "" for o in output if o.get("type") == "message"
                   for c in o.get("content") or [])
    print(f"  -> {data.get('status')}: {text or json.dumps(data.get('error'))}", file=sys.stderr)
    print(text)
PY
}

check_gate() {  # restore exited 0, and the agent started only after it had finished
  local restore agent
  restore=$(container_of restore)
  agent=$(container_of agent)
  if [ -z "$restore" ] || [ -z "$agent" ]; then die "restore or agent container not found"; fi
  local code
  code=$("$ENGINE" wait "$restore" | tail -n 1)
  [ "$code" = 0 ] || die "the restore service exited with $code"
  python3 - "$("$ENGINE" inspect -f '{{json .State}}' "$restore")" "$("$ENGINE" inspect -f '{{json .State}}' "$agent")" <<'PY'
import json, re, sys
from datetime import datetime
def ts(s):  # RFC 3339 with nanoseconds (podman and docker) -> datetime
    s = re.sub(r"(\.\d{6})\d+", r"\1", s.replace("Z", "+00:00"))
    return datetime.fromisoformat(s)
restore, agent = json.loads(sys.argv[1]), json.loads(sys.argv[2])
done, started = ts(restore["FinishedAt"]), ts(agent["StartedAt"])
if started < done:
    sys.exit(f"the agent started at {started} before restore finished at {done}: this compose "
             "implementation ignores depends_on conditions (podman-compose >= 1.3 or docker compose needed)")
print(f"  restore exited 0 at {done.time()}, agent started at {started.time()}", file=sys.stderr)
PY
}

wait_in_sync() {  # poll `checkpoint-sidecar status` in the sidecar container until it exits 0
  local sidecar out deadline=$((SECONDS + TIMEOUT))
  sidecar=$(container_of sidecar)
  until out=$("$ENGINE" exec "$sidecar" checkpoint-sidecar status 2>&1); do
    if [ "$SECONDS" -ge "$deadline" ]; then printf '%s\n' "$out" >&2; die "store not in sync after ${TIMEOUT}s"; fi
    sleep 0.5
  done
  printf '%s\n' "$out" | sed 's/^/  /' >&2
}

up_staged() {
  compose up -d azurite
  compose up -d --no-deps restore
  local code
  code=$("$ENGINE" wait "$(container_of restore)" | tail -n 1)
  [ "$code" = 0 ] || die "the restore service exited with $code"
  compose up -d --no-deps sidecar agent
}

if [ "$(basename "${COMPOSE%% *}")" = podman-compose ]; then
  version=$($COMPOSE --version 2>/dev/null | sed -n 's/^podman-compose.* version *\([0-9][0-9.]*\).*/\1/p' | head -n 1)
  case "$version" in
    0.*|1.0.*|1.1.*|1.2.*|"") die "podman-compose ${version:-?} is too old (needs >= 1.3: pip install podman-compose)";;
  esac
fi

say "starting from scratch (removing leftovers of an earlier run)"
compose down -v -t 5 >/dev/null 2>&1 || true

say "up: azurite, then restore (must exit 0), then sidecar and agent"
up_staged
wait_url "$AGENT_URL/readiness"
check_gate

say "first request"
read -r RESPONSE_ID CALL_ID < <(responses first)
[ -n "${CALL_ID:-}" ] || die "no call_id from the first request"
echo "  response id $RESPONSE_ID" >&2

say "waiting until the sidecar has mirrored the paused checkpoint to Azurite"
wait_in_sync

say "compute recreation: down (graceful), remove the state volumes, keep azurite-data"
compose down -t 30
"$ENGINE" volume rm "${PROJECT}_checkpoints" "${PROJECT}_function-approvals"
"$ENGINE" volume inspect "${PROJECT}_azurite-data" >/dev/null || die "Azurite's volume is gone"

say "up again on fresh state volumes"
up_staged
wait_url "$AGENT_URL/readiness"
check_gate
"$ENGINE" logs "$(container_of restore)" 2>&1 | grep -E '"event": *"restore' | sed 's/^/  /' >&2 || true

say "continuation"
TEXT=$(responses continue "$RESPONSE_ID" "$CALL_ID")
[ "$TEXT" = "$EXPECTED" ] || die "continuation returned ${TEXT:-nothing}, expected \"$EXPECTED\""

say "the paused workflow survived compute recreation: \"$TEXT\""
