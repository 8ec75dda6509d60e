#!/usr/bin/env bash
# The main job in one command: build, start the Delegator daemon and the Executor service on
# loopback, delegate a sample workspace (a git repo with a small Python package), let an agent
# run real tools on the awcpfs mount, show what came back on the Delegator side, revoke the
# lease, show that access has ended, and clean up every process started here.
#
# Needs root and /dev/fuse (FUSE mounts), git, python3 and a Rust toolchain.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

if [ ! -e /dev/fuse ] || [ "$(id -u)" != 0 ]; then
  echo "demo.sh: needs root and /dev/fuse (FUSE mounts); run it as root on a machine with FUSE" >&2
  exit 1
fi
for tool in git python3 cargo; do
  command -v "$tool" >/dev/null || { echo "demo.sh: $tool is missing" >&2; exit 1; }
done

say "Building awcp-ctl (release)"
cargo build --release -q -p awcp-ctl
# Where cargo put the binary (CARGO_TARGET_DIR moves it).
CTL="${CARGO_TARGET_DIR:-$ROOT/target}/release/awcp-ctl"

WORK=$(mktemp -d /tmp/awcp-demo.XXXXXX)
# The Executor runs its agent confined, as the unprivileged user awcp-agent: that user must
# pass through $WORK to the work directory and read the agent's script (nothing else here).
chmod 711 "$WORK"
PIDS=()
cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    # What the services said, before their directory goes.
    for log in serve executor; do
      [ -s "$WORK/$log.log" ] || continue
      echo "--- the last lines of $log.log:" >&2
      tail -n 25 "$WORK/$log.log" >&2
    done
  fi
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # Anything still mounted under the demo directory is unmounted (lazily) before removal.
  grep " $WORK" /proc/self/mounts | cut -d' ' -f2 | xargs -r -n1 umount -l 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
API_PORT=$(free_port); DATA_PORT=$(free_port); EXEC_PORT=$(free_port)
export AWCP_DAEMON_URL="http://127.0.0.1:$API_PORT"
# The daemon writes its API token (0600) into its state directory; the client commands
# below find it there through AWCP_STATE_DIR.
export AWCP_STATE_DIR="$WORK/delegator"

say "Creating a sample workspace in $WORK/repo"
mkdir -p "$WORK/repo/calc" "$WORK/repo/tests"
cd "$WORK/repo"
printf 'def add(a, b):\n    return a - b  # bug\n' > calc/ops.py
touch calc/__init__.py tests/__init__.py
cat > tests/test_ops.py <<'PY'
import unittest
from calc.ops import add


class TestAdd(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
PY
git init -q -b main
git -c user.email=delegator@example.com -c user.name=delegator add -A
git -c user.email=delegator@example.com -c user.name=delegator commit -qm "calc: add (with a bug)"
cd "$ROOT"

# The agent: real tools on the mount. It fixes the bug, proves it with the tests, commits,
# then keeps working (sleeps) until the Delegator revokes its lease.
cat > "$WORK/agent.sh" <<'AGENT'
set -e
echo "agent: working in $PWD on '$AWCP_TASK_DESCRIPTION'"
git status --short --branch
python3 -m unittest -q 2>&1 | tail -1 || true
sed -i 's/return a - b  # bug/return a + b/' calc/ops.py
python3 -m unittest -q 2>&1 | tail -1
git -c user.email=agent@example.com -c user.name=agent commit -qam "calc: fix add"
git log --oneline | head -2
echo "agent: done; holding the workspace open until the lease ends"
exec sleep 3600
AGENT

say "Starting the Delegator daemon and the Executor service on loopback"
"$CTL" serve --listen "127.0.0.1:$API_PORT" --export-listen "127.0.0.1:$DATA_PORT" \
  --state-dir "$WORK/delegator" >"$WORK/serve.log" 2>&1 &
PIDS+=($!)
# The agent may write only in its workspace (and its own TMPDIR/HOME); it may read its script.
chmod 644 "$WORK/agent.sh"
"$CTL" executor --listen "127.0.0.1:$EXEC_PORT" --dir "$WORK/executor" \
  --agent-cmd "sh $WORK/agent.sh" --agent-allow-read "$WORK/agent.sh" >"$WORK/executor.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do
  curl -sf "$AWCP_DAEMON_URL/health" >/dev/null 2>&1 && curl -sf "http://127.0.0.1:$EXEC_PORT/awcp/status" >/dev/null 2>&1 && break
  sleep 0.1
done

say "Delegating the workspace (rw, 10 min lease)"
# The Executor drew its credential at first start (0600); a Delegator presents it in INVITE.
echo "the Executor's credential: $WORK/executor/state/executor-token"
OUT=$("$CTL" delegate "$WORK/repo" --to "http://127.0.0.1:$EXEC_PORT/awcp" --ttl 10m --mode rw \
  --executor-token-file "$WORK/executor/state/executor-token" \
  --task "fix the failing test in calc" --json)
ID=$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["delegationId"])' <<<"$OUT")
echo "delegation $ID"
"$CTL" watch "$ID" | sed 's/^/  [watch] /' &
PIDS+=($!)

# The agent's commit comes back to the Delegator's repository while it still runs.
agent_committed() { git -C "$WORK/repo" log --oneline 2>/dev/null | grep -q "calc: fix add"; }
# (A second on an idle machine; up to two minutes allowed for a loaded one.)
for _ in $(seq 1200); do agent_committed && break; sleep 0.1; done
agent_committed || { echo "the agent did not commit within two minutes" >&2; exit 1; }
MNT="$WORK/executor/work/$ID"
sleep 0.5

say "On the Delegator side, while the agent still holds the mount (live write-back)"
git -C "$WORK/repo" log --oneline
git -C "$WORK/repo" status --short
grep -n "return" "$WORK/repo/calc/ops.py"
"$CTL" status "$ID"

say "Revoking the lease"
grep -q " $MNT " /proc/self/mounts && echo "before: $MNT is mounted"
"$CTL" revoke "$ID"
for _ in $(seq 40); do grep -q " $MNT " /proc/self/mounts || break; sleep 0.05; done
if grep -q " $MNT " /proc/self/mounts; then
  echo "after: $MNT is STILL mounted" >&2; exit 1
fi
echo "after: $MNT is no longer mounted; access has ended"
sleep 0.5
"$CTL" status "$ID"

say "Done: the Executor's commit is in the Delegator's repository, and its access is gone"
git -C "$WORK/repo" log --oneline -1
