#!/usr/bin/env bash
# Delegate -> usable mount, two builds side by side: each build runs its own `awcp-ctl serve`
# and `awcp-ctl executor` on loopback, and the runs alternate between them (A, B, A, B, ...),
# so a busy machine slows both alike. Timed as scripts/bench.sh's `delegate` workload does:
# from just before `awcp-ctl delegate DIR --wait` to the timestamp the agent writes as its
# first action. One untimed delegation per build and directory first.
#
#   bash scripts/bench/delegate-ab.sh --a OLD_BIN_DIR --b NEW_BIN_DIR --runs 7 DIR...
#
# Each DIR is delegated in turn (e.g. the repo/ and repo-1k/ of scripts/bench/gen.py).
# Prints one line per DIR and build: median, min-max, and the samples. Needs root and
# /dev/fuse (the Executors mount). The daemons' logs (AWCP_LOG, default info) stay in the
# work directory with --keep.
set -euo pipefail

usage() {
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    cat <<'EOF'
options:
  --a DIR      directory holding awcpfs and awcp-ctl of build A (e.g. a copy of the old one)
  --b DIR      the same for build B (may be left out: only A is measured)
  --runs N     timed runs per build and directory (default 7)
  --keep       keep the work directory (logs)
EOF
}

A= B= RUNS=7 KEEP=0 DIRS=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --a) A=$2; shift ;;
        --b) B=$2; shift ;;
        --runs) RUNS=$2; shift ;;
        --keep) KEEP=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "delegate-ab: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) DIRS+=("$(cd "$1" && pwd)") ;;
    esac
    shift
done
[[ -n $A && ${#DIRS[@]} -gt 0 ]] || { usage >&2; exit 2; }
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "delegate-ab: --runs must be a positive integer" >&2; exit 2; }

WORK=$(mktemp -d /var/tmp/delegate-ab.XXXXXX)
chmod 755 "$WORK"   # the Executors' agent user passes through it to its work directory
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do
        for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null || true
    done
    if ((KEEP)) || [[ -e $WORK/failed ]]; then echo "logs kept in $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
port_open() {
    python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1",int(sys.argv[1])),1)' "$1" 2>/dev/null
}

ARMS=(a)
[[ -n $B ]] && ARMS+=(b)
declare -A BIN API EXEC
for arm in "${ARMS[@]}"; do
    [[ $arm == a ]] && dir=$A || dir=$B
    BIN[$arm]=$(cd "$dir" && pwd)
    [[ -x ${BIN[$arm]}/awcp-ctl ]] || { echo "delegate-ab: no awcp-ctl in $dir" >&2; exit 2; }
    d=$WORK/$arm
    mkdir -p "$d/delegator" "$d/executor" "$d/agent"
    # The agent runs as the Executor's agent user, under Landlock: let it write its stamp.
    chmod 1777 "$d/agent"
    API[$arm]=$(free_port)
    EXEC[$arm]=$(free_port)
    "${BIN[$arm]}/awcp-ctl" serve --state-dir "$d/delegator" --listen "127.0.0.1:${API[$arm]}" \
        --export-listen "127.0.0.1:$(free_port)" >>"$d/serve.log" 2>&1 &
    PIDS+=($!)
    "${BIN[$arm]}/awcp-ctl" executor --dir "$d/executor" --listen "127.0.0.1:${EXEC[$arm]}" \
        --agent-allow-write "$d/agent" \
        --agent-cmd "date +%s%N > '$d/agent/ts'; ls -A > /dev/null" >>"$d/executor.log" 2>&1 &
    PIDS+=($!)
done
for arm in "${ARMS[@]}"; do
    for port in "${API[$arm]}" "${EXEC[$arm]}"; do
        for _ in $(seq 600); do
            port_open "$port" && break
            for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || break 3; done
            sleep 0.1
        done
        port_open "$port" || { echo "delegate-ab: a daemon of build $arm did not start (see $WORK/$arm)" >&2; KEEP=1; exit 1; }
    done
done

# delegate ARM DIR: one delegation; prints the seconds to the agent's first action
delegate() {
    local arm=$1 dir=$2 d=$WORK/$1 t0 t1
    rm -f "$d/agent/ts"
    t0=${EPOCHREALTIME/./}
    if ! timeout -k 10 600 "${BIN[$arm]}/awcp-ctl" --daemon "http://127.0.0.1:${API[$arm]}" \
            --api-token-file "$d/delegator/api-token" \
            delegate "$dir" --to "http://127.0.0.1:${EXEC[$arm]}/awcp" --task bench --wait \
            --executor-token-file "$d/executor/state/executor-token" >>"$d/delegate.log" 2>&1 ||
        [[ ! -s $d/agent/ts ]]; then
        echo "delegate-ab: build $arm failed to delegate $dir (see $d/delegate.log)" >&2
        touch "$WORK/failed"   # this runs in a subshell: the logs are kept at exit
        exit 1
    fi
    t1=$(($(cat "$d/agent/ts") / 1000))
    python3 -c 'import sys; print(f"{int(sys.argv[1]) / 1e6:.3f}")' $((t1 - t0))
}

for dir in "${DIRS[@]}"; do
    declare -A SAMPLES=()
    for arm in "${ARMS[@]}"; do delegate "$arm" "$dir" >/dev/null || exit 1; done   # warm-up
    for ((i = 1; i <= RUNS; i++)); do
        for arm in "${ARMS[@]}"; do
            s=$(delegate "$arm" "$dir") || exit 1
            SAMPLES[$arm]+="$s "
        done
    done
    for arm in "${ARMS[@]}"; do
        python3 - "$dir" "$arm" "${BIN[$arm]}" ${SAMPLES[$arm]} <<'EOF'
import statistics, sys
d, arm, bin_dir, *xs = sys.argv[1:]
xs = [float(x) for x in xs]
print(f"{d}  build {arm} ({bin_dir}): median {statistics.median(xs) * 1000:.0f} ms, "
      f"{min(xs) * 1000:.0f}-{max(xs) * 1000:.0f} ms, n={len(xs)}: "
      + " ".join(f"{x * 1000:.0f}" for x in xs))
EOF
    done
    unset SAMPLES
done
